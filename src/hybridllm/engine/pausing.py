"""Requests paused by their consumer: out of the batch, their KV kept.

A server pauses a request whose client stops reading its stream (its send buffer is full), so
that the loop does not decode tokens nobody takes, and resumes it once the client has read
enough. While paused, a request's sequences run no forward and leave their batch slots to others
(admission counts only the sequences in the batch), but keep their KV cache and its reservation,
so that resuming costs nothing. A resumed request rejoins the batch as soon as it has room for
all of its sequences, before any waiting request is admitted.

This is the one place the request loop's flow control lives: the loop calls :meth:`settle` at the
start of a step and runs only :meth:`in_batch` of its sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Sequence(Protocol):
    request_id: str


S = TypeVar("S", bound=_Sequence)


class PausedRequests:
    """The ids of paused requests and of those asked to resume (not thread-safe: the loop guards it)."""

    def __init__(self) -> None:
        self._paused: set[str] = set()
        self._resuming: dict[str, None] = {}  # in the order resumes were asked

    def pause(self, request_id: str) -> None:
        """Take the request out of the batch from the next step on."""
        self._paused.add(request_id)
        self._resuming.pop(request_id, None)

    def resume(self, request_id: str) -> None:
        """Let a paused request rejoin the batch (when it has room; nothing if it is not paused)."""
        if request_id in self._paused:
            self._resuming[request_id] = None

    def settle(self, running: Sequence[_Sequence], max_batch: int) -> None:
        """Forget requests that are no longer running; let resumed ones rejoin while the batch
        has room for all of their sequences (first asked, first back)."""
        ids = {seq.request_id for seq in running}
        self._paused &= ids
        for request_id in [r for r in self._resuming if r not in self._paused]:
            del self._resuming[request_id]
        in_batch = sum(seq.request_id not in self._paused for seq in running)
        for request_id in list(self._resuming):
            size = sum(seq.request_id == request_id for seq in running)
            if in_batch + size > max_batch:
                break
            self._paused.discard(request_id)
            del self._resuming[request_id]
            in_batch += size

    def in_batch(self, running: Sequence[S]) -> list[S]:
        """The running sequences that are not paused."""
        return [seq for seq in running if seq.request_id not in self._paused]

    def count(self, running: Sequence[_Sequence]) -> int:
        """Running sequences that are paused."""
        return sum(seq.request_id in self._paused for seq in running)
