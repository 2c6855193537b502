"""``generate`` and ``stream`` over the request loop: submit, then step until the sequence ends.

    engine = LLMEngine(runtime)
    result = engine.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0))
    results = engine.generate_batch([ids_a, ids_b], [params_a, params_b])  # batched in the loop

There is one request loop (:class:`~hybridllm.engine.scheduler.Scheduler`); a single request
is a batch of one in it (nano-vllm's ``LLMEngine.generate``). When the loop already runs on its
own thread (the server), the caller waits for the sequence's events instead of stepping.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import SamplingParams
from hybridllm.engine.logprobs import TokenLogprob
from hybridllm.engine.scheduler import Scheduler
from hybridllm.kvcache.prefix_cache import PrefixCache
from hybridllm.engine.sequence import SeqEvent
from hybridllm.errors import ConfigError, HybridLLMError

CANCEL_POLL_S = 0.05  # how often a caller waiting for the loop's thread looks at its cancel event


@dataclass
class GenerationResult:
    """What a request produced. ``finish_reason`` is "stop" (EOS or a stop string) or "length".

    ``logprobs``: one entry per generated token when ``SamplingParams.logprobs`` is set;
    ``prompt_logprobs``: one per prompt token (None for the first) when ``prompt_logprobs`` is
    set; ``index``: which of the request's ``n`` sequences.
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0


@dataclass
class StreamEvent:
    """A piece of streamed output. The last event of a request carries the ``result``."""

    text: str
    token_id: int | None = None
    result: GenerationResult | None = None
    index: int = 0  # which of the request's n sequences
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens this event completes (when asked)


class LLMEngine:
    """Runs requests on a built runtime through its request loop.

    Args:
        runtime: the built model (:func:`hybridllm.runtime.build.build_runtime`).
        max_batch, max_queue, host_budget: the loop's limits (see :class:`Scheduler`).
        prefix_cache: KV pages reused across requests (None: none).
    """

    def __init__(self, runtime: Any, max_batch: int = 16, max_queue: int = 256,
                 host_budget: int | None = None, prefix_cache: PrefixCache | None = None) -> None:
        self.runtime = runtime
        self.scheduler = Scheduler(runtime, max_batch=max_batch, max_queue=max_queue, host_budget=host_budget,
                                   prefix_cache=prefix_cache)
        self._ids = itertools.count()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Run a request to completion (``params.n`` must be 1; see :meth:`generate_all`)."""
        if params.n != 1:
            raise ConfigError(f"generate returns one sequence but n={params.n}; use generate_all")
        return self.generate_all(prompt_ids, params)[0]

    def generate_all(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationResult]:
        """Run a request to completion: its ``params.n`` sequences, by index."""
        results = [event.result for event in self.stream(prompt_ids, params) if event.result is not None]
        return sorted(results, key=lambda result: result.index)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
               cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """Run a request, yielding text pieces as they are decided; each sequence's last event
        has its result (one sequence unless ``params.n > 1``: events carry their ``index``).

        ``cancel``: once set (from any thread, or a signal handler), the stream ends before the
        loop's next step, without a result, and the request's KV is freed (chat's Ctrl-C).
        """
        prompt = [int(t) for t in prompt_ids]
        events: queue.SimpleQueue[SeqEvent] = queue.SimpleQueue()
        request_id = f"generate-{next(self._ids)}"
        self.scheduler.submit(request_id, prompt, params, events.put)
        unfinished = params.n
        finished = False
        try:
            while not finished:
                event = self._next_event(events, cancel)
                if event is None:  # cancelled: the finally aborts the request
                    return
                if event.error is not None:
                    unfinished -= 1
                    finished = unfinished == 0  # else the finally aborts the request's other sequences
                    _raise_error(event)
                if event.text or event.logprobs:
                    yield StreamEvent(event.text, event.token_id, index=event.index, logprobs=event.logprobs)
                if event.finish_reason is not None:
                    unfinished -= 1
                    finished = unfinished == 0
                    yield StreamEvent("", None, _result(event, prompt), index=event.index)
        finally:
            if not finished:  # the consumer stopped early: free the sequence's KV now
                self.scheduler.abort(request_id)
                if not self.scheduler.is_running:
                    self.scheduler.step()

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                       on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Run many requests together through the loop (one sequence each); their results in order.

        Requests are submitted as the loop has room (at most ``max_batch`` running plus as many
        queued), so any number of them fits the queue; the loop batches their decodes and
        shares each step's prefill budget among them.

        Args:
            prompts: the token ids of each request (nothing is prepended).
            params: each request's sampling parameters (``n`` must be 1).
            on_result: called with (request index, result) as each request finishes (progress bars).

        Raises:
            ConfigError: ``prompts`` and ``params`` differ in length, or an ``n`` is not 1.
            HybridLLMError: a request the loop refused (prompt too long, KV budget); the others are aborted.
        """
        if len(prompts) != len(params):
            raise ConfigError(f"generate_batch got {len(prompts)} prompts but {len(params)} sampling parameters")
        if any(p.n != 1 for p in params):
            raise ConfigError("generate_batch runs one sequence per request; n must be 1")
        events: queue.SimpleQueue[SeqEvent] = queue.SimpleQueue()
        batch_id = next(self._ids)
        request_ids = [f"batch-{batch_id}-{index}" for index in range(len(prompts))]
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        results: list[GenerationResult | None] = [None] * len(prompts)
        window = 2 * self.scheduler.max_batch  # running plus queued: the queue never overflows
        submitted = finished = 0
        try:
            while finished < len(prompts):
                while submitted < len(prompts) and submitted - finished < window:
                    prompt = [int(t) for t in prompts[submitted]]
                    self.scheduler.submit(request_ids[submitted], prompt, params[submitted], events.put)
                    submitted += 1
                event = self._next_event(events)
                if event.error is not None:
                    _raise_error(event)
                if event.finish_reason is None:
                    continue
                index = index_of[event.request_id]
                results[index] = _result(event, [int(t) for t in prompts[index]])
                finished += 1
                if on_result is not None:
                    on_result(index, results[index])
        finally:
            unfinished = [request_ids[i] for i in range(submitted) if results[i] is None]
            for request_id in unfinished:  # a failure or a consumer that stopped: free their KV now
                self.scheduler.abort(request_id)
            if unfinished and not self.scheduler.is_running:
                self.scheduler.step()
        return results

    def _next_event(self, events: queue.SimpleQueue[SeqEvent],
                    cancel: threading.Event | None = None) -> SeqEvent | None:
        """The sequence's next event: step the loop here, or wait for the loop's thread; None
        as soon as ``cancel`` is set (checked between steps)."""
        while events.empty() and not self.scheduler.is_running:
            if cancel is not None and cancel.is_set():
                return None
            self.scheduler.step()
        while cancel is not None:
            if cancel.is_set():
                return None
            try:
                return events.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                continue
        return events.get()


def _raise_error(event: SeqEvent) -> None:
    """Raise a failed sequence's error: the user's (budgets, prompt) as it is, so the CLI prints
    one line; anything else as an internal error."""
    if isinstance(event.exception, HybridLLMError):
        raise event.exception
    raise RuntimeError(event.error) from event.exception


def _result(event: SeqEvent, prompt: list[int]) -> GenerationResult:
    """The result a sequence's last event carries."""
    return GenerationResult(event.full_text, event.token_ids, prompt, event.finish_reason, event.metrics or {},
                            event.all_logprobs, event.prompt_logprobs, event.index)
