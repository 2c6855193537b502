"""One engine replica: its own ``LLM``, request loop and the app of ``hybridllm serve``.

The class is plain Python (no Ray import): :func:`hybridllm.server.ray.build_app` makes it a Ray
Serve deployment, one per replica. The ingress forwards each HTTP request to
:meth:`EngineReplica.handle_http`, which runs it through the replica's
:func:`~hybridllm.server.app.create_app` app (:mod:`hybridllm.server.asgi_bridge`), so routes,
streaming, error objects and metrics are the single server's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psutil

from hybridllm.engine.scheduler import Scheduler
from hybridllm.llm import LLM
from hybridllm.server.app import create_app
from hybridllm.server.asgi_bridge import ForwardedRequest, ResponseStart, call_asgi
from hybridllm.server.backpressure import DEFAULT_STREAM_STALL_TIMEOUT_S
from hybridllm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class ServerOptions:
    """What each replica's server is built with: ``hybridllm serve``'s server flags.

    Args:
        max_batch: most requests running at once in a replica.
        max_queue: most requests waiting in a replica (more: 503 with Retry-After).
        host_budget: host RAM a replica's KV may use, in bytes (None: the RAM available when it
            starts; replicas sharing a machine should each be given their share).
        served_model_name: the model id in the API (None: the checkpoint's name).
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
        max_request_bytes: the largest request body accepted (bigger: 413).
        stream_stall_timeout_s: how long a stream whose client reads nothing stays paused.
    """

    max_batch: int = 16
    max_queue: int = 256
    host_budget: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S


class EngineReplica:
    """An engine and its HTTP app, answering the ingress's forwarded requests.

    Args:
        replica_id: the replica's name in the ingress's routing and metrics ("0", "1", ...).
        llm_options: ``LLM`` keyword arguments (:func:`hybridllm.cli.options.llm_kwargs`).
        server: the server's options.
    """

    def __init__(self, replica_id: str, llm_options: dict[str, Any], server: ServerOptions) -> None:
        self.replica_id = replica_id
        llm = LLM(**llm_options)
        host_budget = server.host_budget if server.host_budget is not None else psutil.virtual_memory().available
        self.scheduler = Scheduler(llm.runtime, max_batch=server.max_batch, max_queue=server.max_queue,
                                   host_budget=host_budget, prefix_cache=llm.prefix_cache)
        self.app = create_app(llm, self.scheduler, model_name=server.served_model_name, api_key=server.api_key,
                              manage_scheduler=False, max_request_bytes=server.max_request_bytes,
                              stream_stall_timeout_s=server.stream_stall_timeout_s)
        self.scheduler.start()

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Answer ``request`` with the app: its :class:`ResponseStart`, then its body's parts."""
        async for part in call_asgi(self.app, request):
            yield part

    def metrics_text(self) -> str:
        """The replica's ``/metrics`` exposition (without the ``replica`` label)."""
        return self.app.state.metrics.render().decode()

    def stats(self, since: float | None = None) -> dict[str, Any]:
        """The replica's ``/stats`` body (history after ``since`` only)."""
        return self.app.state.stats.snapshot(since)

    def describe(self) -> dict[str, Any]:
        """Who answers: the replica id, its process and machine, and its request loop's load."""
        return {"replica": self.replica_id, "pid": os.getpid(), "hostname": socket.gethostname(),
                "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting}

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the request loop has stopped (Ray replaces the replica)."""
        if not self.scheduler.is_running:
            raise RuntimeError(f"replica {self.replica_id}: the request loop has stopped")

    def __del__(self) -> None:  # Ray Serve's shutdown hook of a replica
        scheduler = getattr(self, "scheduler", None)  # absent when the constructor failed
        if scheduler is not None:
            scheduler.stop()
