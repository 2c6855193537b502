"""A cap on request body size: a bigger body is answered 413 with an OpenAI error object.

Pure ASGI middleware: it reads the body before the app does (FastAPI buffers it anyway) and
replays it; later ``receive`` calls (disconnect checks) go to the client as usual. Past the cap
it stops keeping the bytes but still reads them to the end (a client that is still uploading
would otherwise see a reset connection instead of the 413).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridllm.server.asgi import send_error
from hybridllm.server.protocol import error_body
from hybridllm.units import format_bytes

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    """Refuse HTTP request bodies over ``max_bytes`` with 413.

    Args:
        app: the ASGI app behind.
        max_bytes: the largest body accepted.
        on_refused: called once per refused request (the server's rejection counter).
    """

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_bytes:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if size > self.max_bytes:
            await self._refuse(send)
            return
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send: Any) -> None:
        if self.on_refused is not None:
            self.on_refused()
        await send_error(send, 413, error_body(
            f"the request body is larger than this server accepts ({format_bytes(self.max_bytes)}); "
            f"send less, or start the server with a larger --max-request-bytes", code="request_too_large"))


def _replay(messages: list[Message], receive: Any) -> Any:
    """A ``receive`` that returns ``messages`` first, then asks the client."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
