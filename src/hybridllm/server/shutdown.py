"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop taking work, finish what runs, exit 0.

:class:`Draining` is the app's switch: once on, new requests get 503 (with ``Retry-After``) and
an OpenAI error object, and ``/health`` reports ``draining``. :class:`GracefulServer` is
uvicorn's server with that signal handling: the first signal turns draining on and waits (at
most ``grace_s``) until the request loop has nothing queued or running, then lets uvicorn close
the connections and stop; a second signal stops at once. When the grace period runs out with
requests still in the loop, the loop is stopped first, so that each of them is told: a stream
ends with an error event and ``[DONE]``, a JSON request gets 503. uvicorn's own handler re-raises
the signal after shutting down (the process would die of SIGTERM); this one returns, and
:attr:`GracefulServer.unfinished` says how many requests did not finish (``hybridllm serve``
exits 0 when none, else 1).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType
from collections.abc import Callable
from typing import Any

import uvicorn

from hybridllm.server.asgi import send_error
from hybridllm.server.protocol import RETRY_AFTER_S, error_body

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_GRACE_S = 30.0
IDLE_POLL_S = 0.1
CONNECTION_CLOSE_S = 1.0  # at least this long for the last chunks to reach their clients


class Draining:
    """Whether the server refuses new requests because it is shutting down (thread-safe)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def begin(self) -> None:
        self._event.set()

    @property
    def active(self) -> bool:
        return self._event.is_set()


class RefuseWhileDraining:
    """ASGI middleware: while ``draining`` is on, answer new HTTP requests 503 (an OpenAI error
    object), except ``/health`` (it reports ``draining``) and ``/metrics``.

    Args:
        app: the ASGI app behind.
        draining: the switch.
        on_refused: called once per refused request (the server's rejection counter).
    """

    OPEN_PATHS = ("/health", "/metrics")

    def __init__(self, app: Any, draining: Draining, on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.draining = draining
        self.on_refused = on_refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.draining.active or scope.get("path") in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        await send_error(send, 503, error_body("the server is shutting down; send the request to another instance",
                                               type="server_error", code="shutting_down"),
                         headers={"Retry-After": str(RETRY_AFTER_S)})


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT drains the request loop before stopping.

    Args:
        config: uvicorn's configuration.
        draining: the app's switch (``app.state.draining``).
        scheduler: the request loop whose queued and running requests are waited for.
        grace_s: the longest wait for in-flight requests, in seconds.
    """

    def __init__(self, config: uvicorn.Config, draining: Draining, scheduler: Any,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        super().__init__(config)
        self.draining = draining
        self.scheduler = scheduler
        self.grace_s = grace_s
        self.unfinished = 0  # requests cut by the end of the grace period (or a second signal)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining.active or self._loop is None:  # a second signal, or nothing to drain yet
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            self.unfinished = max(self.unfinished, self._in_loop())
            return
        self.draining.begin()
        logger.warning("%s: refusing new requests, finishing %d running and %d queued (at most %.0f s)",
                       signal.Signals(sig).name, self.scheduler.num_running, self.scheduler.num_waiting,
                       self.grace_s)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    def _in_loop(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_paused + self.scheduler.num_waiting

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(IDLE_POLL_S)
        if self.scheduler.has_work():
            self.unfinished = max(self.unfinished, self._in_loop())
            logger.warning("the shutdown grace period ran out; ending the %d requests still in the loop with an error",
                           self.unfinished)
            # every request still in the loop gets its error event now, while its connection is open
            await asyncio.to_thread(self.scheduler.stop)
        # what is left of the grace period bounds uvicorn's wait for responses still being written
        self.config.timeout_graceful_shutdown = max(CONNECTION_CLOSE_S, deadline - time.monotonic())
        self.should_exit = True
