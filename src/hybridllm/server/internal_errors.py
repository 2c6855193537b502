"""The one place a fault becomes a 500: logged once with its traceback, answered with a short
OpenAI error object, the connection kept.

Starlette's own handler of unexpected exceptions answers 500 and then re-raises, so uvicorn logs
the traceback a second time and drops the keep-alive connection. :class:`InternalErrors` sits
inside it and answers every exception that no handler turned into a response: input errors never
get here (they are 4xx :class:`~hybridllm.server.protocol.APIError` or validation errors).
"""

from __future__ import annotations

import logging
from typing import Any

from hybridllm.server.asgi import send_error
from hybridllm.server.protocol import error_body

logger = logging.getLogger(__name__)


def internal_error_message(exc: BaseException) -> str:
    """What a client hears of a fault: its kind, not the library's internals (the log has them)."""
    return f"internal error ({type(exc).__name__}); the server logged the details"


class InternalErrors:
    """ASGI middleware: an unhandled exception is logged once (with its traceback) and answered
    500 with an OpenAI error object when the response has not started; a response already under
    way is left to end (its connection closes).

    Args:
        app: the ASGI app behind.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("%s %s: internal error", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, 500, error_body(internal_error_message(exc), type="server_error"),
                                 close=False)
