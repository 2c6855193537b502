"""The request loop: continuous batching over one built runtime.

Every request, from ``LLM.generate`` as from the server, runs through :class:`Scheduler`.
``generate`` submits one sequence and steps until it finishes (nano-vllm's
``LLMEngine.generate``); the server starts the loop on its own thread. Each step:

1. applies aborts (a client that went away frees its KV now, not when it would have finished);
2. admits waiting requests, first come first served, while the running set has room
   (``max_batch``) and their KV fits (see :func:`~hybridllm.engine.admission.admission_decision`);
3. decodes one token for every running sequence: one batched forward per runner (the placed
   runner, and the host runner for sequences that moved to the host); the rows' own KV caches
   sit behind a :class:`~hybridllm.kvcache.batch.BatchedCaches`, their positions go to the
   runner as a (B,) ``start_pos``;
4. prefills new sequences in chunks of ``prefill_chunk`` prompt tokens, at most that many
   tokens per step while sequences decode, so a long prompt does not stall the running decodes
   (``IDLE_PREFILL_CHUNKS`` chunks' worth while none does). Chunk boundaries are
   multiples of ``prefill_chunk``, so a sequence's forwards do not depend on its neighbours; a
   step's chunks go in one forward where the runner takes several sequences' chunks at once,
   each computed as alone. The prefix cache is asked right before a sequence's first chunk
   (not at admission), so requests admitted together reuse what the first of them prefilled.

A request for ``n > 1`` sequences is admitted once (its KV reservation and batch slots count
n times) and prefilled once; when its prompt is done it forks into n sequences, each on its own
copy of the prompt's KV (:func:`~hybridllm.kvcache.copy.copy_cache`) with its own sampler, and
each samples its first token from the same prompt logits. Log-probabilities (``logprobs``,
``prompt_logprobs``) are computed only for requests that ask for them.

Per-sequence policies run after each of a sequence's forwards: phase migration when its prompt
is done (``--decode-on host``), and adaptive re-planning when a memory tier fills up
(``--kv-adaptive``: halve a tiered hot window, quantize cold pages, or move the sequence to the
host runner; a step that cannot fit at all is rolled back and re-run on the host).

A consumer that cannot keep up (a client that stops reading its stream) may :meth:`~Scheduler.pause`
its request: its sequences leave the batch (no forward, no batch slot) but keep their KV until
:meth:`~Scheduler.resume` (:mod:`hybridllm.engine.pausing`).

Finished sequences leave the running set at once and their KV is freed before their last
event is sent. Every sequence keeps its own KV cache (paged, in whatever tiers its strategy
uses); all of them count in one shared :class:`~hybridllm.kvcache.base.MemoryLedger`, so a
strategy that evicts on ledger pressure (``tiered``) moves cold pages of running requests to
the host instead of anything being preempted.

Results go to each request's ``sink`` callable, called on the loop's thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.adaptive import AdaptiveAction, AdaptivePolicy
from hybridllm.engine.admission import (
    AdmissionError,
    DeviceRoomError,
    QueueFullError,
    admission_decision,
    kv_bytes_needed,
)
from hybridllm.engine.logprobs import TokenLogprob, sequence_logprobs, token_logprob
from hybridllm.engine.metrics import HostPeakMemory
from hybridllm.engine.output import RequestOutput, check_prompt
from hybridllm.engine.pausing import PausedRequests
from hybridllm.engine.request_record import sequence_metrics
from hybridllm.engine.sampling import Sampler
from hybridllm.engine.sequence import SeqEvent, SequenceKV, SequenceState
from hybridllm.engine.structured import GrammarCompiler
from hybridllm.errors import ConfigError, HybridLLMError
from hybridllm.kvcache.base import TIERS, KVBudgetError, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.kvcache.copy import copy_cache
from hybridllm.kvcache.prefix_cache import PrefixCache
from hybridllm.kvcache.registry import admission_tiers, get_strategy, tiers_capacity
from hybridllm.timing import synchronize

logger = logging.getLogger(__name__)

__all__ = ["AdmissionError", "QueueFullError", "RequestLoopStopped", "Scheduler", "SchedulerObserver", "SeqEvent",
           "SequenceState"]

# Prompt tokens a step may prefill, in chunks, while no sequence is decoding: a burst of requests
# starts with its prompts prefilled in fewer, larger forwards (the chunks themselves stay
# ``prefill_chunk`` long, so no sequence's forwards change).
IDLE_PREFILL_CHUNKS = 4
# How long the loop thread sleeps after a step that could run nothing (every running request
# paused, the queue's head waiting for their KV) unless something wakes it first.
IDLE_RECHECK_S = 0.05


class RequestLoopStopped(HybridLLMError):
    """The request loop stopped (the server is shutting down) before the request finished."""


class SchedulerObserver:
    """Hooks the scheduler calls on its loop thread (the server's metrics implement them)."""

    def on_scheduled(self, seq: SequenceState) -> None:
        """The sequence left the queue and got its KV cache."""

    def on_prompt_done(self, seq: SequenceState) -> None:
        """The whole prompt is in the cache."""

    def on_token(self, seq: SequenceState, interval_s: float | None) -> None:
        """A token was sampled; ``interval_s`` since the previous one (None for the first)."""

    def on_adaptive_action(self, seq: SequenceState, action: AdaptiveAction) -> None:
        """The adaptive policy re-planned the sequence (``action``: its line, and ``action.kind``)."""

    def on_finished(self, seq: SequenceState) -> None:
        """The sequence left (``seq.finish_reason``: stop, length, abort or error); its KV is freed."""

    def on_step(self, decode_rows: int, prefill_tokens: int) -> None:
        """A scheduler step ran: ``decode_rows`` sequences decoded, plus prefill tokens."""


class Scheduler:
    """The request loop of one built runtime.

    Args:
        runtime: the built model (:class:`~hybridllm.runtime.runtime.Runtime`); its engine's
            ``prefill_chunk`` sets the chunk size and the prefill token budget of a step.
        max_batch: most sequences running at once (prefilling or decoding).
        max_queue: most requests waiting; more are refused with :class:`QueueFullError`.
        host_budget: bytes of host RAM the KV may use (None: unbounded).
        observer: metrics hooks.
        prefix_cache: KV pages reused across requests (None: every prompt is prefilled whole).
    """

    def __init__(
        self,
        runtime: Any,
        max_batch: int = 16,
        max_queue: int = 256,
        host_budget: int | None = None,
        observer: SchedulerObserver | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.device = runtime.engine_config.torch_device
        self.context_length = runtime.context_length
        self.vocab_size = runtime.config.vocab_size
        self.prefill_chunk = runtime.engine_config.prefill_chunk
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.observer = observer or SchedulerObserver()
        kv_config = runtime.kv_config
        self.ledger: MemoryLedger = runtime.kv_ledger(host_budget)
        self.kv_strategy = kv_config.kv_cache
        spec = runtime.kv_spec()
        self.page_size = kv_config.kv_page_size
        self.token_bytes = int(spec.token_bytes() * spec.n_layers)  # K+V of one token, all layers
        self.adaptive = AdaptivePolicy(runtime.migration) if kv_config.kv_adaptive else None
        budgets = {tier: self.ledger.budget(tier) for tier in TIERS}
        self.capacity = tiers_capacity(self.kv_tiers, budgets)
        self.host_memory = HostPeakMemory()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.prefix_cache = prefix_cache
        self._cond = threading.Condition()
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._running: list[SequenceState] = []
        self._abort_ids: set[str] = set()
        self._paused = PausedRequests()  # requests whose consumer is not keeping up
        self._reserved = 0  # KV bytes promised to running sequences
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._bus_done = {"h2d": 0, "d2h": 0}  # bus bytes of caches already freed
        self._hop_bytes = 0  # hidden-state bytes moved by every forward so far
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
        """Queue a request. Raises ContextOverflowError (bad prompt), GrammarError (a structured
        output that does not compile), AdmissionError (can never fit) or QueueFullError;
        otherwise ``sink`` gets its events from the loop's thread."""
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt)
        self.check_params(params)
        max_new = min(params.max_tokens, self.context_length - len(prompt))
        need = params.n * kv_bytes_needed(len(prompt) + max_new, self.token_bytes, self.page_size)
        if admission_decision(need, 0, self.capacity) == "reject":
            copies = f" x {params.n} sequences" if params.n > 1 else ""
            raise AdmissionError(
                f"the request needs {need} bytes of KV cache ({len(prompt)} prompt + {max_new} new tokens{copies}) "
                f"but the {self.kv_strategy} KV cache may use at most {self.capacity} bytes; "
                f"shorten the prompt or lower max_tokens"
            )
        room = self.device_room_needed(len(prompt))
        limit = self.ledger.limit("device")
        if room and room > limit and self.adaptive is None:
            raise DeviceRoomError(
                f"the {self.kv_strategy} KV cache must keep the first prefill chunk on the device ({room} bytes), "
                f"more than its device budget allows ({limit} bytes); raise --vram-budget or lower --prefill-chunk"
            )
        seq = SequenceState(request_id, prompt, params, max_new, need, sink)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
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
        start of the next step."""
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

    def pause(self, request_id: str) -> None:
        """Take a running request out of the batch from the next step on: its sequences run no
        forward and leave their batch slots to others, but keep their KV until :meth:`resume`
        (or :meth:`abort`). For a consumer that cannot take more events (a client that stopped
        reading); safe from any thread, including from within a sink."""
        with self._cond:
            self._paused.pause(request_id)

    def resume(self, request_id: str) -> None:
        """Let a paused request rejoin the batch (as soon as it has room for it)."""
        with self._cond:
            self._paused.resume(request_id)
            self._cond.notify()

    def device_room_needed(self, prompt_len: int) -> int:
        """Free device KV bytes a new sequence needs before its first prefill chunk can run.

        Only for strategies that spill to the host under a bounded device budget (``tiered``,
        declared by :attr:`~hybridllm.kvcache.strategy.KVStrategy.spills_to_host`):
        a cache evicts its own cold pages, never another sequence's, so the tokens that must stay
        hot while they are added (sinks, the first chunk, a partial page) have to fit in what the
        running sequences leave free. 0 when no such limit applies.
        """
        if not get_strategy(self.kv_strategy).spills_to_host or self.ledger.limit("device") is None:
            return 0
        tokens = self.runtime.kv_config.kv_sink_tokens + min(prompt_len, self.prefill_chunk) + self.page_size
        return kv_bytes_needed(tokens, self.token_bytes, self.page_size)

    def check_prompt(self, prompt: list[int]) -> None:
        """The prompt rules: non-empty, shorter than the context, ids in the vocabulary."""
        check_prompt(prompt, self.context_length, self.vocab_size, self.runtime.context_description)

    def check_params(self, params: SamplingParams) -> None:
        """What sampling parameters must fit in this loop: ``logit_bias`` ids in the vocabulary,
        ``n`` sequences in one batch."""
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ConfigError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if params.n > self.max_batch:
            raise ConfigError(f"n={params.n} sequences do not fit in a batch of at most {self.max_batch}; "
                              f"lower n or raise --max-batch")

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
        self._stopping = False

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        """Sequences in the batch (prefilling or decoding; paused ones not counted)."""
        running = list(self._running)
        return len(running) - self._paused.count(running)

    @property
    def num_paused(self) -> int:
        """Sequences paused by their consumer (their KV kept)."""
        return self._paused.count(list(self._running))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def kv_tiers(self) -> tuple[str, ...]:
        """The memory tiers admission counts a request's KV in: both when the adaptive policy may
        move it to the host, else those of the KV strategy."""
        return TIERS if self.adaptive is not None else admission_tiers(self.kv_strategy)

    def kv_layout(self) -> list[SequenceKV]:
        """Where each running sequence's KV is now (read-only, from any thread; it may be a step old)."""
        return [SequenceKV.of(seq.request_id, seq.index, seq.cache) for seq in list(self._running)
                if seq.cache is not None]

    def token_raw_bytes(self, token_id: int) -> bytes:
        """A token id's exact bytes (also when it holds part of a UTF-8 character)."""
        return self.grammars.ll_tokenizer().decode_bytes([token_id])

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics: requests, KV bytes/pages/budgets per tier, bus bytes."""
        running = list(self._running)
        bus = dict(self._bus_done)
        for seq in running:
            for cache in seq.caches:
                for direction, n in cache.bus_bytes.items():
                    bus[direction] = bus.get(direction, 0) + n
        bus["hidden_states"] = self._hop_bytes
        page_bytes = self.page_size * self.token_bytes
        kv_bytes = {tier: self.ledger.current(tier) for tier in TIERS}
        paused = self._paused.count(running)
        return {
            "running": len(running) - paused,
            "paused": paused,
            "waiting": len(self._waiting),
            "kv_bytes": kv_bytes,
            "kv_budget_bytes": {tier: self.ledger.budget(tier) for tier in TIERS},
            "kv_pages": {tier: -(-n // page_bytes) for tier, n in kv_bytes.items()},
            "kv_reserved_bytes": self._reserved,
            "kv_capacity_bytes": self.capacity,
            "bus_bytes": bus,
            "prefix_cache": None if self.prefix_cache is None else {
                "queries": self.prefix_cache.stats.queries, "hits": self.prefix_cache.stats.hits,
                "bytes": self.prefix_cache.bytes_per_tier()},
        }

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running or self._abort_ids):
                    self._cond.wait()
                if self._stopping:
                    return
            steps = self.steps
            try:
                self.step()
            except Exception as exc:  # never let the loop die: fail what was running, keep serving
                for seq in list(self._running):
                    self._fail(seq, exc, "the request loop's step failed")
            if self.steps == steps:  # nothing could run (only paused requests): wait for a change
                with self._cond:
                    if not (self._stopping or self._abort_ids or self._paused.has_resumes):
                        self._cond.wait(IDLE_RECHECK_S)

    def has_work(self) -> bool:
        """Whether anything is queued, running or waiting to be aborted."""
        return bool(self._waiting or self._running or self._abort_ids)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Run steps on the calling thread until nothing is queued or running (tests, tools; a
        paused request counts as running: resume or abort it first)."""
        if self.is_running:
            raise RuntimeError("the loop thread is running; do not step from another thread")
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def step(self) -> None:
        """One iteration: aborts, resumes, admission, one batched decode per runner, chunked prefill."""
        self._apply_aborts()
        with self._cond:
            self._paused.settle(self._running, self.max_batch)
        self._admit()
        if not self._batch():
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

    def _batch(self) -> list[SequenceState]:
        """The running sequences that are not paused."""
        with self._cond:
            return self._paused.in_batch(self._running)

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or len(self._batch()) + self._waiting[0].params.n > self.max_batch:
                    return
                seq = self._waiting[0]
                if admission_decision(seq.kv_bytes, self._reserved, self.capacity) != "admit":
                    return  # first come first served: the head waits for room, nobody overtakes it
                if self._running and not self._device_room_free(seq):
                    return  # wait until running sequences leave device room for its first chunk
                self._waiting.popleft()
                self._reserved += seq.kv_bytes
                alone = not self._running
                self._running.append(seq)
            try:
                self._start(seq, alone)
            except Exception as exc:
                self._fail(seq, exc, "could not start the request")

    def _device_room_free(self, seq: SequenceState) -> bool:
        room = self.device_room_needed(len(seq.prompt_ids))
        if not room:
            return True
        # sequences admitted but not prefilled yet have not allocated their first chunk
        promised = sum(self.device_room_needed(len(s.prompt_ids)) for s in self._running if s.prefilled == 0)
        return room + promised <= self.ledger.limit("device") - self.ledger.current("device")

    def _start(self, seq: SequenceState, alone: bool) -> None:
        """Give an admitted sequence its sampler, stop rules and KV cache on the placed runner.

        ``alone``: nothing else runs, so the peak-memory figures restart with this sequence
        (they are process- and ledger-wide).
        """
        params = seq.params
        seq.scheduled_time = time.perf_counter()
        seq.sampler = Sampler(params)
        seq.output = RequestOutput(self.tokenizer, params, seq.max_new_tokens)
        if params.repetition_penalty != 1.0:
            seq.history = torch.tensor(seq.prompt_ids, dtype=torch.long)
        seq.adopt(self._new_cache(seq, on_host=False), self.runtime.runner)
        if alone:
            self._reset_peaks()
        self.observer.on_scheduled(seq)
        seq.start_time = time.perf_counter()
        self._relieve(seq)

    def _new_cache(self, seq: SequenceState, on_host: bool) -> Any:
        """An empty cache for ``seq`` in the shared ledger (the KV policy's, or a host cache),
        allocated up front for its prompt and budget, except a tiered cache under a device budget:
        its hot store grows page by page, so running sequences share the device and spill their
        cold pages to the host."""
        if on_host:
            cache = self.runtime.new_host_cache(self.ledger)
        else:
            cache = self.runtime.new_cache(self.ledger)
        if on_host or not self.device_room_needed(len(seq.prompt_ids)):
            cache.reserve(seq.reserve_tokens)
        return cache

    def _reset_peaks(self) -> None:
        self.host_memory.reset()
        self.ledger.reset_peaks()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # ---- forwards ----------------------------------------------------------------------------
    def _decode_step(self) -> int:
        """One batched forward per runner of every decoding sequence; returns the rows decoded."""
        ready = [seq for seq in self._batch() if seq.pending is not None]
        groups: dict[int, list[SequenceState]] = {}
        for seq in ready:
            groups.setdefault(id(seq.runner), []).append(seq)
        for batch in groups.values():
            self.decode_batch_sizes[len(batch)] += 1
            try:
                rows = self._decode_batch(batch)
            except Exception as exc:
                for seq in batch:
                    self._fail(seq, exc, "decode failed")
                continue
            for seq, logits in zip(batch, rows):
                seq.pending = None
                self._sample(seq, logits)
        return len(ready)

    def _decode_batch(self, batch: list[SequenceState]) -> list[torch.Tensor]:
        """The next-token logits (vocab,) of each row of one runner's decode batch."""
        if len(batch) == 1 or any(self._crosses_rope_switch(seq, 1) for seq in batch):
            # a lone sequence: exactly the forward of a prefill chunk of one token (and a longrope
            # batch in which a row re-encodes its cache: each row alone, this once)
            return [self._forward(seq, [seq.pending])[0, -1] for seq in batch]
        runner = batch[0].runner
        starts = [seq.cache.seq_length for seq in batch]
        caches = BatchedCaches([seq.cache for seq in batch])
        ids = torch.tensor([[seq.pending] for seq in batch], dtype=torch.long)  # (B, 1)
        try:
            logits = self._run_runner(runner, ids, caches, caches.start_positions(), batch).cpu()  # (B, 1, vocab)
        except KVBudgetError:
            if self.adaptive is None:
                raise
            # undo whatever rows appended, then step each row alone (where a row can move to the host)
            for seq, start in zip(batch, starts):
                seq.cache.truncate(start)
            return [self._forward(seq, [seq.pending])[0, -1] for seq in batch]
        for seq in batch:
            self._relieve(seq)
        return [logits[row, -1] for row in range(len(batch))]

    def _prefill_step(self) -> int:
        """Prefill chunks of new sequences, up to ``prefill_chunk`` tokens, in one forward where
        the runner takes several sequences' chunks at once (else one per sequence); returns the
        tokens run. While no sequence is decoding (nothing waits on the step) the step may take
        ``IDLE_PREFILL_CHUNKS`` chunks' worth of prompts. A sequence whose prompt starts with the
        page another one is prefilling in this step waits for the next step, and reuses that page then."""
        decoding = any(seq.pending is not None for seq in self._batch())
        budget = self.prefill_chunk * (1 if decoding else IDLE_PREFILL_CHUNKS)
        used = 0
        planned: list[tuple[SequenceState, int, int]] = []
        in_flight: set[bytes] = set()  # first pages being prefilled (not cached yet) in this step
        for seq in [s for s in self._batch() if s.in_prefill]:
            first_page = self._first_page(seq)
            if first_page in in_flight:
                continue
            self._reuse_prefix(seq)
            start = seq.prefilled
            end = min(len(seq.prompt_ids), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if used and used + (end - start) > budget:
                break
            used += end - start
            planned.append((seq, start, end))
            if first_page is not None and start == 0:
                in_flight.add(first_page)
            if used >= budget:
                break
        for (seq, start, end), logits in zip(planned, self._prefill_forwards(planned)):
            if logits is None:  # failed (the sequence has ended with its error)
                continue
            seq.prefilled = end
            if seq.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, start, end, logits[0])
            if end == len(seq.prompt_ids):
                if self.runtime.placement.decode_on == "host":
                    self._migrate(seq)
                self.observer.on_prompt_done(seq)
                for sibling in [seq, *self._fork(seq)]:
                    self._sample(sibling, logits[0, -1])
                self._keep_pages(seq, seq.prompt_ids)  # after the first token: not in its TTFT
        return used

    def _first_page(self, seq: SequenceState) -> bytes | None:
        """The prefix cache's address of a prompt's first page, when the prompt could reuse it
        (a prefix cache, not looked up yet, a whole page before its last token)."""
        cache = self.prefix_cache
        if cache is None or seq.prefix_looked_up or len(seq.prompt_ids) <= cache.page_tokens:
            return None
        return cache.addresses(seq.prompt_ids[:cache.page_tokens])[0]

    def _prefill_forwards(self, planned: list[tuple[SequenceState, int, int]]) -> list[torch.Tensor | None]:
        """The logits of each planned chunk (``prompt_ids[start:end]`` of its sequence): (1, T,
        vocab) when its prompt's log-probabilities are asked, else (1, 1, vocab); None where the
        forward failed (the sequence then ended with the error). Chunks of two or more tokens of
        sequences on the placed runner that want only their last logits go in one forward when the
        runner can take them (each chunk's results are bitwise its forward's alone)."""
        together = [i for i, (seq, start, end) in enumerate(planned)
                    if seq.runner is self.runtime.runner and seq.params.prompt_logprobs is None
                    and end - start > 1 and not self._crosses_rope_switch(seq, end - start)]
        results: list[torch.Tensor | None] = [None] * len(planned)
        if len(together) > 1:
            chunks = [(planned[i][0].prompt_ids[planned[i][1]:planned[i][2]], planned[i][0].cache) for i in together]
            try:
                runner = self.runtime.runner
                logits = self._sharing_hops(runner, [planned[i][0] for i in together],
                                            lambda: runner.prefill_chunks(chunks))
            except Exception:  # a budget or any other error: undo what it appended, run each chunk alone
                logger.debug("prefill of %d chunks together failed; running them one by one", len(chunks), exc_info=True)
                logits = None
                for i in together:
                    planned[i][0].cache.truncate(planned[i][1])
            if logits is not None:
                for i, row in zip(together, logits):
                    results[i] = row.cpu()
                    self._relieve(planned[i][0])
        for i, (seq, start, end) in enumerate(planned):
            if results[i] is not None:
                continue
            try:
                results[i] = self._forward(seq, seq.prompt_ids[start:end],
                                           all_logits=seq.params.prompt_logprobs is not None)
            except Exception as exc:
                self._fail(seq, exc, "prefill failed")
        return results

    def _reuse_prefix(self, seq: SequenceState) -> None:
        """Before a sequence's first prefill chunk, copy the cached pages of its prompt's prefix
        into its cache. Asked then rather than at admission, so that requests admitted together
        reuse the pages of those among them whose prompts were prefilled first (a burst of
        requests sharing a system prompt prefills it once)."""
        if seq.prefix_looked_up:
            return
        seq.prefix_looked_up = True
        if (self.prefix_cache is None or seq.prefilled or seq.params.prompt_logprobs is not None  # every row's logits
                or self._rotates_long(len(seq.prompt_ids))):  # stored pages rotate with the short set
            return
        # at least the last prompt token is prefilled: its logits choose the first token
        seq.cached_tokens = self.prefix_cache.restore(seq.prompt_ids, seq.cache, len(seq.prompt_ids) - 1,
                                                      self.prefill_chunk)
        seq.prefilled = seq.cached_tokens

    def _forward(self, seq: SequenceState, tokens: list[int], all_logits: bool = False) -> torch.Tensor:
        """One forward of ``tokens`` on the sequence's runner and cache, then its policies.

        A step that overflows the device budget mid-way (``KVBudgetError``) is rolled back to
        its start and re-run on the host when the adaptive policy is on. Returns (1, 1, vocab)
        logits on the CPU, (1, T, vocab) with ``all_logits``.
        """
        n_new = len(tokens)
        tokens = self._reencode_across_rope_switch(seq, tokens)
        ids = torch.tensor([tokens], dtype=torch.long)  # (1, T); the runner moves it to the embedding
        start = seq.cache.seq_length
        try:
            logits = self._run_runner(seq.runner, ids, seq.cache, start, [seq], all_logits)
        except KVBudgetError:
            if self.adaptive is None:
                raise
            seq.cache.truncate(start)  # undo the layers that appended before the budget ran out
            self._adopt(seq, self.adaptive.move_to_host(seq.cache, seq.reserve_tokens, seq.actions,
                                                        "device KV budget exhausted mid-step"))
            logits = self._run_runner(seq.runner, ids, seq.cache, start, [seq], all_logits)
        self._relieve(seq)
        return logits[:, -n_new:].cpu() if all_logits else logits.cpu()

    # ---- longrope (Phi-3 128K) ------------------------------------------------------------------
    def _rotates_long(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens rotates with longrope's long factors."""
        switch = self.runtime.runner.model.rope_switch_length
        return switch is not None and length > switch

    def _crosses_rope_switch(self, seq: SequenceState, n_new: int) -> bool:
        """Whether ``n_new`` more tokens take a sequence whose cached keys rotate with longrope's
        short factors past the switch."""
        start = seq.cache.seq_length
        return 0 < start and not self._rotates_long(start) and self._rotates_long(start + n_new)

    def _reencode_across_rope_switch(self, seq: SequenceState, tokens: list[int]) -> list[int]:
        """The tokens a forward must run: ``tokens``, or, on the forward that takes a longrope
        sequence past the switch, every cached token before them (the cache emptied), so that all
        of its keys rotate with the long factors, as transformers' generate recomputes its cache."""
        if not self._crosses_rope_switch(seq, len(tokens)):
            return tokens
        cached = (seq.prompt_ids + seq.generated)[:seq.cache.seq_length]  # what the cache holds
        seq.cache.truncate(0)
        return cached + tokens

    def _run_runner(self, runner: Any, ids: torch.Tensor, cache: Any, start_pos: int | torch.Tensor,
                    rows: list[SequenceState], all_logits: bool = False) -> torch.Tensor:
        """``runner(ids, cache, start_pos)``; its hidden-state hops are shared by the rows."""
        return self._sharing_hops(runner, rows, lambda: runner(ids, cache, start_pos=start_pos, all_logits=all_logits))

    def _sharing_hops(self, runner: Any, rows: list[SequenceState], forward: Callable[[], Any]) -> Any:
        """``forward()`` on ``runner``; the hidden-state bytes it moved count for the loop and,
        shared evenly, for each of ``rows``."""
        hops_before = runner.hop_bytes
        result = forward()
        moved = runner.hop_bytes - hops_before
        self._hop_bytes += moved
        for seq in rows:
            seq.hop_bytes += moved // len(rows)
        return result

    # ---- per-sequence policies ---------------------------------------------------------------
    def _relieve(self, seq: SequenceState) -> None:
        """Adaptive re-planning after a forward: when a tier is over its threshold."""
        if self.adaptive is None:
            return
        self._adopt(seq, self.adaptive.relieve(seq.cache, seq.runner, seq.reserve_tokens, seq.actions))

    def _adopt(self, seq: SequenceState, placed: tuple[Any, Any]) -> None:
        """Continue ``seq`` on a (cache, runner) a policy chose; report new adaptive actions."""
        cache, runner = placed
        seq.adopt(cache, runner)
        for action in seq.actions[seq.reported_actions:]:
            self.observer.on_adaptive_action(seq, action)
        seq.reported_actions = len(seq.actions)

    def _migrate(self, seq: SequenceState) -> None:
        """Move a prefilled sequence's KV to the host, where it decodes (``--decode-on host``)."""
        migration = self.runtime.migration()
        seq.adopt(migration.migrate(seq.cache, seq.reserve_tokens), migration.runner)

    def _fork(self, seq: SequenceState) -> list[SequenceState]:
        """The other ``n - 1`` sequences of a prefilled request, each on its own copy of the
        prompt's KV and runner, with its own sampler (seed + index when a seed is given).

        The request's reservation (n sequences' worth) is split evenly among them.
        """
        n = seq.params.n
        if n == 1:
            return []
        seq.kv_bytes //= n
        forks = []
        for index in range(1, n):
            params = seq.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + index)
            fork = SequenceState(seq.request_id, seq.prompt_ids, params, seq.max_new_tokens, seq.kv_bytes, seq.sink,
                                 index=index, arrival_time=seq.arrival_time)
            fork.sampler = Sampler(params)
            fork.output = RequestOutput(self.tokenizer, params, fork.max_new_tokens)
            fork.history = None if seq.history is None else seq.history.clone()
            fork.prompt_logprobs = seq.prompt_logprobs
            fork.prefilled = seq.prefilled
            fork.scheduled_time, fork.start_time = seq.scheduled_time, seq.start_time
            cache = self._new_cache(fork, on_host=seq.runner is not self.runtime.runner)
            fork.adopt(copy_cache(seq.cache, cache), seq.runner)
            with self._cond:
                self._running.append(fork)
            forks.append(fork)
        return forks

    # ---- tokens and endings ------------------------------------------------------------------
    def _record_prompt_logprobs(self, seq: SequenceState, start: int, end: int, logits: torch.Tensor) -> None:
        """Log-probabilities of prompt tokens ``start + 1 .. end`` (the first has none) from a
        chunk's logits (T, vocab): row i predicts the token after position ``start + i``."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        targets = seq.prompt_ids[start + 1:end + 1]  # the last chunk's last row predicts a generated token
        seq.prompt_logprobs.extend(sequence_logprobs(logits[:len(targets)], targets, seq.params.prompt_logprobs))

    def _sample(self, seq: SequenceState, logits: torch.Tensor) -> None:
        """Pick the next token, then apply the stop rules."""
        params = seq.params
        raw_logits = logits  # log-probabilities are the model's own, before the grammar's mask
        if seq.grammar is not None:
            try:
                logits = seq.grammar.mask(logits)
            except HybridLLMError as exc:
                self._fail(seq, exc, "structured output")
                return
        generated = torch.tensor(seq.generated, dtype=torch.long) if params.penalizes_generated else None
        token = seq.sampler(logits, seq.history if params.repetition_penalty != 1.0 else None, generated)
        if params.logprobs is not None:
            entry = token_logprob(raw_logits, token, params.logprobs)
            seq.logprobs.append(entry)
            seq.unsent_logprobs.append(entry)
        now = time.perf_counter()
        interval = None if seq.last_token_time is None else now - seq.last_token_time
        if interval is not None:
            seq.token_intervals.append(interval)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self.host_memory.sample()
        piece = seq.output.push(token)
        self.observer.on_token(seq, interval)
        reason = seq.output.finish_reason
        if seq.grammar is not None:
            try:
                if seq.grammar.advance(token):
                    reason = "stop"  # the grammar is complete: nothing but the end of the sequence may follow
            except HybridLLMError as exc:
                self._fail(seq, exc, "structured output")
                return
        finishing = reason is not None
        # with logprobs every token gets its event (the last one rides on the finishing event)
        if piece or (seq.unsent_logprobs and not finishing):
            first = len(seq.generated) == 1
            self._emit(seq, SeqEvent(seq.request_id, piece, token_id=token, index=seq.index,
                                     logprobs=self._take_unsent_logprobs(seq),
                                     prompt_logprobs=seq.prompt_logprobs if first else None))
        if finishing:
            self._finish(seq, reason)
            return
        if params.repetition_penalty != 1.0:
            seq.history = torch.cat([seq.history, torch.tensor([token])])
        seq.pending = token

    def _finish(self, seq: SequenceState, reason: str) -> None:
        tail = seq.output.tail()
        seq.finish_reason = reason
        metrics = self._metrics(seq)
        self._keep_pages(seq, seq.prompt_ids + seq.generated)  # a next turn resends these tokens
        self._release(seq)  # the KV is free before the client hears the end
        self._emit(seq, SeqEvent(
            seq.request_id, tail, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.generated), token_ids=list(seq.generated), full_text=seq.output.text,
            metrics=metrics, index=seq.index, logprobs=self._take_unsent_logprobs(seq),
            prompt_logprobs=seq.prompt_logprobs,
            all_logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        ))
        self.observer.on_finished(seq)

    def _keep_pages(self, seq: SequenceState, token_ids: list[int]) -> None:
        """Offer the whole pages of ``token_ids`` held in the sequence's cache to the prefix cache."""
        if self.prefix_cache is None or seq.cache is None or seq.index:  # forks repeat their parent's prompt
            return
        if self._rotates_long(seq.cache.seq_length):  # longrope keys past the switch: not for shorter prompts
            return
        try:
            self.prefix_cache.store(token_ids, seq.cache)
        except Exception:  # reuse is an optimisation: the request itself must not fail for it
            logger.exception("%s: could not keep KV pages in the prefix cache", seq.request_id)

    @staticmethod
    def _take_unsent_logprobs(seq: SequenceState) -> list[TokenLogprob]:
        taken, seq.unsent_logprobs = seq.unsent_logprobs, []
        return taken

    def _fail(self, seq: SequenceState, exc: Exception, context: str) -> None:
        """End ``seq`` with an error: the user's (a budget, the prompt) in one line, anything else
        logged with its traceback as an internal error."""
        if isinstance(exc, HybridLLMError):
            logger.info("%s: %s: %s", seq.request_id, context, exc)
            self._finish_error(seq, exc, str(exc))
        else:
            logger.exception("%s: %s", seq.request_id, context)
            self._finish_error(seq, exc, f"internal error: {context}: {exc}")

    def _finish_error(self, seq: SequenceState, exc: BaseException | None, message: str) -> None:
        seq.finish_reason = "error"
        self._release(seq)
        self._emit(seq, SeqEvent(seq.request_id, error=message, exception=exc, prompt_tokens=len(seq.prompt_ids),
                                 completion_tokens=len(seq.generated), index=seq.index))
        self.observer.on_finished(seq)

    def _release(self, seq: SequenceState) -> None:
        """Free the sequence's KV and its reservation; take it out of the running set."""
        seq.finish_time = time.perf_counter()
        seq.pending = None
        caches, seq.cache = seq.caches, None
        for cache in caches:
            for direction, n in cache.bus_bytes.items():
                self._bus_done[direction] = self._bus_done.get(direction, 0) + n
            try:
                cache.reset()
            except Exception:
                logger.exception("could not free a KV cache")
        seq.caches = []
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
                self._reserved -= seq.kv_bytes
            self._cond.notify()

    def _metrics(self, seq: SequenceState) -> dict[str, Any]:
        """The request's figures (the keys ``generate --json`` and the bench promise)."""
        synchronize(self.device)
        if self.device.type == "cuda":
            peak_device = torch.cuda.max_memory_allocated(self.device)
        else:  # the CPU stands in for the device: report what the engine placed on the device tier
            peak_device = self.runtime.weight_bytes["device"] + self.ledger.peak("device")
        return sequence_metrics(seq, self.runtime, self.host_memory.peak(), peak_device)

    def _emit(self, seq: SequenceState, event: SeqEvent) -> None:
        try:
            seq.sink(event)
        except Exception:  # a consumer that is gone (closed event loop) must not stop the scheduler
            logger.debug("dropping an event of %s", seq.request_id, exc_info=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        stopped = RequestLoopStopped(message)
        for seq in waiting:
            seq.finish_reason = "error"
            self._emit(seq, SeqEvent(seq.request_id, error=message, exception=stopped,
                                     prompt_tokens=len(seq.prompt_ids)))
            self.observer.on_finished(seq)
        for seq in list(self._running):
            self._finish_error(seq, stopped, message)
