"""``POST /v1/chat/completions``: chat messages through the chat template, JSON or SSE, with tools."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from hybridllm.config import StructuredOutput
from hybridllm.engine.logprobs import TokenLogprob
from hybridllm.engine.scheduler import SeqEvent
from hybridllm.errors import HybridLLMError
from hybridllm.server.context import ServerContext, require_api_key, server_context
from hybridllm.server.logprobs import chat_logprobs
from hybridllm.server.protocol import (
    ERROR_RESPONSES,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    NamedToolChoice,
    structured_output,
)
from hybridllm.server.request_params import check_prompt_size, sampling_params
from hybridllm.server.streams import (
    ChunkFrame,
    collect,
    event_stream,
    raise_event_error,
    stream_events,
    stream_whole,
    submit,
    usage,
)
from hybridllm.server.tools import forced_call_schema, parse_tool_calls, render_with_tools
from hybridllm.server.unsupported import log_ignored_fields, refuse_unsupported

router = APIRouter(dependencies=[Depends(require_api_key)])


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


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES,
             summary="Chat completion (JSON, or SSE when stream=true)")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           ctx: ServerContext = Depends(server_context)) -> Any:
    ctx.check_model(body.model)
    refuse_unsupported(body.model_extra)
    log_ignored_fields(body, "POST /v1/chat/completions")
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
    llm = ctx.llm
    check_prompt_size(ctx.scheduler, llm.tokenizer.max_token_bytes,
                      sum(len(m["content"].encode()) for m in messages), "messages")
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
    params = sampling_params(ctx.scheduler, body, max_tokens, None, len(prompt_ids),
                             logprobs=(body.top_logprobs or 0) if want_logprobs else None, structured=structured)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    now = int(time.time())
    grammar_param = "tools" if forced else "response_format"
    events = await submit(ctx, request_id, prompt_ids, params, grammar_param)
    single_call = body.parallel_tool_calls is False

    def logprobs_of(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return chat_logprobs(entries or [], ctx.token_text) if want_logprobs else None

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        frame = ChunkFrame(request_id, "chat.completion.chunk", now, ctx.model_name, ctx.fingerprint, include_usage,
                           blank=("delta", {}))
        role = {"role": "assistant", "content": ""}
        if tools:  # whole: a reply is known to be tool calls only when it ends
            def reply(event: SeqEvent) -> tuple[dict[str, Any], str | None]:
                message, reason = chat_reply(event.full_text, event.finish_reason, tool_names, single_call)
                if "tool_calls" not in message:
                    return {"content": message["content"]}, reason
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                return {"tool_calls": calls}, reason

            return event_stream(ctx, events, stream_whole(ctx, request_id, events, frame, frame.choice(0, role), reply,
                                                          grammar_param))

        def content(event: SeqEvent) -> list[dict[str, Any]]:
            if not (event.text or event.logprobs):
                return []
            return [frame.choice(event.index, {"content": event.text}, logprobs_of(event.logprobs))]

        head = [frame.choice(index, role) for index in range(params.n)]
        return event_stream(ctx, events, stream_events(ctx, request_id, events, frame, head, content, params.n,
                                                       grammar_param=grammar_param))
    finals = await collect(ctx, request, request_id, events, params.n)
    if finals is None:
        return Response(status_code=499)
    raise_event_error(finals, grammar_param)
    choices = []
    for event in finals:
        message, finish_reason = chat_reply(event.full_text, event.finish_reason, tool_names, single_call)
        choices.append({"index": event.index, "message": message, "finish_reason": finish_reason,
                        "logprobs": logprobs_of(event.all_logprobs)})
    return {
        "id": request_id, "object": "chat.completion", "created": now, "model": ctx.model_name,
        "system_fingerprint": ctx.fingerprint,
        "choices": choices,
        "usage": usage(finals),
    }
