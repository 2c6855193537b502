"""``hybridllm serve --ray``: the server's engine replicas on a Ray Serve cluster.

Ray is imported only here, inside the command, and only when ``--ray`` is given: without the
``ray`` extra, ``--ray`` fails with one line saying how to install it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import typer

from hybridllm.errors import ConfigError

INSTALL_HINT = "pip install 'hybridllm[ray]'"


def stop_on_signals() -> threading.Event:
    """Handle SIGTERM and SIGINT from now on: the first sets the returned event (the server stops
    once it is up), a second raises KeyboardInterrupt (stop at once, even while starting)."""
    stop = threading.Event()

    def handle(_sig: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return stop


def run_ray_server(llm_options: dict[str, Any], *, address: str | None, replicas: int, host: str, port: int,
                   api_key: str | None, max_batch: int, max_queue: int, host_budget: int | None,
                   served_model_name: str | None, max_request_bytes: int, shutdown_grace: float,
                   stream_stall_timeout: float) -> None:
    """Serve ``replicas`` engines on Ray behind one OpenAI-compatible ingress until SIGTERM/SIGINT.

    Args:
        llm_options: ``LLM`` keyword arguments each replica builds its engine with.
        address: the Ray cluster to join (None: start a local one on the loopback interface).
        replicas: engine replicas; each reserves ``threads`` CPUs (1 when unset) and a GPU on CUDA.
        host_budget: host RAM each replica's KV may use, in bytes (None: the RAM available when
            the replica starts).

    Raises:
        ConfigError: Ray Serve is not installed.
        ModelLoadError: with a local cluster, the model cannot be found or opened.
    """
    try:
        from hybridllm.server.ray import ServerOptions, build_app, ray_serve
    except ModuleNotFoundError as exc:
        raise ConfigError(f"--ray needs Ray Serve ({exc.name} is not installed): {INSTALL_HINT}") from None

    if address is None:  # the replicas run here: a missing model fails now, not in each replica's retries
        from hybridllm.loading.registry import open_checkpoint

        open_checkpoint(llm_options.get("model"))
    server = ServerOptions(max_batch=max_batch, max_queue=max_queue, host_budget=host_budget,
                           served_model_name=served_model_name, api_key=api_key, max_request_bytes=max_request_bytes,
                           stream_stall_timeout_s=stream_stall_timeout)
    on_gpu = str(llm_options.get("device", "cpu")).startswith("cuda")
    app = build_app(llm_options, replicas=replicas, server=server, num_cpus=float(llm_options.get("threads") or 1),
                    num_gpus=1.0 if on_gpu else 0.0, shutdown_grace_s=shutdown_grace)
    where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
    typer.echo(f"starting {replicas} engine replica(s) on {where} ...", err=True)
    stop = stop_on_signals()
    with ray_serve(app, address=address, host=host, port=port):
        if not stop.is_set():
            typer.echo(f"serving on http://{host}:{port} ({replicas} replicas on Ray Serve, max batch {max_batch} "
                       f"each)", err=True)
        stop.wait()
    typer.echo("stopped", err=True)
