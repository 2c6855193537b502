"""A request's way through the request loop: submitted, then its events collected or streamed as SSE.

The HTTP side runs on the asyncio loop; the model runs only on the scheduler's loop thread, which
hands each event back into the request's bounded buffer (:class:`~hybridllm.server.backpressure.RequestEvents`:
a client that stops reading pauses its request, and is given up on after the stall timeout). A
client that goes away (a closed stream, a disconnect while a JSON answer is computed) aborts its
request at once, so its KV and batch slot are freed at the next step.

An error event of the loop becomes an OpenAI error object (:func:`event_error`): the loop stopping
(shutdown) 503 with Retry-After, a KV budget exhausted mid-request 503, a schema the output cannot
follow 400, any other input error 400, a fault 500 (the loop logged its traceback once).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from hybridllm.config import SamplingParams
from hybridllm.engine.scheduler import AdmissionError, QueueFullError, RequestLoopStopped, SeqEvent
from hybridllm.engine.structured import GrammarError
from hybridllm.errors import HybridLLMError
from hybridllm.kvcache.base import KVBudgetError
from hybridllm.server.backpressure import EventStreamResponse, RequestEvents, wait_disconnected
from hybridllm.server.context import ServerContext
from hybridllm.server.protocol import RETRY_AFTER_S, APIError

SSE_HEADERS = {"Cache-Control": "no-cache"}

Payload = dict[str, Any]


@dataclass(frozen=True)
class ChunkFrame:
    """The envelope every SSE chunk of one request shares (OpenAI's ``chat.completion.chunk`` or
    ``text_completion``).

    Attributes:
        request_id: the response id.
        object: the chunks' ``object``.
        created: Unix seconds.
        model: the served model id.
        fingerprint: the ``system_fingerprint``.
        include_usage: ``stream_options.include_usage`` (then every chunk has ``usage``: null).
        blank: the content field of a choice that carries nothing (chat: ``delta`` ``{}``,
            completions: ``text`` ``""``).
    """

    request_id: str
    object: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool
    blank: tuple[str, Any]

    def _envelope(self) -> Payload:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def choice(self, index: int, content: Any = None, logprobs: Payload | None = None,
               finish_reason: str | None = None) -> Payload:
        """A chunk of one choice; ``content`` is its ``delta`` (chat) or ``text`` (None: blank)."""
        key, empty = self.blank
        out = self._envelope()
        out["choices"] = [{"index": index, key: empty if content is None else content, "logprobs": logprobs,
                           "finish_reason": finish_reason}]
        if self.include_usage:
            out["usage"] = None
        return out

    def usage(self, usage: Payload) -> Payload:
        """The last chunk (``stream_options.include_usage``): no choices, the usage."""
        return {**self._envelope(), "choices": [], "usage": usage}


def sse(payload: Payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def submit(ctx: ServerContext, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 grammar_param: str = "response_format") -> RequestEvents:
    """Queue the request; its events arrive in the returned buffer. ``grammar_param``: the field
    a structured-output error names.

    A structured-output request compiles its grammar while queued: that runs on a worker thread
    so that the event loop keeps serving the other requests meanwhile."""
    events = RequestEvents(ctx.scheduler, request_id, stall_timeout_s=ctx.stream_stall_timeout_s,
                           on_pause=ctx.metrics.on_stream_paused)
    try:
        if params.structured is None:
            ctx.scheduler.submit(request_id, prompt_ids, params, events.sink)
        else:
            await run_in_threadpool(ctx.scheduler.submit, request_id, prompt_ids, params, events.sink)
    except QueueFullError as exc:
        ctx.metrics.on_rejected("queue_full")
        raise APIError(503, str(exc), type="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except AdmissionError as exc:
        ctx.metrics.on_rejected("kv_budget")
        raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from None
    except GrammarError as exc:
        raise APIError(400, f"{grammar_param}: {exc}", param=grammar_param, code="invalid_schema") from None
    except HybridLLMError as exc:
        raise APIError(400, str(exc)) from None
    return events


async def collect(ctx: ServerContext, request: Request, request_id: str, events: RequestEvents,
                  n: int) -> list[SeqEvent] | None:
    """Wait for the last events of the request's ``n`` sequences (by index), or its first error
    event alone; None (and the request aborted at once) if the client goes away meanwhile."""
    finished = False
    finals: list[SeqEvent] = []
    getter: asyncio.Future[SeqEvent] | None = None
    departed = asyncio.ensure_future(wait_disconnected(request))
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(events.get())
            # asyncio.wait (unlike wait_for) never cancels the getter, so no event can be lost
            done, _ = await asyncio.wait({getter, departed}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                return None  # the client went away
            event, getter = getter.result(), None
            if event.error is not None:
                return [event]  # the finally aborts the request's other sequences
            if event.finished:
                finals.append(event)
                if len(finals) == n:
                    finished = True
                    return sorted(finals, key=lambda final: final.index)
    finally:
        departed.cancel()
        if getter is not None:
            getter.cancel()
        if not finished:
            ctx.scheduler.abort(request_id)


def event_error(event: SeqEvent, grammar_param: str = "response_format") -> APIError:
    """The OpenAI error of a request the loop ended with an error event."""
    exc, message = event.exception, event.error or "the request failed"
    if isinstance(exc, RequestLoopStopped):
        return APIError(503, message, type="server_error", code="shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, KVBudgetError):
        return APIError(503, f"the KV cache budget ran out while the request ran: {message}; retry later",
                        type="server_error", code="kv_budget_exhausted", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, GrammarError):
        return APIError(400, f"{grammar_param}: {message}", param=grammar_param, code="invalid_schema")
    if isinstance(exc, HybridLLMError):
        return APIError(400, message)
    return APIError(500, message, type="server_error")


def raise_event_error(events: list[SeqEvent], grammar_param: str = "response_format") -> None:
    """Raise the request's error when the loop ended it with one (:func:`event_error`)."""
    for event in events:
        if event.error is not None:
            raise event_error(event, grammar_param)


def usage(events: list[SeqEvent], count_completion: bool = True) -> Payload:
    """The prompt once, and every sequence's completion tokens; the prompt tokens the prefix
    cache supplied (OpenAI's ``prompt_tokens_details.cached_tokens``); speculative decoding's
    proposals (``completion_tokens_details``: OpenAI's accepted / rejected prediction tokens, and
    the drafts, proposed tokens and acceptance rate), summed over the sequences."""
    prompt_tokens = events[0].prompt_tokens
    completion_tokens = sum(event.completion_tokens for event in events) if count_completion else 0
    cached = max((event.metrics or {}).get("cached_tokens", 0) for event in events)
    drafts, proposed, accepted = (sum((event.metrics or {}).get(key, 0) for event in events)
                                  for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": proposed - accepted,
                                          "speculative_drafts": drafts, "speculative_draft_tokens": proposed,
                                          "speculative_acceptance_rate": accepted / proposed if proposed else None}}


def event_stream(ctx: ServerContext, events: RequestEvents, lines: AsyncIterator[str]) -> EventStreamResponse:
    """The SSE response of ``lines`` (from :func:`stream_events` or :func:`stream_whole`): ended
    at once when the client disconnects, and after the stall timeout when it stops reading."""
    return EventStreamResponse(lines, events, on_stall=ctx.metrics.on_stream_stalled, headers=SSE_HEADERS)


async def stream_events(ctx: ServerContext, request_id: str, events: RequestEvents, frame: ChunkFrame,
                        head: list[Payload], content: Callable[[SeqEvent], list[Payload]], n: int,
                        count_completion: bool = True, grammar_param: str = "response_format") -> AsyncIterator[str]:
    """SSE lines of one request: ``head``, then ``content(event)`` of each event and a finish
    chunk per sequence, until its ``n`` sequences end; closing the stream early (client gone)
    aborts the request. An error ends it with an error event (:func:`event_error`'s object) and
    ``[DONE]``."""
    finished = False
    finals: list[SeqEvent] = []
    try:
        for payload in head:
            yield sse(payload)
        while True:
            event = await events.get()
            if event.error is not None:
                yield sse(event_error(event, grammar_param).body())
                break  # the finally aborts the request's other sequences
            for payload in content(event):
                yield sse(payload)
            if event.finished:
                finals.append(event)
                reason = event.finish_reason if count_completion else "length"
                yield sse(frame.choice(event.index, finish_reason=reason))
                if len(finals) == n:
                    finished = True
                    if frame.include_usage:
                        yield sse(frame.usage(usage(finals, count_completion)))
                    break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            ctx.scheduler.abort(request_id)


async def stream_whole(ctx: ServerContext, request_id: str, events: RequestEvents, frame: ChunkFrame,
                       first: Payload, reply: Callable[[SeqEvent], tuple[Payload, str | None]],
                       grammar_param: str = "tools") -> AsyncIterator[str]:
    """SSE of a reply sent in one delta when it ends (tool calls cannot be told from text before).
    ``reply(event)`` gives the (delta, finish_reason) of the finished request."""
    finished = False
    try:
        yield sse(first)
        while True:
            event = await events.get()
            if event.error is not None:
                finished = True
                yield sse(event_error(event, grammar_param).body())
                break
            if event.finished:
                finished = True
                delta, finish_reason = reply(event)
                yield sse(frame.choice(0, content=delta))
                yield sse(frame.choice(0, finish_reason=finish_reason))
                if frame.include_usage:
                    yield sse(frame.usage(usage([event])))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            ctx.scheduler.abort(request_id)
