"""The request loop's scheduler: queues, admission, aborts, budgets, and the plan of every step.

Every request, from ``LLM.generate`` as from the server, runs through :class:`Scheduler`
(``generate`` submits one sequence and steps until it ends, as nano-vllm's ``LLMEngine.generate``;
the server runs the loop on its own thread). A step is plan -> execute -> process:

1. plan (here, plain bookkeeping): apply aborts (their KV is freed now); admit waiting requests
   first come first served while ``max_batch`` and the KV budget allow; then a
   :class:`~hybridllm.engine.step_plan.StepPlan`: every decoding sequence's pending token (and
   proposal), then prefill chunks (:mod:`hybridllm.engine.prefill_chunks`);
2. execute (:mod:`hybridllm.engine.executor`): one forward per runner, each row as alone;
3. process (:mod:`hybridllm.engine.output_processor`): tokens, stop rules, events, metrics.

A consumer that cannot keep up (a client that stops reading its stream) may :meth:`~Scheduler.pause`
its request: its sequences leave the batch (no row in a plan, no batch slot) but keep their KV
until :meth:`~Scheduler.resume` (:mod:`hybridllm.engine.pausing`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridllm.config import SamplingParams
from hybridllm.engine.adaptive import AdaptivePolicy
from hybridllm.engine.admission import (AdmissionError, KVBudget, QueueFullError, admission_decision,
                                        check_sampling_params, kv_bytes_needed)
from hybridllm.engine.executor import Executor
from hybridllm.engine.loop_thread import LoopThread
from hybridllm.engine.observer import SchedulerObserver
from hybridllm.engine.output import check_prompt
from hybridllm.engine.output_processor import OutputProcessor
from hybridllm.engine.pausing import PausedRequests
from hybridllm.engine.policies import LoopPolicies
from hybridllm.engine.prefill_chunks import IDLE_PREFILL_CHUNKS, add_prefill_chunks
from hybridllm.engine.sequence import SeqEvent, SequenceKV, SequenceState
from hybridllm.engine.speculator import Speculator
from hybridllm.engine.step_plan import ScheduledRow, StepPlan
from hybridllm.engine.structured import GrammarCompiler
from hybridllm.errors import ConfigError, HybridLLMError
from hybridllm.kvcache.base import TIERS, MemoryLedger
from hybridllm.kvcache.prefix_cache import PrefixCache

__all__ = ["IDLE_PREFILL_CHUNKS", "AdmissionError", "QueueFullError", "RequestLoopStopped", "Scheduler",
           "SchedulerObserver", "SeqEvent", "SequenceState", "admission_decision", "kv_bytes_needed"]


class RequestLoopStopped(HybridLLMError):
    """The request loop stopped (the server is shutting down) before the request finished."""


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

    def __init__(self, runtime: Any, max_batch: int = 16, max_queue: int = 256, host_budget: int | None = None,
                 observer: SchedulerObserver | None = None, prefix_cache: PrefixCache | None = None) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.runtime, self.tokenizer, self.device = runtime, runtime.tokenizer, runtime.engine_config.torch_device
        self.context_length, self.vocab_size = runtime.context_length, runtime.config.vocab_size
        self.prefill_chunk, self.max_batch, self.max_queue = runtime.engine_config.prefill_chunk, max_batch, max_queue
        self.ledger: MemoryLedger = runtime.kv_ledger(host_budget)
        self.kv_strategy = runtime.kv_config.kv_cache
        self.adaptive = AdaptivePolicy(runtime.migration) if runtime.kv_config.kv_adaptive else None
        self.budget = KVBudget.of(runtime, self.ledger, self.adaptive is not None)
        self.token_bytes, self.page_size = self.budget.token_bytes, self.budget.page_size  # K+V of a token; a page
        self.kv_tiers = self.budget.tiers  # the memory tiers admission counts a request's KV in
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.prefix_cache = prefix_cache
        self._cond = threading.Condition()
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._running: list[SequenceState] = []
        self._abort_ids: set[str] = set()
        self._paused = PausedRequests()  # requests whose consumer is not keeping up
        self._reserved = 0  # KV bytes promised to running sequences
        self._loop = LoopThread(self._cond, self.has_work, self.step,  # a failed step fails what was running
                                lambda exc: self.processor.fail_all(list(self._running), exc, "the step failed"))
        self.policies = LoopPolicies(runtime, self.ledger, self.adaptive, prefix_cache)
        self.executor = Executor(self.policies)
        self.decode_batch_sizes = self.executor.decode_batch_sizes  # forwards per number of decode rows
        self.speculator = Speculator.of(runtime)  # proposals for decode rows (--spec; none without)
        self.processor = OutputProcessor(runtime, self.ledger, self.policies, self._release, self._add_running,
                                         observer or SchedulerObserver(), self.speculator)

    @property
    def observer(self) -> SchedulerObserver:
        """The metrics hooks (the server sets its own after building the loop)."""
        return self.processor.observer

    @observer.setter
    def observer(self, observer: SchedulerObserver) -> None:
        self.processor.observer = observer

    @property
    def capacity(self) -> int | None:
        """KV bytes the running sequences may reserve (None: unbounded)."""
        return self.budget.capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        self.budget.capacity = value

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[SeqEvent], None]) -> SequenceState:
        """Queue a request. Raises ContextOverflowError (bad prompt), GrammarError (a structured
        output that does not compile), AdmissionError (can never fit) or QueueFullError;
        otherwise ``sink`` gets its events from the loop's thread."""
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt)
        check_sampling_params(params, self.vocab_size, self.max_batch)
        max_new = min(params.max_tokens, self.context_length - len(prompt))
        need = self.budget.check(len(prompt), max_new, params.n)
        grammar = None if params.structured is None else self.grammars.matcher(params.structured)
        seq = SequenceState(request_id, prompt, params, max_new, need, sink, grammar=grammar)
        with self._cond:
            if self._loop.stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away): out of the queue now, or its KV freed next step."""
        with self._cond:
            for seq in self._waiting:
                if seq.request_id == request_id:
                    self._waiting.remove(seq)
                    seq.finish_reason, seq.finish_time = "abort", time.perf_counter()
                    self.observer.on_finished(seq)
                    return
            self._abort_ids.add(request_id)
            self._cond.notify()

    def pause(self, request_id: str) -> None:
        """Take a running request out of the batch from the next step on (its KV kept until
        :meth:`resume` or :meth:`abort`): for a consumer that cannot take more events; any thread."""
        with self._cond:
            self._paused.pause(request_id)

    def resume(self, request_id: str) -> None:
        """Let a paused request rejoin the batch (as soon as it has room for it)."""
        with self._cond:
            self._paused.resume(request_id)
            self._cond.notify()

    def check_prompt(self, prompt: list[int]) -> None:
        """The prompt rules: non-empty, shorter than the context, ids in the vocabulary."""
        check_prompt(prompt, self.context_length, self.vocab_size, self.runtime.context_description)

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        self._loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still queued or running end with an error event."""
        self._loop.stop(timeout)
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        stopped = RequestLoopStopped("the server is shutting down")
        for seq in waiting + self._running:
            self.processor.finish_error(seq, stopped, str(stopped))
        self._loop.stopped()

    is_running = property(lambda self: self._loop.is_running)

    @property
    def num_running(self) -> int:
        """Sequences in the batch (prefilling or decoding; paused ones not counted)."""
        running = list(self._running)
        return len(running) - self._paused.count(running)

    @property
    def num_paused(self) -> int:
        """Sequences paused by their consumer (their KV kept)."""
        return self._paused.count(list(self._running))

    num_waiting = property(lambda self: len(self._waiting))
    reserved_bytes = property(lambda self: self._reserved)  # KV bytes promised to running sequences

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
        bus = {**self.policies.bus_bytes(running), "hidden_states": self.executor.hop_bytes}
        page_bytes = self.page_size * self.token_bytes
        kv_bytes = {tier: self.ledger.current(tier) for tier in TIERS}
        paused = self._paused.count(running)
        return {
            "running": len(running) - paused, "paused": paused, "waiting": len(self._waiting), "kv_bytes": kv_bytes,
            "kv_budget_bytes": {tier: self.ledger.budget(tier) for tier in TIERS},
            "kv_pages": {tier: -(-n // page_bytes) for tier, n in kv_bytes.items()},
            "kv_reserved_bytes": self._reserved, "kv_capacity_bytes": self.capacity, "bus_bytes": bus,
            "prefix_cache": self.policies.prefix_stats(),
        }

    # ---- the loop ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether anything is queued, running or waiting to be aborted."""
        return bool(self._waiting or self._running or self._abort_ids)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Run steps on the calling thread until nothing is queued or running (tests, tools; a
        paused request counts as running: resume or abort it first)."""
        return self._loop.run_until_idle(max_steps)

    def step(self) -> bool:
        """One iteration: aborts, resumes, admission, then plan -> execute -> process. Returns
        whether sequences ran (False: nothing to run, or every running request paused)."""
        self._apply_aborts()
        with self._cond:
            self._paused.settle(self._running, self.max_batch)
        self._admit()
        if not self._batch():
            return False
        plan = self.schedule()
        self.processor.process(plan, self.executor.execute(plan))
        self.observer.on_step(plan.decode_rows, plan.prefill_tokens)
        return True

    def _apply_aborts(self) -> None:
        with self._cond:
            ids, self._abort_ids = self._abort_ids, set()
        for seq in [seq for seq in self._running if seq.request_id in ids]:
            seq.finish_reason = "abort"
            self._release(seq)
            self.observer.on_finished(seq)

    def _batch(self) -> list[SequenceState]:
        """The running sequences that are not paused: what a plan and the batch size see."""
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
                unstarted = [len(s.prompt_ids) for s in self._running if s.prefilled == 0]
                if self._running and not self.budget.device_room_free(len(seq.prompt_ids), unstarted):
                    return  # wait until running sequences leave device room for its first chunk
                self._waiting.popleft()
                self._reserved += seq.kv_bytes
                alone = not self._running
                self._running.append(seq)
            try:
                self.processor.start(seq, alone)
            except Exception as exc:
                self.processor.fail(seq, exc, "could not start the request")

    def schedule(self) -> StepPlan:
        """This step's rows: every decoding sequence's pending tokens (and proposal), then prefill
        chunks of new sequences within the step's prompt-token budget (paused requests run nothing)."""
        batch = self._batch()
        plan = self.speculator.propose(StepPlan([ScheduledRow(seq, list(seq.pending)) for seq in batch
                                                 if seq.pending]))
        return add_prefill_chunks(plan, batch, self.prefill_chunk, self.policies)

    def _add_running(self, seq: SequenceState) -> None:
        with self._cond:
            self._running.append(seq)

    def _release(self, seq: SequenceState) -> None:
        """Free the sequence's KV and its reservation; take it out of the running set."""
        seq.finish_time = time.perf_counter()
        seq.pending = []
        self.policies.free(seq)
        self.speculator.release(seq)
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
                self._reserved -= seq.kv_bytes
            self._cond.notify()
