"""The OpenAI-compatible HTTP API (FastAPI) in front of a continuous-batching scheduler.

    from hybridllm import LLM
    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.server.app import create_app

    llm = LLM()
    app = create_app(llm, Scheduler(llm.runtime, max_batch=16))   # serve with uvicorn.run(app, ...)

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE streaming),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize``
(llama.cpp's shapes), ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus), and the
OpenAPI schema at ``/openapi.json`` (``/docs`` renders it). Errors are OpenAI error objects.
When an API key is set, every ``/v1`` route and the tokenizer routes need
``Authorization: Bearer <key>``. Every completion and stream chunk carries the
``system_fingerprint`` of the build (:mod:`hybridllm.server.fingerprint`). Request bodies over
``max_request_bytes`` get 413; OpenAI fields the server does not implement get 400
(:mod:`hybridllm.server.unsupported`); while the server drains for shutdown, new requests get
503 (:mod:`hybridllm.server.shutdown`).

The HTTP side runs on the asyncio loop; the model runs only on the scheduler's loop thread,
which hands events back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridllm import __version__
from hybridllm.config import SamplingParams, StructuredOutput
from hybridllm.engine.logprobs import TokenLogprob
from hybridllm.engine.scheduler import AdmissionError, QueueFullError, Scheduler, SeqEvent
from hybridllm.engine.structured import GrammarError
from hybridllm.errors import HybridLLMError
from hybridllm.loading.local_models import model_name
from hybridllm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from hybridllm.server.fingerprint import system_fingerprint
from hybridllm.server.logprobs import TokenText, chat_logprobs, completion_logprobs, join_completion_logprobs
from hybridllm.server.metrics import CONTENT_TYPE, ServerMetrics
from hybridllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    VersionInfo,
    error_body,
    structured_output,
)
from hybridllm.server.shutdown import Draining, RefuseWhileDraining
from hybridllm.server.tools import forced_call_schema, parse_tool_calls, render_with_tools
from hybridllm.server.unsupported import refuse_unsupported

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MAX_STOP_STRINGS = 16
DISCONNECT_POLL_S = 0.5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "Request body over the size limit"},
    503: {"model": ErrorResponse, "description": "Queue full (see Retry-After), or shutting down"},
}


def default_model_name(llm: Any) -> str:
    """The served model id: the model's one name (:func:`~hybridllm.loading.local_models.model_name`,
    ``SmolLM2-135M-Instruct.Q4_1``), as ``hybridllm models`` and chat show it."""
    path = getattr(getattr(llm, "checkpoint", None), "path", None)
    if path is not None:
        return model_name(path)
    return llm.config.name or "hybridllm"


def create_app(
    llm: Any,
    scheduler: Scheduler | None = None,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    manage_scheduler: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """Build the app around ``llm`` (an ``LLM``: tokenizer, chat template) and its request loop.

    Args:
        llm: the loaded model.
        scheduler: the request loop over ``llm.runtime`` (None: the one ``llm`` generates
            with); its observer is replaced by this app's metrics.
        model_name: the served model id (default: from the checkpoint's path).
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
        manage_scheduler: start the scheduler's loop with the app and stop it at shutdown.
        max_request_bytes: the largest request body accepted (bigger: 413).

    The app's state holds ``scheduler``, ``metrics``, ``model_name`` and ``draining`` (the
    switch a :class:`~hybridllm.server.shutdown.GracefulServer` turns on at SIGTERM).
    """
    scheduler = scheduler if scheduler is not None else llm.engine.scheduler
    served = model_name or default_model_name(llm)
    aliases = {served, default_model_name(llm)}
    if llm.config.name:
        aliases.add(llm.config.name)
    path = getattr(getattr(llm, "checkpoint", None), "path", None)
    if path is not None:
        aliases.add(Path(path).name)
    metrics = ServerMetrics(scheduler, served)
    scheduler.observer = metrics
    created = int(time.time())
    fingerprint = system_fingerprint(scheduler.runtime)
    draining = Draining()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if manage_scheduler:
            scheduler.start()
        try:
            yield
        finally:
            if manage_scheduler:
                await run_in_threadpool(scheduler.stop)

    app = FastAPI(
        title="hybridllm",
        version=__version__,
        description="OpenAI-compatible API of hybridllm, with continuous batching.",
        lifespan=lifespan,
    )
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.model_name = served
    app.state.draining = draining
    app.add_middleware(RefuseWhileDraining, draining=draining, on_refused=lambda: metrics.on_rejected("shutting_down"))
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       on_refused=lambda: metrics.on_rejected("request_too_large"))

    # ---- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        if exc.status == 401:
            metrics.on_rejected("unauthorized")
        elif exc.status == 400 and exc.code != "kv_budget_exceeded":
            metrics.on_rejected("invalid")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.on_rejected("invalid")
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        elif first.get("type") == "missing":
            message = f"missing required parameter: {param or 'body'}"
        else:
            message = f"invalid value for {param or 'the body'}: {first.get('msg', 'invalid')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return JSONResponse(error_body(message, param=param, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc}", type="server_error"), status_code=500)

    # ---- auth ----------------------------------------------------------------------------
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    # ---- helpers -------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name not in aliases:
            raise APIError(400, f"the model '{name}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")

    token_text = TokenText(llm.tokenizer, raw_bytes=lambda token_id: scheduler.grammars.ll_tokenizer().decode_bytes([token_id]))

    def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's ``logit_bias`` (token id as a string -> bias) checked against the vocabulary."""
        out = {}
        for key, bias in (raw or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= token_id < scheduler.vocab_size:
                raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary "
                               f"(0..{scheduler.vocab_size - 1})", param="logit_bias")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
                               param="logit_bias")
            out[token_id] = float(bias)
        return out

    def repetition_penalty(req: ChatCompletionRequest | CompletionRequest) -> float:
        """``repetition_penalty``, or llama.cpp's ``repeat_penalty`` (the same when both are given)."""
        value, alias = req.repetition_penalty, req.repeat_penalty
        if alias is not None and value is not None and alias != value:
            raise APIError(400, f"repeat_penalty ({alias}) is llama.cpp's name of repetition_penalty ({value}); "
                           f"give one of them", param="repeat_penalty")
        value = alias if value is None else value
        return 1.0 if value is None else float(value)

    def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                        default_max: int | None, prompt_len: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        if (req.n or 1) > scheduler.max_batch:
            raise APIError(400, f"n={req.n} choices do not fit in this server's batch of {scheduler.max_batch} "
                           f"sequences; lower n", param="n")
        ctx, limit = scheduler.context_length, scheduler.runtime.context_description
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens but {limit}; "
                           f"shorten it", param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            raise APIError(400, f"{prompt_len + max_tokens} tokens were requested ({prompt_len} in the prompt, "
                           f"{max_tokens} for the completion) but {limit}; lower max_tokens to at most "
                           f"{ctx - prompt_len}", param="max_tokens", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=max(0, req.top_k or 0),
                min_p=req.min_p or 0.0,
                repetition_penalty=repetition_penalty(req),
                seed=req.seed,
                stop=stop,
                ignore_eos=bool(req.ignore_eos),
                presence_penalty=float(req.presence_penalty or 0.0),
                frequency_penalty=float(req.frequency_penalty or 0.0),
                logit_bias=logit_bias(req.logit_bias),
                n=req.n or 1,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured,
            )
        except HybridLLMError as exc:
            raise APIError(400, str(exc)) from None

    async def submit(request_id: str, prompt_ids: list[int], params: SamplingParams,
                     grammar_param: str = "response_format") -> asyncio.Queue[SeqEvent]:
        """Queue the request; ``grammar_param``: the field a structured-output error names.

        A structured-output request compiles its grammar while queued: that runs on a worker
        thread so that the event loop keeps serving the other requests meanwhile."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

        def sink(event: SeqEvent) -> None:  # called on the scheduler thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            if params.structured is None:
                scheduler.submit(request_id, prompt_ids, params, sink)
            else:
                await run_in_threadpool(scheduler.submit, request_id, prompt_ids, params, sink)
        except QueueFullError as exc:
            metrics.on_rejected("queue_full")
            raise APIError(503, str(exc), type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except AdmissionError as exc:
            metrics.on_rejected("kv_budget")
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from None
        except GrammarError as exc:
            raise APIError(400, f"{grammar_param}: {exc}", param=grammar_param, code="invalid_schema") from None
        except HybridLLMError as exc:
            raise APIError(400, str(exc)) from None
        return queue

    async def collect(request: Request, request_id: str, queue: asyncio.Queue[SeqEvent],
                      n: int) -> list[SeqEvent] | None:
        """Wait for the last events of the request's ``n`` sequences (by index), or its first
        error event alone; None (and the request aborted) if the client went away."""
        finished = False
        finals: list[SeqEvent] = []
        getter: asyncio.Future[SeqEvent] | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                # asyncio.wait (unlike wait_for) never cancels the getter, so no event can be lost
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        return None
                    continue
                event, getter = getter.result(), None
                if event.error is not None:
                    return [event]  # the finally aborts the request's other sequences
                if event.finished:
                    finals.append(event)
                    if len(finals) == n:
                        finished = True
                        return sorted(finals, key=lambda final: final.index)
        finally:
            if getter is not None:
                getter.cancel()
            if not finished:
                scheduler.abort(request_id)

    def raise_event_error(events: list[SeqEvent]) -> None:
        for event in events:
            if event.error is not None:
                raise APIError(500, event.error, type="server_error")

    def usage(events: list[SeqEvent], count_completion: bool = True) -> dict[str, Any]:
        """The prompt once, and every sequence's completion tokens; the prompt tokens the prefix
        cache supplied (OpenAI's ``prompt_tokens_details.cached_tokens``)."""
        prompt_tokens = events[0].prompt_tokens
        completion_tokens = sum(event.completion_tokens for event in events) if count_completion else 0
        cached = max((event.metrics or {}).get("cached_tokens", 0) for event in events)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def stream_events(request_id: str, queue: asyncio.Queue[SeqEvent], chunk: Any, include_usage: bool,
                            head: list[dict[str, Any]], content: Callable[[SeqEvent], list[dict[str, Any]]],
                            n: int, count_completion: bool = True) -> AsyncIterator[str]:
        """SSE lines of one request: ``head``, then ``content(event)`` of each event and a finish
        chunk per sequence, until its ``n`` sequences end; closing the stream early (client gone)
        aborts the request."""
        finished = False
        finals: list[SeqEvent] = []
        try:
            for payload in head:
                yield sse(payload)
            while True:
                event = await queue.get()
                if event.error is not None:
                    yield sse(error_body(event.error, type="server_error"))
                    break  # the finally aborts the request's other sequences
                for payload in content(event):
                    yield sse(payload)
                if event.finished:
                    finals.append(event)
                    reason = event.finish_reason if count_completion else "length"
                    yield sse(chunk(finish_reason=reason, index=event.index))
                    if len(finals) == n:
                        finished = True
                        if include_usage:
                            yield sse(chunk(usage=usage(finals, count_completion)))
                        break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                scheduler.abort(request_id)

    async def stream_whole(request_id: str, queue: asyncio.Queue[SeqEvent], chunk: Any, include_usage: bool,
                           first: dict[str, Any], reply: Any) -> AsyncIterator[str]:
        """SSE of a reply sent in one delta when it ends (tool calls cannot be told from text before).
        ``reply(event)`` gives the (delta, finish_reason) of the finished request."""
        finished = False
        try:
            yield sse(first)
            while True:
                event = await queue.get()
                if event.error is not None:
                    finished = True
                    yield sse(error_body(event.error, type="server_error"))
                    break
                if event.finished:
                    finished = True
                    delta, finish_reason = reply(event)
                    yield sse(chunk(delta=delta))
                    yield sse(chunk(finish_reason=finish_reason))
                    if include_usage:
                        yield sse(chunk(usage=usage([event])))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                scheduler.abort(request_id)

    def chat_tools(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], StructuredOutput | None]:
        """The tools offered to the model (none for tool_choice "none"), and the constraint that
        forces a call ("required" or a named function)."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if choice == "none" or not tools:
            return [], None
        functions = [tool["function"] for tool in tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                raise APIError(400, f"tool_choice names '{choice.function.name}', which is not in tools",
                               param="tool_choice")
        elif choice != "required":
            return tools, None
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a forced tool_choice",
                           param="response_format")
        return tools, StructuredOutput(forced_call_schema(functions))

    def chat_reply(text: str, finish_reason: str | None, tool_names: list[str],
                   single_call: bool) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished reply: its tool calls when it made any."""
        calls = parse_tool_calls(text, tool_names) if tool_names else []
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls[:1] if single_call else calls}, "tool_calls"

    # ---- routes --------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=auth, response_model=ChatCompletionResponse,
              responses=ERROR_RESPONSES, summary="Chat completion (JSON, or SSE when stream=true)")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        refuse_unsupported(body.model_extra)
        if not body.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        want_logprobs = bool(body.logprobs)
        if body.top_logprobs is not None and not want_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = [m.template_message() for m in body.messages]
        tools, forced = chat_tools(body)
        tool_names = [tool["function"]["name"] for tool in tools]
        if tools and (body.n or 1) > 1:
            raise APIError(400, "n > 1 together with tools is not supported", param="n")
        try:
            if tools:
                text = await run_in_threadpool(render_with_tools, llm.tokenizer, messages, tools)
                prompt_ids = await run_in_threadpool(llm.tokenizer.encode, text, False)
            else:
                prompt_ids = await run_in_threadpool(llm.encode_prompt, messages)
        except HybridLLMError as exc:
            raise APIError(400, f"cannot format the messages: {exc}", param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        structured = forced or structured_output(body.response_format)
        params = sampling_params(body, max_tokens, None, len(prompt_ids),
                                 logprobs=(body.top_logprobs or 0) if want_logprobs else None, structured=structured)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        queue = await submit(request_id, prompt_ids, params, "tools" if forced else "response_format")
        single_call = body.parallel_tool_calls is False

        def logprobs_of(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
            return chat_logprobs(entries or [], token_text) if want_logprobs else None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(text: str | None = None, finish_reason: str | None = None,
                      usage: dict[str, int] | None = None, role: bool = False, index: int = 0,
                      logprobs: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
                out: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": now,
                                       "model": served, "system_fingerprint": fingerprint}
                if usage is not None:
                    out["choices"] = []
                    out["usage"] = usage
                    return out
                if role:
                    delta = {"role": "assistant", "content": ""}
                elif text is not None:
                    delta = {"content": text}
                out["choices"] = [{"index": index, "delta": delta or {}, "logprobs": logprobs,
                                   "finish_reason": finish_reason}]
                if include_usage:
                    out["usage"] = None
                return out

            if tools:  # whole: a reply is known to be tool calls only when it ends
                def reply(event: SeqEvent) -> tuple[dict[str, Any], str | None]:
                    message, reason = chat_reply(event.full_text, event.finish_reason, tool_names, single_call)
                    if "tool_calls" not in message:
                        return {"content": message["content"]}, reason
                    calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                    return {"tool_calls": calls}, reason

                return StreamingResponse(stream_whole(request_id, queue, chunk, include_usage, chunk(role=True), reply),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

            def content(event: SeqEvent) -> list[dict[str, Any]]:
                if not (event.text or event.logprobs):
                    return []
                return [chunk(text=event.text, index=event.index, logprobs=logprobs_of(event.logprobs))]

            head = [chunk(role=True, index=index) for index in range(params.n)]
            return StreamingResponse(stream_events(request_id, queue, chunk, include_usage, head, content, params.n),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        events = await collect(request, request_id, queue, params.n)
        if events is None:
            return Response(status_code=499)
        raise_event_error(events)
        choices = []
        for event in events:
            message, finish_reason = chat_reply(event.full_text, event.finish_reason, tool_names, single_call)
            choices.append({"index": event.index, "message": message, "finish_reason": finish_reason,
                            "logprobs": logprobs_of(event.all_logprobs)})
        return {
            "id": request_id, "object": "chat.completion", "created": now, "model": served,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage(events),
        }

    @app.post("/v1/completions", dependencies=auth, response_model=CompletionResponse,
              responses=ERROR_RESPONSES, summary="Text completion (JSON, or SSE when stream=true)")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        refuse_unsupported(body.model_extra)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "the prompt is empty", param="prompt")
            prompt_ids = await run_in_threadpool(llm.tokenizer.encode, prompt, True)
        else:
            prompt_ids = list(prompt)
            if not prompt_ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            try:
                scheduler.check_prompt(prompt_ids)
            except HybridLLMError as exc:
                raise APIError(400, str(exc), param="prompt") from None
        echo, want_logprobs = bool(body.echo), body.logprobs is not None
        prompt_text = ""
        if echo:  # the prompt as given; token ids as their text (special tokens spelled out)
            prompt_text = prompt if isinstance(prompt, str) else await run_in_threadpool(llm.tokenizer.decode,
                                                                                        prompt_ids)
        # max_tokens 0 (the prompt's log-probabilities alone): the engine samples one token, never sent
        generate = body.max_tokens != 0
        params = sampling_params(body, body.max_tokens if generate else 1, DEFAULT_COMPLETION_MAX_TOKENS,
                                 len(prompt_ids), logprobs=body.logprobs,
                                 prompt_logprobs=body.logprobs if echo and want_logprobs else None,
                                 structured=structured_output(body.response_format))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        queue = await submit(request_id, prompt_ids, params)
        completion_start = len(prompt_text)  # text_offset of the first generated token

        def prompt_logprobs_of(event: SeqEvent) -> dict[str, Any]:
            return completion_logprobs(prompt_ids, event.prompt_logprobs or [], token_text)

        def choice_logprobs(event: SeqEvent) -> dict[str, Any] | None:
            if not want_logprobs:
                return None
            entries = (event.all_logprobs or []) if generate else []
            out = completion_logprobs([e.token_id for e in entries], entries, token_text, completion_start)
            return join_completion_logprobs(prompt_logprobs_of(event), out) if echo else out

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            offsets = [completion_start] * params.n  # text_offset of each choice's next token
            echoed: set[int] = set()

            def chunk(text: str | None = None, finish_reason: str | None = None,
                      usage: dict[str, int] | None = None, index: int = 0,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
                out: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": now,
                                       "model": served, "system_fingerprint": fingerprint}
                if usage is not None:
                    out["choices"] = []
                    out["usage"] = usage
                    return out
                out["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs,
                                   "finish_reason": finish_reason}]
                if include_usage:
                    out["usage"] = None
                return out

            def content(event: SeqEvent) -> list[dict[str, Any]]:
                out = []
                if echo and want_logprobs and event.index not in echoed:  # the prompt's come with its first event
                    echoed.add(event.index)
                    out.append(chunk(text=prompt_text, index=event.index, logprobs=prompt_logprobs_of(event)))
                if generate and (event.text or event.logprobs):
                    logprobs = None
                    if want_logprobs:
                        ids = [e.token_id for e in event.logprobs]
                        logprobs = completion_logprobs(ids, event.logprobs, token_text, offsets[event.index])
                        offsets[event.index] += sum(len(t) for t in logprobs["tokens"])
                    out.append(chunk(text=event.text, index=event.index, logprobs=logprobs))
                return out

            # the echoed prompt up front; with log-probabilities it waits for them (the first event)
            head = [chunk(text=prompt_text, index=i) for i in range(params.n)] if echo and not want_logprobs else []
            return StreamingResponse(stream_events(request_id, queue, chunk, include_usage, head, content, params.n,
                                                   count_completion=generate),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        events = await collect(request, request_id, queue, params.n)
        if events is None:
            return Response(status_code=499)
        raise_event_error(events)
        return {
            "id": request_id, "object": "text_completion", "created": now, "model": served,
            "system_fingerprint": fingerprint,
            "choices": [{"index": event.index, "text": prompt_text + (event.full_text if generate else ""),
                         "finish_reason": event.finish_reason if generate else "length",
                         "logprobs": choice_logprobs(event)} for event in events],
            "usage": usage(events, count_completion=generate),
        }

    @app.get("/v1/models", dependencies=auth, response_model=ModelList, responses=ERROR_RESPONSES,
             summary="The served model")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, response_model=ModelCard,
             responses={**ERROR_RESPONSES, 404: {"model": ErrorResponse, "description": "Unknown model id"}},
             summary="One model (404 for an id this server does not serve)")
    async def model(model_id: str) -> Any:
        if model_id not in aliases:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")
        return model_card()

    def model_card() -> dict[str, Any]:
        return ModelCard(id=served, created=created, max_model_len=scheduler.context_length).model_dump()

    @app.post("/tokenize", dependencies=auth, response_model=TokenizeResponse, responses=ERROR_RESPONSES,
              summary="Text to token ids (llama.cpp's shape; with_pieces: each id with its text)")
    async def tokenize(body: TokenizeRequest) -> Any:
        ids = await run_in_threadpool(llm.tokenizer.encode, body.content, body.add_special)
        if not body.with_pieces:
            return {"tokens": ids}
        # a piece is the token decoded alone: a token holding part of a character shows U+FFFD
        return {"tokens": [{"id": i, "piece": llm.tokenizer.decode([i])} for i in ids]}

    @app.post("/detokenize", dependencies=auth, response_model=DetokenizeResponse, responses=ERROR_RESPONSES,
              summary="Token ids to text (llama.cpp's shape)")
    async def detokenize(body: DetokenizeRequest) -> Any:
        bad = [i for i in body.tokens if not 0 <= i < scheduler.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{scheduler.vocab_size - 1})",
                           param="tokens", code="invalid_value")
        return {"content": await run_in_threadpool(llm.tokenizer.decode, body.tokens)}

    @app.get("/version", response_model=VersionInfo, summary="The server's version and build fingerprint")
    async def version() -> Any:
        return {"version": __version__, "system_fingerprint": fingerprint, "model": served,
                "weights_format": str(scheduler.runtime.weights_format)}

    @app.get("/health", response_model=Health,
             summary="200 while the scheduler runs, 503 when stopped or draining for shutdown")
    async def health() -> Any:
        status = "draining" if draining.active else "ok" if scheduler.is_running else "stopped"
        body = {"status": status, "running": scheduler.num_running, "waiting": scheduler.num_waiting}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
