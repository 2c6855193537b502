"""Admission arithmetic of the request loop: plain numbers, testable without tensors."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from hybridllm.config import SamplingParams
from hybridllm.errors import ConfigError, HybridLLMError
from hybridllm.kvcache.base import TIERS, KVBudgetError, MemoryLedger
from hybridllm.kvcache.registry import admission_tiers, get_strategy, tiers_capacity


class AdmissionError(HybridLLMError, ValueError):
    """The request's KV can never fit in the budgets (the server answers 400)."""


class DeviceRoomError(AdmissionError, KVBudgetError):
    """The device budget cannot hold a new sequence's first prefill chunk (and the tokens that
    must stay hot with it), with no adaptive policy to move it to the host."""


class QueueFullError(HybridLLMError):
    """The waiting queue is full (the server answers 503 with Retry-After)."""


def kv_bytes_needed(n_tokens: int, token_bytes: int, page_size: int) -> int:
    """Bytes of KV for ``n_tokens`` in whole pages of ``page_size`` tokens.

    ``token_bytes`` is the KV of one token across all layers (K and V, full precision).
    """
    if n_tokens < 0 or token_bytes < 0 or page_size < 1:
        raise ValueError("n_tokens and token_bytes must be >= 0 and page_size >= 1")
    pages = -(-n_tokens // page_size)
    return pages * page_size * token_bytes


def admission_decision(need: int, reserved: int, capacity: int | None) -> str:
    """"admit" when ``need`` bytes fit next to the ``reserved`` ones, "wait" when they will fit
    once others finish, "reject" when they can never fit."""
    if capacity is None:
        return "admit"
    if need > capacity:
        return "reject"
    return "admit" if reserved + need <= capacity else "wait"


def grows_page_by_page(strategy: str, ledger: MemoryLedger) -> bool:
    """Whether a new cache of ``strategy`` grows its device store page by page instead of being
    allocated up front: a strategy that spills to the host (``tiered``) under a bounded device
    budget, so that running sequences share the device and spill their cold pages."""
    return get_strategy(strategy).spills_to_host and ledger.limit("device") is not None


@dataclass
class KVBudget:
    """The KV arithmetic of one request loop's admission.

    Attributes:
        strategy: the KV strategy's name.
        ledger: the loop's ledger (its device limit and what is held now).
        token_bytes: K + V of one token across all layers, full precision.
        page_size: tokens per page (reservations are whole pages).
        tiers: the memory tiers a request's KV counts in: both when the adaptive policy may move
            it to the host, else those the strategy stores tokens in.
        capacity: bytes the running sequences may reserve (None: unbounded).
        prefill_chunk, sink_tokens: what a spilling cache keeps on the device while its first chunk lands.
        adaptive: the adaptive policy can move a sequence to the host (then no device-room refusal).
    """

    strategy: str
    ledger: MemoryLedger
    token_bytes: int
    page_size: int
    tiers: tuple[str, ...]
    capacity: int | None
    prefill_chunk: int
    sink_tokens: int
    adaptive: bool

    @classmethod
    def of(cls, runtime: Any, ledger: MemoryLedger, adaptive: bool) -> KVBudget:
        """The budget of a loop over ``runtime`` whose KV counts in ``ledger``: the capacity of the
        tiers the strategy stores tokens in, or of both tiers when the adaptive policy can move any
        sequence's KV to the host."""
        kv, spec = runtime.kv_config, runtime.kv_spec()
        tiers = TIERS if adaptive else admission_tiers(kv.kv_cache)
        capacity = tiers_capacity(tiers, {tier: ledger.budget(tier) for tier in TIERS})
        return cls(kv.kv_cache, ledger, int(spec.token_bytes() * spec.n_layers), kv.kv_page_size, tiers, capacity,
                   runtime.engine_config.prefill_chunk, kv.kv_sink_tokens, adaptive)

    def check(self, prompt_len: int, max_new: int, n: int) -> int:
        """The bytes a request of ``n`` sequences reserves; AdmissionError when it can never fit."""
        need = n * kv_bytes_needed(prompt_len + max_new, self.token_bytes, self.page_size)
        if admission_decision(need, 0, self.capacity) == "reject":
            copies = f" x {n} sequences" if n > 1 else ""
            raise AdmissionError(
                f"the request needs {need} bytes of KV cache ({prompt_len} prompt + {max_new} new tokens{copies}) "
                f"but the {self.strategy} KV cache may use at most {self.capacity} bytes; "
                f"shorten the prompt or lower max_tokens")
        room, limit = self.device_room_needed(prompt_len), self.ledger.limit("device")
        if room and room > limit and not self.adaptive:
            raise DeviceRoomError(
                f"the {self.strategy} KV cache must keep the first prefill chunk on the device ({room} bytes), "
                f"more than its device budget allows ({limit} bytes); raise --vram-budget or lower --prefill-chunk")
        return need

    def device_room_needed(self, prompt_len: int) -> int:
        """Free device KV bytes a new sequence needs before its first prefill chunk can run: only
        for strategies that spill to the host under a bounded device budget (``tiered``): a cache
        evicts its own cold pages, never another sequence's, so the tokens that must stay hot while
        they are added (sinks, the first chunk, a partial page) have to fit in what the running
        sequences leave free. 0 when no such limit applies."""
        if not grows_page_by_page(self.strategy, self.ledger):
            return 0
        tokens = self.sink_tokens + min(prompt_len, self.prefill_chunk) + self.page_size
        return kv_bytes_needed(tokens, self.token_bytes, self.page_size)

    def device_room_free(self, prompt_len: int, unstarted_prompt_lens: list[int]) -> bool:
        """Whether the device has room for a new sequence's first chunk next to the first chunks
        promised to the running sequences that have not prefilled yet."""
        room = self.device_room_needed(prompt_len)
        if not room:
            return True
        promised = sum(self.device_room_needed(n) for n in unstarted_prompt_lens)
        return room + promised <= self.ledger.limit("device") - self.ledger.current("device")


def check_sampling_params(params: SamplingParams, vocab_size: int, max_batch: int) -> None:
    """What sampling parameters must fit in a loop: ``logit_bias`` ids in the vocabulary, ``n``
    sequences in one batch (ConfigError otherwise)."""
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise ConfigError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if params.n > max_batch:
        raise ConfigError(f"n={params.n} sequences do not fit in a batch of at most {max_batch}; "
                          f"lower n or raise --max-batch")

