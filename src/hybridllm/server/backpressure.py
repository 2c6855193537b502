"""A request's events on their way to its client, bounded: backpressure and departed clients.

The request loop hands each event of a request to :meth:`RequestEvents.sink` on its own thread;
the HTTP side takes them with :meth:`RequestEvents.get`. At most ``capacity`` events wait in
between: when a client stops reading its stream, the response's writes block, the events pile
up, and at ``capacity`` the request is paused in the loop (:meth:`Scheduler.pause
<hybridllm.engine.scheduler.Scheduler.pause>`: no more tokens decoded for it, its batch slot
given to others, its KV kept) until the client has read half of them. A client that reads nothing
for ``stall_timeout_s`` seconds while paused is given up on: :class:`EventStreamResponse` closes
its connection, which aborts the request (its KV freed at the next step) and counts it
(``hybridllm:stream_stalls_total``).

:func:`wait_disconnected` returns when the client's connection closes, so a request that answers
with one JSON body (it sends nothing while it runs) is aborted at once too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from functools import partial
from typing import Any

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridllm.engine.scheduler import SeqEvent

logger = logging.getLogger(__name__)

STREAM_BUFFER_EVENTS = 64  # events of one request waiting for its client before the request pauses
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0


class RequestEvents:
    """The events of one request between the loop thread and its HTTP response, at most about
    ``capacity`` of them held.

    Args:
        scheduler: the request loop (paused and resumed through it).
        request_id: the request.
        capacity: events held before the request is paused (it resumes at half).
        stall_timeout_s: how long a paused request may wait for its client to read anything.
        on_pause: called (on the loop thread) each time the request is paused.
    """

    def __init__(self, scheduler: Any, request_id: str, capacity: int = STREAM_BUFFER_EVENTS,
                 stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
                 on_pause: Callable[[], None] | None = None) -> None:
        self.scheduler = scheduler
        self.request_id = request_id
        self.capacity = max(2, capacity)
        self.stall_timeout_s = stall_timeout_s
        self.on_pause = on_pause
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
        # _held and _paused are shared by both threads; the loop is paused and resumed under this
        # lock, so that its calls come in the order of the decisions (the loop never calls a sink
        # while holding its own lock, so the order of the two locks is always this one, then the loop's)
        self._lock = threading.Lock()
        self._held = 0  # handed over by the loop thread, not taken yet
        self._paused = False
        self._changed = asyncio.Event()  # set at a pause and at each event taken while paused (wakes the stall watch)
        self._last_taken = time.monotonic()

    @property
    def paused(self) -> bool:
        """Whether the request is paused because its client does not read."""
        with self._lock:
            return self._paused

    @property
    def held(self) -> int:
        """Events waiting for the client."""
        with self._lock:
            return self._held

    def sink(self, event: SeqEvent) -> None:
        """Take an event from the request loop (its thread): queue it, pausing the request when full."""
        with self._lock:
            self._held += 1
            pause = not self._paused and self._held >= self.capacity and not event.finished
            if pause:
                self._paused = True
                self._last_taken = time.monotonic()  # the stall is counted from here
                self.scheduler.pause(self.request_id)
        if pause:
            if self.on_pause is not None:
                self.on_pause()
            self._loop.call_soon_threadsafe(self._changed.set)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self) -> SeqEvent:
        """The next event; resumes the request once half of the buffer has been read."""
        event = await self._queue.get()
        with self._lock:
            self._held -= 1
            was_paused = self._paused
            if self._paused and self._held <= self.capacity // 2:
                self._paused = False
                self.scheduler.resume(self.request_id)
            self._last_taken = time.monotonic()
        if was_paused:  # the stall watch restarts its clock, or goes back to waiting for a pause
            self._changed.set()  # (not at every event: a wake-up of the watch per token, for nothing)
        return event

    async def stalled(self) -> None:
        """Return once the request has been paused with nothing read for ``stall_timeout_s``."""
        while True:
            self._changed.clear()  # before reading the state: a change after it wakes the wait
            with self._lock:
                paused, last_taken = self._paused, self._last_taken
            if not paused:
                await self._changed.wait()
                continue
            left = last_taken + self.stall_timeout_s - time.monotonic()
            if left <= 0:
                return
            with suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


async def wait_disconnected(request: Request) -> None:
    """Return when the client has closed its connection (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """An SSE response that ends when its body does, when the client disconnects, or when the
    client has read nothing for the stall timeout (then ``on_stall`` is called and the connection
    closed); in the last two cases the body iterator is closed at once (its ``finally`` aborts
    the request).

    Args:
        content: the SSE lines.
        events: the request's event buffer (its stall watch).
        on_stall: called once when the client is given up on.
    """

    def __init__(self, content: AsyncIterator[str], events: RequestEvents, on_stall: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.events = events
        self.on_stall = on_stall
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def until(func: Callable[[], Any]) -> None:
                    await func()
                    group.cancel_scope.cancel()

                group.start_soon(until, partial(self.stream_response, send))
                group.start_soon(until, partial(self.listen_for_disconnect, receive))
                group.start_soon(until, self._stall)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def _stall(self) -> None:
        await self.events.stalled()
        logger.warning("%s: the client read nothing for %.0f s with %d events waiting; closing its stream",
                       self.events.request_id, self.events.stall_timeout_s, self.events.held)
        self.on_stall()
