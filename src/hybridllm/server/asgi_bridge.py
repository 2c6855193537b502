"""Answer an HTTP request with an ASGI app in this process, as a stream of picklable parts.

An engine replica (:mod:`hybridllm.server.ray`) holds the same FastAPI app that ``hybridllm serve``
runs (:func:`hybridllm.server.app.create_app`); the ingress forwards it each request as a
:class:`ForwardedRequest` and relays what :func:`call_asgi` yields: one :class:`ResponseStart`
(status and headers), then the body's bytes as the app sends them (SSE events one by one). So
both front ends share every route, error object and metric of the app.

Closing the stream early (the client went away, the call was cancelled) tells the app the client
disconnected and cancels it, which aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

EVENT_STREAM = b"text/event-stream"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as data: what the ingress received, for the replica's app."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]  # lower-case names, as ASGI gives them
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    """The status line and headers of the app's response."""

    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def is_event_stream(self) -> bool:
        """Whether the body is SSE (relayed as it comes; other bodies are read whole)."""
        return any(name == b"content-type" and value.startswith(EVENT_STREAM) for name, value in self.headers)


def http_scope(request: ForwardedRequest) -> dict[str, Any]:
    """The ASGI scope of ``request`` (HTTP/1.1, no client address: it came through the ingress)."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query_string, "headers": list(request.headers),
        "client": None, "server": None, "state": {},
    }


async def call_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request``: yields its :class:`ResponseStart`, then each non-empty body part.

    Args:
        app: an ASGI application (a FastAPI app).
        request: the request.

    Raises:
        Exception: what the app raised before it finished its response.
    """
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()  # blocks until the stream is closed early
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(http_scope(request), receive, send))
    task.add_done_callback(lambda _task: messages.put_nowait(None))  # None: the app returned
    complete = False
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()  # the app's exception, if it ended without a response
                raise RuntimeError("the app returned without finishing its response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    return
    finally:
        if not complete:
            disconnected.set()
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await task
            except Exception:  # the app logged it, and answered when it could (its 500 handler)
                logger.debug("the app raised after its response", exc_info=True)
