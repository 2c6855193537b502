"""The page at ``/`` (chat, and where the engine's memory lives) and ``GET /stats``, its data.

Both are open like ``/metrics``: the page asks for the API key itself when ``/v1`` needs one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from hybridllm.server.context import ServerContext, server_context
from hybridllm.server.page_assets import page_response
from hybridllm.server.stats import Stats

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return page_response("/")


@router.get("/page/app.js", include_in_schema=False)
async def page_script() -> Response:
    return page_response("/page/app.js")


@router.get("/page/style.css", include_in_schema=False)
async def page_style() -> Response:
    return page_response("/page/style.css")


@router.get("/stats", response_model=Stats, summary="The engine's state as JSON (the page's live view)")
async def stats(since: float | None = Query(None, description="Only history samples after this Unix time."),
                ctx: ServerContext = Depends(server_context)) -> Any:
    return ctx.stats.snapshot(since)
