"""What the ingress knows of each engine replica's health, kept by probing it in the background.

A replica is ``unknown`` until its first probe, ``ok`` while it answers, ``down`` after a Ray
error (its process ended: Ray Serve replaces it) and ``unreachable`` after a probe that timed out
(a process that hangs, a node that went away without Ray noticing yet). Only ``ok`` replicas are
routed to. When a replica stops being ``ok``, every request in flight on it is told at once
(:meth:`ReplicaLiveness.lost`), so none waits on a replica that will not answer; it is ``ok``
again at its next answered probe. Reading the state never waits for a replica, so ``/health``
answers at once whatever the replicas do.

Plain Python and asyncio (no Ray): the ingress feeds it what its probes and calls see.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)

UNKNOWN, OK, DOWN, UNREACHABLE = "unknown", "ok", "down", "unreachable"


class ReplicaLiveness:
    """The status of each replica, and an event per replica that fires when it is lost.

    Args:
        replicas: the replica ids.
    """

    def __init__(self, replicas: list[str]) -> None:
        self.status: dict[str, str] = dict.fromkeys(replicas, UNKNOWN)
        self._lost = {replica: asyncio.Event() for replica in replicas}
        self.probed = asyncio.Event()  # set once every replica has had a first probe

    @property
    def live(self) -> list[str]:
        """The replicas to route to (``ok``), in id order."""
        return [replica for replica, status in self.status.items() if status == OK]

    def lost(self, replica: str) -> asyncio.Event:
        """The event a request in flight on ``replica`` waits on beside its answer: set when the
        replica stops being ``ok`` (a request starting later gets the next one)."""
        return self._lost[replica]

    def answered(self, replica: str, pid: object = None) -> None:
        """The replica answered a probe: ``ok``."""
        if self.status[replica] == OK:
            return
        if self.status[replica] != UNKNOWN:
            logger.warning("engine replica %s is back (pid %s)", replica, pid)
        self.status[replica] = OK
        self._lost[replica] = asyncio.Event()

    def lose(self, replica: str, status: str, reason: str) -> None:
        """The replica failed (``down``) or did not answer in time (``unreachable``): out of
        routing, and its requests in flight are told."""
        if self.status[replica] != status:
            logger.warning("engine replica %s is %s: %s", replica, status, reason)
        self.status[replica] = status
        self._lost[replica].set()
