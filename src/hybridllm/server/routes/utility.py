"""The routes beside the OpenAI API: llama.cpp's ``/tokenize`` and ``/detokenize`` (behind the API
key), ``/version``, ``/health`` and ``/metrics`` (open)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from hybridllm import __version__
from hybridllm.server.context import ServerContext, require_api_key, server_context
from hybridllm.server.metrics import CONTENT_TYPE
from hybridllm.server.protocol import (
    ERROR_RESPONSES,
    RETRY_AFTER_S,
    APIError,
    DetokenizeRequest,
    DetokenizeResponse,
    Health,
    TokenizeRequest,
    TokenizeResponse,
    VersionInfo,
)
from hybridllm.server.unsupported import log_ignored_fields

tokenizer_router = APIRouter(dependencies=[Depends(require_api_key)])
router = APIRouter()


@tokenizer_router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES,
                       summary="Text to token ids (llama.cpp's shape; with_pieces: each id with its text)")
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(server_context)) -> Any:
    log_ignored_fields(body, "POST /tokenize")
    tokenizer = ctx.llm.tokenizer
    ids = await run_in_threadpool(tokenizer.encode, body.content, body.add_special)
    if not body.with_pieces:
        return {"tokens": ids}
    # a piece is the token decoded alone: a token holding part of a character shows U+FFFD
    return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}


@tokenizer_router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES,
                       summary="Token ids to text (llama.cpp's shape)")
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(server_context)) -> Any:
    log_ignored_fields(body, "POST /detokenize")
    vocab_size = ctx.scheduler.vocab_size
    bad = [i for i in body.tokens if not 0 <= i < vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                       param="tokens", code="invalid_value")
    return {"content": await run_in_threadpool(ctx.llm.tokenizer.decode, body.tokens)}


@router.get("/version", response_model=VersionInfo, summary="The server's version and build fingerprint")
async def version(ctx: ServerContext = Depends(server_context)) -> Any:
    return {"version": __version__, "system_fingerprint": ctx.fingerprint, "model": ctx.model_name,
            "weights_format": ctx.view.placement.weights_format}


@router.head("/health", response_model=Health, operation_id="health_head",
             summary="/health's status without its body (load balancers probe with HEAD)")
@router.get("/health", response_model=Health,
            summary="200 while the scheduler runs, 503 (with Retry-After) when stopped or draining for shutdown")
async def health(ctx: ServerContext = Depends(server_context)) -> Any:
    status = "draining" if ctx.draining.active else "ok" if ctx.view.is_running else "stopped"
    running, waiting = ctx.view.requests()
    body = {"status": status, "running": running, "waiting": waiting}
    if status == "ok":
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def prometheus_metrics(ctx: ServerContext = Depends(server_context)) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
