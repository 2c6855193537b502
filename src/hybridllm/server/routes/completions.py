"""``POST /v1/completions``: a text (or token-id) prompt as it is, JSON or SSE, with echo and the
legacy log-probabilities."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from hybridllm.engine.scheduler import SeqEvent
from hybridllm.errors import HybridLLMError
from hybridllm.server.context import ServerContext, require_api_key, server_context
from hybridllm.server.logprobs import completion_logprobs, join_completion_logprobs
from hybridllm.server.protocol import (
    ERROR_RESPONSES,
    APIError,
    CompletionRequest,
    CompletionResponse,
    structured_output,
)
from hybridllm.server.request_params import DEFAULT_COMPLETION_MAX_TOKENS, check_prompt_size, sampling_params
from hybridllm.server.streams import (
    ChunkFrame,
    collect,
    event_stream,
    raise_event_error,
    stream_events,
    submit,
    usage,
)
from hybridllm.server.unsupported import log_ignored_fields, refuse_unsupported

router = APIRouter(dependencies=[Depends(require_api_key)])


async def prompt_token_ids(ctx: ServerContext, body: CompletionRequest) -> tuple[Any, list[int]]:
    """The request's one prompt (text or token ids) and its token ids."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        check_prompt_size(ctx.scheduler, ctx.llm.tokenizer.max_token_bytes, len(prompt.encode()), "prompt")
        return prompt, await run_in_threadpool(ctx.llm.tokenizer.encode, prompt, True)
    prompt_ids = list(prompt)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    try:
        ctx.scheduler.check_prompt(prompt_ids)
    except HybridLLMError as exc:
        raise APIError(400, str(exc), param="prompt") from None
    return prompt, prompt_ids


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES,
             summary="Text completion (JSON, or SSE when stream=true)")
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(server_context)) -> Any:
    ctx.check_model(body.model)
    refuse_unsupported(body.model_extra)
    log_ignored_fields(body, "POST /v1/completions")
    prompt, prompt_ids = await prompt_token_ids(ctx, body)
    token_text = ctx.token_text
    echo, want_logprobs = bool(body.echo), body.logprobs is not None
    prompt_text = ""
    if echo:  # the prompt as given; token ids as their text (special tokens spelled out)
        prompt_text = prompt if isinstance(prompt, str) else await run_in_threadpool(ctx.llm.tokenizer.decode,
                                                                                    prompt_ids)
    # max_tokens 0 (the prompt's log-probabilities alone): the engine samples one token, never sent
    generate = body.max_tokens != 0
    params = sampling_params(ctx.scheduler, body, body.max_tokens if generate else 1, DEFAULT_COMPLETION_MAX_TOKENS,
                             len(prompt_ids), logprobs=body.logprobs,
                             prompt_logprobs=body.logprobs if echo and want_logprobs else None,
                             structured=structured_output(body.response_format))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    now = int(time.time())
    events = await submit(ctx, request_id, prompt_ids, params)
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
        frame = ChunkFrame(request_id, "text_completion", now, ctx.model_name, ctx.fingerprint, include_usage,
                           blank=("text", ""))
        offsets = [completion_start] * params.n  # text_offset of each choice's next token
        echoed: set[int] = set()

        def content(event: SeqEvent) -> list[dict[str, Any]]:
            out = []
            if echo and want_logprobs and event.index not in echoed:  # the prompt's come with its first event
                echoed.add(event.index)
                out.append(frame.choice(event.index, prompt_text, prompt_logprobs_of(event)))
            if generate and (event.text or event.logprobs):
                logprobs = None
                if want_logprobs:
                    ids = [e.token_id for e in event.logprobs]
                    logprobs = completion_logprobs(ids, event.logprobs, token_text, offsets[event.index])
                    offsets[event.index] += sum(len(t) for t in logprobs["tokens"])
                out.append(frame.choice(event.index, event.text, logprobs))
            return out

        # the echoed prompt up front; with log-probabilities it waits for them (the first event)
        head = [frame.choice(i, prompt_text) for i in range(params.n)] if echo and not want_logprobs else []
        return event_stream(ctx, events, stream_events(ctx, request_id, events, frame, head, content, params.n,
                                                       count_completion=generate))
    finals = await collect(ctx, request, request_id, events, params.n)
    if finals is None:
        return Response(status_code=499)
    raise_event_error(finals)
    return {
        "id": request_id, "object": "text_completion", "created": now, "model": ctx.model_name,
        "system_fingerprint": ctx.fingerprint,
        "choices": [{"index": event.index, "text": prompt_text + (event.full_text if generate else ""),
                     "finish_reason": event.finish_reason if generate else "length",
                     "logprobs": choice_logprobs(event)} for event in finals],
        "usage": usage(finals, count_completion=generate),
    }
