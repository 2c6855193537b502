"""Continuous batching: many requests share the model, one scheduler step at a time.

One loop thread owns the model (it is never called from two threads). Each step:

1. applies aborts (a client that went away frees its KV now, not when it would have finished);
2. admits waiting requests, first come first served, while the running set has room
   (``max_batch``) and their KV fits (see :func:`admission_decision`);
3. decodes one token for every running sequence in ONE batched forward: the rows' own KV
   caches sit behind a :class:`~hybridllm.kvcache.batch.BatchedCaches`, and the rows' positions
   go to the model as a (B,) ``start_pos``;
4. prefills new sequences in chunks of ``prefill_chunk`` prompt tokens, at most that many
   tokens per step, so a long prompt does not stall the running decodes.

Finished sequences leave the running set at once and their KV is freed before their last
event is sent. Every sequence keeps its own KV cache (paged, in whatever tiers its strategy
uses); all of them count in one shared :class:`~hybridllm.kvcache.base.MemoryLedger`, so a
strategy that evicts on ledger pressure (``tiered``) moves cold pages of running requests to
the host instead of anything being preempted.

Token selection, stop rules and text streaming mirror :class:`~hybridllm.engine.generator.Generator`
step for step (same prefill chunk boundaries, same sampler calls, same stop-string matcher),
so greedy output equals ``LLM.generate`` for the same prompt.

Results go to each request's ``sink`` callable, called on the loop thread; the server passes
one that hands events to its asyncio loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.output import RequestOutput, check_prompt
from hybridllm.engine.sampling import Sampler
from hybridllm.errors import ConfigError, HybridLLMError
from hybridllm.kvcache.base import TIERS, KVCache, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches

if TYPE_CHECKING:
    from hybridllm.llm import LLM

logger = logging.getLogger(__name__)

# The tiers each KV strategy stores tokens in: admission counts only those budgets.
KV_TIERS_BY_STRATEGY: dict[str, tuple[str, ...]] = {
    "dynamic": ("device",),
    "quantized": ("device",),
    "offloaded": ("host",),
    "host": ("host",),
    "tiered": ("device", "host"),
}


class AdmissionError(HybridLLMError, ValueError):
    """The request's KV can never fit in the budgets (the server answers 400)."""


class QueueFullError(HybridLLMError):
    """The waiting queue is full (the server answers 503 with Retry-After)."""


# ---- admission: plain numbers ------------------------------------------------------------
def kv_bytes_needed(n_tokens: int, token_bytes: int, page_size: int) -> int:
    """Bytes of KV for ``n_tokens`` in whole pages of ``page_size`` tokens.

    ``token_bytes`` is the KV of one token across all layers (K and V, full precision).
    """
    if n_tokens < 0 or token_bytes < 0 or page_size < 1:
        raise ValueError("n_tokens and token_bytes must be >= 0 and page_size >= 1")
    pages = -(-n_tokens // page_size)
    return pages * page_size * token_bytes


def kv_capacity(strategy: str, budgets: dict[str, int | None]) -> int | None:
    """Bytes of KV the strategy may hold: the sum of the budgets of the tiers it stores in.

    None when any of those tiers is unbounded.
    """
    total = 0
    for tier in KV_TIERS_BY_STRATEGY.get(strategy, TIERS):
        budget = budgets.get(tier)
        if budget is None:
            return None
        total += budget
    return total


def admission_decision(need: int, reserved: int, capacity: int | None) -> str:
    """"admit" when ``need`` bytes fit next to the ``reserved`` ones, "wait" when they will fit
    once others finish, "reject" when they can never fit."""
    if capacity is None:
        return "admit"
    if need > capacity:
        return "reject"
    return "admit" if reserved + need <= capacity else "wait"


# ---- per-sequence state --------------------------------------------------------------------
@dataclass
class SeqEvent:
    """What a sequence produced since its last event. The last one has ``finish_reason`` (or ``error``)."""

    request_id: str
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # every generated id, on the last event
    full_text: str = ""  # the whole completion, on the last event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class SequenceState:
    """A request inside the scheduler: its prompt, its own KV cache, sampler, decoder, stop rules, times."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    kv_bytes: int  # reserved for admission: (prompt + max_new_tokens) in whole pages
    sink: Callable[[SeqEvent], None]
    arrival_time: float = field(default_factory=time.perf_counter)
    cache: KVCache | None = None
    sampler: Sampler | None = None
    output: RequestOutput | None = None  # text, stop rules, token budget
    history: torch.Tensor | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    pending: int | None = None  # sampled token not yet fed to the model
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return [] if self.output is None else self.output.generated

    @property
    def in_prefill(self) -> bool:
        return self.pending is None and self.prefilled < len(self.prompt_ids)


class SchedulerObserver:
    """Hooks the scheduler calls on its loop thread (the server's metrics implement them)."""

    def on_scheduled(self, seq: SequenceState) -> None:
        """The sequence left the queue and got its KV cache."""

    def on_prompt_done(self, seq: SequenceState) -> None:
        """The whole prompt is in the cache."""

    def on_token(self, seq: SequenceState, interval_s: float | None) -> None:
        """A token was sampled; ``interval_s`` since the previous one (None for the first)."""

    def on_finished(self, seq: SequenceState) -> None:
        """The sequence left (``seq.finish_reason``: stop, length, abort or error); its KV is freed."""

    def on_step(self, decode_rows: int, prefill_tokens: int) -> None:
        """A scheduler step ran: ``decode_rows`` sequences decoded in one batch, plus prefill tokens."""


class Scheduler:
    """The continuous-batching scheduler of one loaded model.

    Args:
        llm: the loaded model; its engine's ``prefill_chunk`` sets the chunk size (and the
            prefill token budget of a step), so chunk boundaries equal ``LLM.generate``'s.
        max_batch: most sequences running at once (prefilling or decoding).
        max_queue: most requests waiting; more are refused with :class:`QueueFullError`.
        host_budget: bytes of host RAM the KV may use (default: the RAM available now).
        observer: metrics hooks.
    """

    def __init__(
        self,
        llm: LLM,
        max_batch: int = 16,
        max_queue: int = 256,
        host_budget: int | None = None,
        observer: SchedulerObserver | None = None,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
        self.llm = llm
        self.model = llm.runner
        self.tokenizer = llm.tokenizer
        self.device = llm.engine_config.torch_device
        self.context_length = llm.config.max_position_embeddings
        self.vocab_size = llm.config.vocab_size
        self.prefill_chunk = llm.engine_config.prefill_chunk
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.observer = observer or SchedulerObserver()
        engine_ledger = llm._kv_ledger()  # the device budget left after the weights
        if host_budget is None:
            host_budget = psutil.virtual_memory().available
        self.ledger = MemoryLedger(
            {"device": engine_ledger.budget("device"), "host": host_budget}, threshold=engine_ledger.threshold
        )
        probe = llm.new_cache(self.ledger)  # an empty cache: its spec gives the bytes per token
        self.kv_strategy = probe.name
        spec = probe.spec
        probe.reset()  # frees anything a strategy allocates up front
        self.page_size = llm.kv_config.kv_page_size
        self.token_bytes = int(spec.token_bytes() * spec.n_layers)  # K+V of one token, all layers
        self.capacity = kv_capacity(llm.kv_config.kv_cache, {t: self.ledger.budget(t) for t in TIERS})
        self._cond = threading.Condition()
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._running: list[SequenceState] = []
        self._abort_ids: set[str] = set()
        self._reserved = 0  # KV bytes promised to running sequences
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._bus_done = {"h2d": 0, "d2h": 0}  # bus bytes of caches already freed
        # --decode-on host: each sequence's KV moves to the host when its prompt is done, and
        # every decode step runs on the host copy of the weights
        self.migration = llm.phase_migration() if llm.placement.decode_on == "host" else None
        self.decode_model = self.migration.decode_model if self.migration is not None else self.model
        self._models = list({id(m): m for m in (self.model, self.decode_model)}.values())
        self._hop_start = sum(m.hop_bytes for m in self._models)
        self.steps = 0
        self.decode_batch_sizes: collections.Counter[int] = collections.Counter()

    # ---- public API (any thread) ---------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Callable[[SeqEvent], None],
    ) -> SequenceState:
        """Queue a request. Raises ContextOverflowError (bad prompt), AdmissionError (can never
        fit) or QueueFullError; otherwise ``sink`` gets its events from the loop thread."""
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt)
        max_new = min(params.max_tokens, self.context_length - len(prompt))
        need = kv_bytes_needed(len(prompt) + max_new, self.token_bytes, self.page_size)
        if admission_decision(need, 0, self.capacity) == "reject":
            raise AdmissionError(
                f"the request needs {need} bytes of KV cache ({len(prompt)} prompt + {max_new} new tokens) "
                f"but the {self.kv_strategy} KV cache may use at most {self.capacity} bytes; "
                f"shorten the prompt or lower max_tokens"
            )
        room = self.device_room_needed(len(prompt))
        limit = self.ledger.limit("device")
        if room and room > limit:
            raise AdmissionError(
                f"the {self.kv_strategy} KV cache must keep the first prefill chunk on the device ({room} bytes), "
                f"more than its device budget allows ({limit} bytes); raise --vram-budget or lower --prefill-chunk"
            )
        seq = SequenceState(request_id, prompt, params, max_new, need, sink)
        with self._cond:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away): out of the queue now, or its KV freed at the
        end of the current step."""
        with self._cond:
            for seq in self._waiting:
                if seq.request_id == request_id:
                    self._waiting.remove(seq)
                    seq.finish_reason = "abort"
                    seq.finish_time = time.perf_counter()
                    self.observer.on_finished(seq)
                    return
            self._abort_ids.add(request_id)
            self._cond.notify()

    def device_room_needed(self, prompt_len: int) -> int:
        """Free device KV bytes a new sequence needs before its first prefill chunk can run.

        Only for strategies that spill to the host under a bounded device budget (``tiered``):
        a cache evicts its own cold pages, never another sequence's, so the tokens that must stay
        hot while they are added (sinks, the first chunk, a partial page) have to fit in what the
        running sequences leave free. 0 when no such limit applies.
        """
        if self.kv_strategy != "tiered" or self.ledger.limit("device") is None:
            return 0
        tokens = self.llm.kv_config.kv_sink_tokens + min(prompt_len, self.prefill_chunk) + self.page_size
        return kv_bytes_needed(tokens, self.token_bytes, self.page_size)

    def check_prompt(self, prompt: list[int]) -> None:
        """The generator's prompt rules: non-empty, shorter than the context, ids in the vocabulary."""
        check_prompt(prompt, self.context_length, self.vocab_size)

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridllm-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still queued or running end with an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all("the server is shutting down")

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics: requests, KV bytes/pages/budgets per tier, bus bytes."""
        running = list(self._running)
        bus = dict(self._bus_done)
        for seq in running:
            cache = seq.cache
            if cache is not None:
                for direction, n in cache.bus_bytes.items():
                    bus[direction] = bus.get(direction, 0) + n
        bus["hidden_states"] = sum(m.hop_bytes for m in self._models) - self._hop_start
        page_bytes = self.page_size * self.token_bytes
        kv_bytes = {tier: self.ledger.current(tier) for tier in TIERS}
        return {
            "running": len(running),
            "waiting": len(self._waiting),
            "kv_bytes": kv_bytes,
            "kv_budget_bytes": {tier: self.ledger.budget(tier) for tier in TIERS},
            "kv_pages": {tier: -(-n // page_bytes) for tier, n in kv_bytes.items()},
            "kv_reserved_bytes": self._reserved,
            "kv_capacity_bytes": self.capacity,
            "bus_bytes": bus,
        }

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running or self._abort_ids):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # never let the loop die: fail what was running, keep serving
                logger.exception("scheduler step failed")
                for seq in list(self._running):
                    self._finish_error(seq, f"internal error: {exc}")

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Run steps on the calling thread until nothing is queued or running (tests, tools)."""
        if self.is_running:
            raise RuntimeError("the loop thread is running; do not step from another thread")
        steps = 0
        while (self._waiting or self._running or self._abort_ids) and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def step(self) -> None:
        """One iteration: aborts, admission, one batched decode, chunked prefill."""
        self._apply_aborts()
        self._admit()
        if not self._running:
            return
        self.steps += 1
        with torch.inference_mode():
            decode_rows = self._decode_step()
            prefill_tokens = self._prefill_step()
        self.observer.on_step(decode_rows, prefill_tokens)

    def _apply_aborts(self) -> None:
        with self._cond:
            ids, self._abort_ids = self._abort_ids, set()
        if not ids:
            return
        for seq in list(self._running):
            if seq.request_id in ids:
                seq.finish_reason = "abort"
                self._release(seq)
                self.observer.on_finished(seq)

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or len(self._running) >= self.max_batch:
                    return
                seq = self._waiting[0]
                if admission_decision(seq.kv_bytes, self._reserved, self.capacity) != "admit":
                    return  # first come first served: the head waits for room, nobody overtakes it
                if self._running and not self._device_room_free(seq):
                    return  # wait until running sequences leave device room for its first chunk
                self._waiting.popleft()
                self._reserved += seq.kv_bytes
                self._running.append(seq)
            try:
                self._start(seq)
            except Exception as exc:
                logger.exception("could not start a sequence")
                self._finish_error(seq, f"could not start the request: {exc}")

    def _device_room_free(self, seq: SequenceState) -> bool:
        room = self.device_room_needed(len(seq.prompt_ids))
        if not room:
            return True
        # sequences admitted but not prefilled yet have not allocated their first chunk
        promised = sum(self.device_room_needed(len(s.prompt_ids)) for s in self._running if s.prefilled == 0)
        return room + promised <= self.ledger.limit("device") - self.ledger.current("device")

    def _start(self, seq: SequenceState) -> None:
        params = seq.params
        seq.scheduled_time = time.perf_counter()
        seq.sampler = Sampler(params)
        seq.output = RequestOutput(self.tokenizer, params, seq.max_new_tokens)
        if params.repetition_penalty != 1.0:
            seq.history = torch.tensor(seq.prompt_ids, dtype=torch.long)
        seq.cache = self.llm.new_cache(self.ledger)
        if not self.device_room_needed(len(seq.prompt_ids)):
            seq.cache.reserve(len(seq.prompt_ids) + seq.max_new_tokens)  # as the generator does
        # else (tiered under a device budget): no up-front reservation; the hot store grows page by
        # page, so running sequences share the device and spill their cold pages to the host
        self.observer.on_scheduled(seq)

    def _decode_step(self) -> int:
        """One batched forward of every decoding sequence; returns the batch size."""
        batch = [seq for seq in self._running if seq.pending is not None]
        if not batch:
            return 0
        self.decode_batch_sizes[len(batch)] += 1
        try:
            if len(batch) == 1:  # exactly the single-request generator's call
                cache = batch[0].cache
                ids = torch.tensor([[batch[0].pending]], dtype=torch.long, device=self.device)  # (1, 1)
                logits = self.decode_model(ids, cache, start_pos=cache.seq_length)  # (1, 1, vocab)
            else:
                caches = BatchedCaches([seq.cache for seq in batch])
                ids = torch.tensor([[seq.pending] for seq in batch], dtype=torch.long, device=self.device)  # (B, 1)
                logits = self.decode_model(ids, caches, start_pos=caches.start_positions())  # (B, 1, vocab)
            logits = logits.cpu()
        except Exception as exc:
            logger.exception("batched decode failed")
            for seq in batch:
                self._finish_error(seq, f"internal error during decode: {exc}")
            return len(batch)
        for row, seq in enumerate(batch):
            seq.pending = None
            self._sample(seq, logits[row, -1])
        return len(batch)

    def _prefill_step(self) -> int:
        """Prefill chunks of new sequences, up to ``prefill_chunk`` tokens; returns the tokens run."""
        budget = self.prefill_chunk
        used = 0
        for seq in [s for s in self._running if s.in_prefill]:
            start = seq.prefilled
            # the same chunk boundaries as Generator._prefill: multiples of prefill_chunk
            end = min(len(seq.prompt_ids), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if used and used + (end - start) > budget:
                break
            used += end - start
            try:
                ids = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long, device=self.device)  # (1, T)
                logits = self.model(ids, seq.cache, start_pos=seq.cache.seq_length).cpu()  # (1, 1, vocab)
            except Exception as exc:
                logger.exception("prefill failed")
                self._finish_error(seq, f"internal error during prefill: {exc}")
                continue
            seq.prefilled = end
            if end == len(seq.prompt_ids):
                if self.migration is not None:
                    self._migrate(seq)
                self.observer.on_prompt_done(seq)
                self._sample(seq, logits[0, -1])
            if used >= budget:
                break
        return used

    def _migrate(self, seq: SequenceState) -> None:
        """Move a prefilled sequence's KV to the host, where it decodes (``--decode-on host``)."""
        prefill_cache = seq.cache
        seq.cache = self.migration.migrate(prefill_cache, len(seq.prompt_ids) + seq.max_new_tokens)
        for direction, n in prefill_cache.bus_bytes.items():
            self._bus_done[direction] += n

    def _sample(self, seq: SequenceState, logits: torch.Tensor) -> None:
        """Pick the next token and apply the generator's stop rules in the generator's order."""
        params = seq.params
        token = seq.sampler(logits, seq.history if params.repetition_penalty != 1.0 else None)
        now = time.perf_counter()
        interval = None if seq.last_token_time is None else now - seq.last_token_time
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        piece = seq.output.push(token)
        self.observer.on_token(seq, interval)
        if piece:
            self._emit(seq, SeqEvent(seq.request_id, piece))
        if seq.output.finish_reason is not None:
            self._finish(seq, seq.output.finish_reason)
            return
        if params.repetition_penalty != 1.0:
            seq.history = torch.cat([seq.history, torch.tensor([token])])
        seq.pending = token

    def _finish(self, seq: SequenceState, reason: str) -> None:
        tail = seq.output.tail()
        seq.finish_reason = reason
        self._release(seq)  # the KV is free before the client hears the end
        self._emit(seq, SeqEvent(
            seq.request_id, tail, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.generated), token_ids=list(seq.generated), full_text=seq.output.text,
        ))
        self.observer.on_finished(seq)

    def _finish_error(self, seq: SequenceState, message: str) -> None:
        seq.finish_reason = "error"
        self._release(seq)
        self._emit(seq, SeqEvent(seq.request_id, error=message, prompt_tokens=len(seq.prompt_ids),
                                 completion_tokens=len(seq.generated)))
        self.observer.on_finished(seq)

    def _release(self, seq: SequenceState) -> None:
        """Free the sequence's KV and its reservation; take it out of the running set."""
        seq.finish_time = time.perf_counter()
        seq.pending = None
        cache, seq.cache = seq.cache, None
        if cache is not None:
            for direction, n in cache.bus_bytes.items():
                self._bus_done[direction] = self._bus_done.get(direction, 0) + n
            try:
                cache.reset()
            except Exception:
                logger.exception("could not free a KV cache")
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
                self._reserved -= seq.kv_bytes
            self._cond.notify()

    def _emit(self, seq: SequenceState, event: SeqEvent) -> None:
        try:
            seq.sink(event)
        except Exception:  # a consumer that is gone (closed event loop) must not stop the scheduler
            logger.debug("dropping an event of %s", seq.request_id, exc_info=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in waiting:
            seq.finish_reason = "error"
            self._emit(seq, SeqEvent(seq.request_id, error=message, prompt_tokens=len(seq.prompt_ids)))
            self.observer.on_finished(seq)
        for seq in list(self._running):
            self._finish_error(seq, message)
