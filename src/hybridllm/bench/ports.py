"""Free loopback ports for the servers a benchmark, a tool or a test starts."""

from __future__ import annotations

import contextlib
import socket


def distinct_free_ports(n: int) -> list[int]:
    """``n`` free loopback ports, all different: each socket stays bound until all are chosen
    (ports chosen one at a time may repeat, and Ray refuses a node whose components share one)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    """One free loopback port."""
    return distinct_free_ports(1)[0]
