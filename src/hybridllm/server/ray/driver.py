"""Start or join a Ray cluster and run the application on it (what ``hybridllm serve --ray`` does)."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

import ray
from ray import serve
from ray.serve import Application

from hybridllm.errors import HybridLLMError

APP_NAME = "hybridllm"


class RayServeError(HybridLLMError):
    """The cluster cannot be reached or the application not deployed on it (one line: Ray's reason)."""


def serve_running() -> bool:
    """Whether Ray Serve already runs on the connected cluster (its controller is there)."""
    from ray.serve.context import _get_global_client  # Serve's own lookup of its controller

    try:
        return _get_global_client(raise_if_no_controller_running=False) is not None
    except Exception:  # an unreachable controller: treat Serve as not ours to keep
        return False


def last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@contextlib.contextmanager
def ray_serve(app: Application, *, address: str | None, host: str, port: int) -> Iterator[None]:
    """Run ``app`` on a Ray cluster, answering HTTP on ``host:port``, until the block ends.

    Args:
        app: the application (:func:`hybridllm.server.ray.build_app`).
        address: the cluster to join (``auto``: the one ``ray start`` runs on this machine,
            ``HOST:6379``: a head node); None starts a local one-machine cluster (no dashboard),
            stopped at the end. On a cluster where Ray Serve was not running yet, Serve is shut
            down at the end (its HTTP proxies release the port); where it was (other
            applications), only this application is removed.
        host: the address Ray Serve's HTTP proxy binds.
        port: its port.

    Raises:
        RayServeError: the cluster cannot be reached, a replica could not be built (bad model
            path ...), or the cluster refused the application.
    """
    local = address is None
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # "local": a new cluster of our own, never one that `ray start` left running on this machine
        ray.init(address=address or "local", logging_level=logging.WARNING,
                 **({"include_dashboard": False} if local else {}))
    except ConnectionError as exc:
        raise RayServeError(f"--ray-address {address}: {last_line(exc)} (start one with `ray start --head`)") from None
    for sig, handler in handlers.items():  # ray.init's SIGTERM handler would exit without stopping Serve
        signal.signal(sig, handler)
    serve_was_running = not local and serve_running()
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # Ray Serve's report of a failed deployment
            raise RayServeError(f"the Ray Serve application did not start: {last_line(exc)}") from None
        yield
    finally:
        if serve_was_running:  # a shared cluster keeps Serve (and its proxies' port) for its other applications
            serve.delete(APP_NAME)
        else:  # Serve was ours: its proxies go with it, and so does the port
            serve.shutdown()
        ray.shutdown()
