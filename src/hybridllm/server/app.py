"""The OpenAI-compatible HTTP API (FastAPI) in front of a continuous-batching scheduler.

    from hybridllm import LLM
    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.server.app import create_app

    llm = LLM()
    app = create_app(llm, Scheduler(llm.runtime, max_batch=16))   # serve with uvicorn.run(app, ...)

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE streaming),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize``
(llama.cpp's shapes), ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus),
``GET /stats`` (JSON, the page's data), the page at ``/``, and the OpenAPI schema at
``/openapi.json`` (``/docs`` renders it). Errors are OpenAI error objects: every input error a
4xx with a short message, 500 only for a fault (logged once with its traceback:
:mod:`hybridllm.server.internal_errors`), every 503 with ``Retry-After``. When an API key is
set, every ``/v1`` route and the tokenizer routes need ``Authorization: Bearer <key>``. Every
completion and stream chunk carries the ``system_fingerprint`` of the build
(:mod:`hybridllm.server.fingerprint`). Request bodies over ``max_request_bytes`` get 413; OpenAI
fields the server does not implement get 400 (:mod:`hybridllm.server.unsupported`); while the
server drains for shutdown, new requests get 503 (:mod:`hybridllm.server.shutdown`). A client
that disconnects aborts its request at once; one that stops reading its stream pauses it, and is
given up on after ``stream_stall_timeout_s`` (:mod:`hybridllm.server.backpressure`).

This module wires the app: the :class:`~hybridllm.server.context.ServerContext` its routes share
(the engine's read-only :class:`~hybridllm.server.engine_view.EngineView` included), the
middlewares, the error handlers, and the routers of :mod:`hybridllm.server.routes`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridllm import __version__
from hybridllm.engine.scheduler import Scheduler
from hybridllm.loading.local_models import model_name as checkpoint_model_name
from hybridllm.server.backpressure import DEFAULT_STREAM_STALL_TIMEOUT_S
from hybridllm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from hybridllm.server.context import ServerContext
from hybridllm.server.engine_view import EngineView
from hybridllm.server.fingerprint import system_fingerprint
from hybridllm.server.internal_errors import InternalErrors
from hybridllm.server.metrics import ServerMetrics
from hybridllm.server.protocol import INVALID_UNICODE, APIError, error_body
from hybridllm.server.routes import ROUTERS
from hybridllm.server.shutdown import Draining, RefuseWhileDraining
from hybridllm.server.stats import ServerStats


def default_model_name(llm: Any) -> str:
    """The served model id: the model's one name (:func:`~hybridllm.loading.local_models.model_name`,
    ``SmolLM2-135M-Instruct.Q4_1``), as ``hybridllm models`` and chat show it."""
    path = getattr(getattr(llm, "checkpoint", None), "path", None)
    if path is not None:
        return checkpoint_model_name(path)
    return llm.config.name or "hybridllm"


def model_aliases(llm: Any, served: str) -> frozenset[str]:
    """Every name a request may give the model: the served id, the checkpoint's names, the config's."""
    aliases = {served, default_model_name(llm)}
    if llm.config.name:
        aliases.add(llm.config.name)
    path = getattr(getattr(llm, "checkpoint", None), "path", None)
    if path is not None:
        aliases.add(Path(path).name)
    return frozenset(aliases)


def create_app(
    llm: Any,
    scheduler: Scheduler | None = None,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    manage_scheduler: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
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
        stream_stall_timeout_s: how long a stream whose client reads nothing stays paused before
            it is closed and its request aborted.

    The app's state holds ``context`` (the :class:`ServerContext` every route reads) and, for
    the callers outside, ``scheduler``, ``metrics``, ``stats``, ``model_name`` and ``draining``
    (the switch a :class:`~hybridllm.server.shutdown.GracefulServer` turns on at SIGTERM).
    """
    scheduler = scheduler if scheduler is not None else llm.engine.scheduler
    served = model_name or default_model_name(llm)
    view = EngineView(scheduler)
    metrics = ServerMetrics(view, served)
    scheduler.observer = metrics
    context = ServerContext(llm=llm, scheduler=scheduler, view=view, metrics=metrics,
                            stats=ServerStats(view, metrics, served), model_name=served,
                            aliases=model_aliases(llm, served), api_key=api_key,
                            fingerprint=system_fingerprint(scheduler.runtime), created=int(time.time()),
                            draining=Draining(), stream_stall_timeout_s=stream_stall_timeout_s)

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
    app.state.context = context
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.stats = context.stats
    app.state.model_name = served
    app.state.draining = context.draining
    app.add_middleware(InternalErrors)  # innermost: just outside the routes' exception handlers
    app.add_middleware(RefuseWhileDraining, draining=context.draining,
                       on_refused=lambda: metrics.on_rejected("shutting_down"))
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       on_refused=lambda: metrics.on_rejected("request_too_large"))
    add_error_handlers(app, metrics)
    for router in ROUTERS:
        app.include_router(router)
    return app


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error as an OpenAI error object; refusals counted in ``request_rejected_total``.
    Faults are :class:`~hybridllm.server.internal_errors.InternalErrors`' (not a handler here:
    Starlette re-raises what its 500 handler answered, so uvicorn would log it twice)."""

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
        return JSONResponse(validation_error_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    """FastAPI's validation errors as one OpenAI error object naming the first field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == INVALID_UNICODE:
        message, param = first.get("msg", "invalid Unicode text"), first.get("ctx", {}).get("path")
    elif first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        param = None
    elif first.get("type") == "missing":
        message = f"missing required parameter: {param or 'body'}"
    else:
        message = f"invalid value for {param or 'the body'}: {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_body(message, param=param, code="invalid_value")
