"""The KV cache interface and the per-tier memory ledger.

A cache owns attention: the model hands it each layer's new keys/values and gets the attention
output back, so a cache can compute where its data lives. Memory is accounted in bytes per tier
("device", "host") by a :class:`MemoryLedger`, against optional budgets; strategies evict when
the ledger crosses a threshold, never by catching out-of-memory errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from hybridllm.errors import ConfigError, HybridLLMError
from hybridllm.kvcache.attention import PLAIN, AttentionOptions, HostAttention

TIERS = ("device", "host")


class KVBudgetError(HybridLLMError, RuntimeError):
    """The device budget cannot hold even the KV that must stay on the device (sink tokens,
    the newest partial page and the tokens being added); raise the budget or lower the
    prefill chunk."""


@dataclass
class TierUsage:
    """Bytes currently held, the high-water mark, and the budget (None: unlimited) of a tier."""

    current: int = 0
    peak: int = 0
    budget: int | None = None


class MemoryLedger:
    """Counts bytes per memory tier against budgets. Plain ints: testable without tensors.

    Args:
        budgets: bytes allowed per tier ("device", "host"); missing or None means unlimited.
        threshold: fraction of a budget at which :meth:`over_threshold` turns true (eviction point).
    """

    def __init__(self, budgets: dict[str, int | None] | None = None, threshold: float = 0.95) -> None:
        if not 0 < threshold <= 1:
            raise ConfigError(f"ledger threshold must be in (0, 1], got {threshold}")
        budgets = budgets or {}
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise ConfigError(f"unknown memory tiers {sorted(unknown)}; tiers are {TIERS}")
        self.threshold = threshold
        self._tiers = {tier: TierUsage(budget=budgets.get(tier)) for tier in TIERS}

    def allocate(self, tier: str, nbytes: int) -> None:
        usage = self._tiers[tier]
        usage.current += nbytes
        usage.peak = max(usage.peak, usage.current)

    def free(self, tier: str, nbytes: int) -> None:
        usage = self._tiers[tier]
        if nbytes > usage.current:
            raise RuntimeError(f"ledger: freeing {nbytes} bytes from {tier} which holds {usage.current}")
        usage.current -= nbytes

    def current(self, tier: str) -> int:
        return self._tiers[tier].current

    def peak(self, tier: str) -> int:
        return self._tiers[tier].peak

    def budget(self, tier: str) -> int | None:
        return self._tiers[tier].budget

    def limit(self, tier: str) -> int | None:
        """Bytes at which eviction starts: threshold x budget (None when unlimited)."""
        budget = self._tiers[tier].budget
        return None if budget is None else int(budget * self.threshold)

    def fits(self, tier: str, extra_bytes: int) -> bool:
        """Whether ``extra_bytes`` more stay under the tier's eviction limit."""
        limit = self.limit(tier)
        return limit is None or self._tiers[tier].current + extra_bytes <= limit

    def headroom(self, tier: str) -> int | None:
        """Bytes that still fit under the tier's eviction limit (None when unlimited)."""
        limit = self.limit(tier)
        return None if limit is None else max(0, limit - self._tiers[tier].current)

    def over_threshold(self, tier: str) -> bool:
        return not self.fits(tier, 0)

    def reset_peaks(self) -> None:
        for usage in self._tiers.values():
            usage.peak = usage.current

    def snapshot(self) -> dict[str, dict[str, int | None]]:
        return {t: {"current": u.current, "peak": u.peak, "budget": u.budget} for t, u in self._tiers.items()}


@dataclass(frozen=True)
class KVSpec:
    """Shape and placement of a cache: what every strategy needs to allocate its storage."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device  # the compute device (the "device" tier)
    host_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 1
    max_tokens: int = 4096  # the model's context window: the cache never holds more
    # Each layer's attention options (sliding window, scale, soft-cap); (): plain everywhere.
    attention: tuple[AttentionOptions, ...] = ()
    # How KV held in host RAM is attended where it lies when the device is another (the host part
    # of a split attention: the native kernels); None: PyTorch over the rows read out.
    host_attention: HostAttention | None = None

    def layer_options(self, layer_idx: int) -> AttentionOptions:
        """How layer ``layer_idx`` attends (:data:`~hybridllm.kvcache.attention.PLAIN` by default)."""
        return self.attention[layer_idx] if self.attention else PLAIN

    def layer_windows(self) -> list[int]:
        """Each layer's sliding window as the native kernels take it (0: none)."""
        return [self.layer_options(i).window or 0 for i in range(self.n_layers)]

    @property
    def plain_attention(self) -> bool:
        """Whether every layer attends plainly (every strategy serves it)."""
        return all(options.plain for options in self.attention)

    def token_bytes(self, element_size: float | None = None) -> float:
        """Bytes of K and V for one token in one layer."""
        size = element_size if element_size is not None else torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch_size * self.n_kv_heads * self.head_dim * size


class KVFormat(IntEnum):
    """How a store holds a run of tokens, as the native kernels read it in place (their abi.h's KVFormat)."""

    F32 = 0
    F16 = 1
    Q8 = 2  # int8 codes, keys and values per token in groups of channels: value = code * scale + zero
    Q4 = 3  # the same, 4-bit codes two per byte (element 2i in the low nibble)
    Q8_CHANNEL_KEYS = 4  # values as Q8, keys per channel in groups of tokens (KIVI)
    Q4_CHANNEL_KEYS = 5


RUN_FIELDS = ("format", "group", "key_group", "position", "tokens", "row0", "capacity", "k", "v", "k_scale", "k_zero",
              "v_scale", "v_zero")


@dataclass
class InPlaceRows:
    """:meth:`KVCache.in_place_rows`: the claimed layers' KV of one sequence for a step of n tokens,
    as a kernel reads and writes it in place: columns over the claimed layers (each value a list
    with one entry per layer, or one int for all of them).

    ``runs``: up to three runs in position order, each a dict of :data:`RUN_FIELDS`: its
    :class:`KVFormat`, quantization ``group`` (channels per scale of values and per-token keys) and
    ``key_group`` (tokens per scale of per-channel keys), the sequence ``position`` of its buffer row
    ``row0``, its ``tokens`` (this step's included), the buffers' rows per KV head
    (``capacity``) and the addresses of its buffers (B=1, Hkv, capacity, ...): ``k``, ``v``, and
    for quantized runs their float16 ``k_scale``, ``k_zero``, ``v_scale``, ``v_zero`` (missing: 0).
    Together they hold positions 0 .. start + n - 1 (older ones a sliding window hides may be
    left out). The step's rows go to run ``write`` from buffer row ``write_row``; ``window`` is
    each layer's sliding window (0: none). ``settle`` > 0 (a quantized residual): after the
    layer's attention the kernel quantizes that many rows from the front of run ``write`` onto run
    ``write - 1`` at row ``settle_row`` and moves the rest of run ``write`` down; the cache counts
    them there already.
    """

    start: int
    runs: list[dict[str, list[int] | int]]
    write: list[int] | int
    write_row: list[int] | int
    window: list[int] | int = 0
    settle: list[int] | int = 0
    settle_row: list[int] | int = 0


def _per_layer(value: list[int] | int, n_layers: int) -> list[int]:
    return list(value) if isinstance(value, list) else [value] * n_layers


def merge_in_place_rows(claims: list[tuple[list[int], InPlaceRows]], n_layers: int) -> InPlaceRows:
    """One description of ``n_layers`` layers from several claims, each of the layers at the given
    indices (a split cache's parts); runs a claim lacks are empty (no tokens)."""
    n_runs = max(len(claim.runs) for _, claim in claims)
    runs = [{name: [0] * n_layers for name in RUN_FIELDS} for _ in range(n_runs)]
    merged = {name: [0] * n_layers for name in ("write", "write_row", "window", "settle", "settle_row")}
    starts = {claim.start for _, claim in claims}
    if len(starts) != 1:
        raise ValueError("in-place rows need every layer claimed at the same length")
    for indices, claim in claims:
        for j, run in enumerate(claim.runs):
            for name in RUN_FIELDS:
                column = _per_layer(run.get(name, 0), len(indices))
                for at, value in zip(indices, column):
                    runs[j][name][at] = value
        for name in merged:
            for at, value in zip(indices, _per_layer(getattr(claim, name), len(indices))):
                merged[name][at] = value
    return InPlaceRows(starts.pop(), runs, **merged)


def dense_run(fmt: KVFormat, tokens: int, capacity: list[int] | int, keys: list[int] | int,
              values: list[int] | int) -> dict[str, list[int] | int]:
    """A run of dense rows holding positions 0 .. tokens - 1 from buffer row 0."""
    return {"format": int(fmt), "position": 0, "tokens": tokens, "row0": 0, "capacity": capacity, "k": keys,
            "v": values}


def dense_format(dtype: torch.dtype) -> KVFormat:
    """The :class:`KVFormat` of dense rows of ``dtype`` (float32 or float16)."""
    return KVFormat.F16 if dtype == torch.float16 else KVFormat.F32


class KVCache(ABC):
    """Stores keys/values of every layer and computes causal attention over them.

    Subclasses implement :meth:`attend` and the storage; this base tracks lengths per layer,
    the ledger, and the bus-traffic counters that the metrics read.
    """

    name: str = "base"

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None) -> None:
        self.spec = spec
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self._lengths = [0] * spec.n_layers
        self.bus_bytes = {"h2d": 0, "d2h": 0}  # bytes moved host tier -> device tier and back
        self.pages_moved = 0

    # ---- the contract -------------------------------------------------------------------
    @abstractmethod
    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Append ``k_new``/``v_new`` (B, Hkv, T, D) to layer ``layer_idx`` and attend.

        ``q`` (B, H, T, D) holds the queries of the same T new tokens, at positions
        ``length(layer_idx) .. length(layer_idx) + T - 1``. Returns (B, H, T, D) in q's dtype
        and device: causal attention over everything cached for the layer.
        """

    @abstractmethod
    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached key and value of a layer in position order: (B, Hkv, length, D) each, in
        the compute dtype (quantized tokens dequantized), on whatever device holds them. Used to
        move a cache elsewhere (phase migration); attention never needs it."""

    @abstractmethod
    def _release_from(self, length: int) -> None:
        """Drop storage of every token at position >= ``length`` in every layer (and free it)."""

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` (B, Hkv, T, D), a layer's next T tokens, without attending.

        They are stored the way the strategy stores new tokens (its pages, tiers and quantization
        apply). This fills a cache from another one: a fork of the prompt's KV, a reused prefix.
        Strategies that cannot say so (:attr:`extendable` False).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot append tokens without attending")

    extendable: bool = False  # whether :meth:`extend` is implemented

    # ---- shared behaviour ---------------------------------------------------------------
    @property
    def seq_length(self) -> int:
        """Tokens cached in every layer: the position of the next token."""
        return min(self._lengths)

    def length(self, layer_idx: int) -> int:
        return self._lengths[layer_idx]

    def host_tokens(self, layer_idx: int) -> int:
        """Tokens of a layer whose KV is held in the host tier (the rest is on the device)."""
        return 0

    def reserve(self, n_tokens: int) -> None:
        """Hint that up to ``n_tokens`` will be cached, so storage can be allocated once."""

    def supports_in_place(self, layer_idx: int) -> bool:
        """Whether :meth:`in_place_rows` serves this layer: a kernel may read and write its KV
        where the cache holds it (host buffers of a batch of one, in a format the native kernels
        read)."""
        return False

    def supports_in_place_layers(self, layer_indices: Sequence[int]) -> bool:
        """Whether :meth:`in_place_rows` serves all these layers."""
        return all(self.supports_in_place(i) for i in layer_indices)

    def in_place_rows(self, layer_indices: Sequence[int], n_new: int) -> InPlaceRows:
        """Room for ``n_new`` tokens in each layer given (all at the same length), counted as
        appended: the caller writes their keys and values where the returned description says
        and attends over the layer's runs itself (the native steps). Only where
        :meth:`supports_in_place_layers`."""
        raise NotImplementedError(f"{type(self).__name__} has no in-place rows")

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors that hold the KV, per tier: the ledger's counts must equal their bytes."""
        raise NotImplementedError(f"{type(self).__name__} does not list its storage")

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` tokens (e.g. after a rejected draft or a failed step)."""
        if length < 0 or length > max(self._lengths):
            raise ValueError(f"cannot truncate a cache of {self.seq_length} tokens to {length}")
        self._release_from(length)
        self._lengths = [min(n, length) for n in self._lengths]

    def reset(self) -> None:
        """Drop every token and free all storage."""
        self.truncate(0)

    def bytes_per_tier(self) -> dict[str, int]:
        return {tier: self.ledger.current(tier) for tier in TIERS}

    def peak_bytes_per_tier(self) -> dict[str, int]:
        return {tier: self.ledger.peak(tier) for tier in TIERS}

    def _count_bus(self, direction: str, nbytes: int) -> None:
        """Record ``nbytes`` crossing between the tiers ("h2d" or "d2h"); logical when both are the CPU."""
        self.bus_bytes[direction] += nbytes

    def _advance(self, layer_idx: int, n_tokens: int) -> int:
        """Record ``n_tokens`` appended to a layer; returns the layer's length before them."""
        past = self._lengths[layer_idx]
        if past + n_tokens > self.spec.max_tokens:
            raise ValueError(f"KV cache full: {past} + {n_tokens} tokens exceed {self.spec.max_tokens}")
        self._lengths[layer_idx] = past + n_tokens
        return past


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Real storage bytes of tensors (what the ledger must equal)."""
    return sum(t.numel() * t.element_size() for t in tensors)

