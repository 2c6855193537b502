"""``hybridllm serve``: the OpenAI-compatible server.

FastAPI and uvicorn are imported inside the command, so the CLI stays quick to start.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from hybridllm.cli.options import (
    KVOptions,
    ModelOptions,
    PlacementOptions,
    PrefixCacheOptions,
    SpeculativeOptions,
    SpeedOptions,
    llm_kwargs,
    with_option_groups,
)
from hybridllm.errors import ConfigError

# Seconds an idle keep-alive connection stays open: longer than clients' pools keep one (httpx,
# hence the OpenAI SDK: 5 s), so that the client closes it first. A server closing at the same
# 5 s (uvicorn's default) races a request sent on it just then: "Server disconnected without
# sending a response".
KEEP_ALIVE_S = 75


@with_option_groups
def serve(
    model: ModelOptions = ModelOptions(),
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless told otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="HYBRIDLLM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most requests running at once (1 disables batching).")] = 64,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Most requests waiting; more get 503 with Retry-After.")] = 256,
    host_budget: Annotated[Optional[str], typer.Option("--host-budget", help="Host RAM the KV cache may use, e.g. 4GiB (default: the RAM available at start).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id in the API (default: the checkpoint's name).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level: critical, error, warning, info, debug.")] = "info",
    max_request_bytes: Annotated[str, typer.Option("--max-request-bytes", help="Largest request body accepted, e.g. 8MiB (bigger: 413).")] = "8MiB",
    shutdown_grace: Annotated[float, typer.Option("--shutdown-grace", help="On SIGTERM: seconds to finish in-flight requests before exiting (new ones get 503); exit code 1 when some did not finish.")] = 30.0,
    stream_stall_timeout: Annotated[float, typer.Option("--stream-stall-timeout", help="Seconds a stream whose client reads nothing stays paused (its KV kept, out of the batch) before it is closed and its request aborted.")] = 60.0,
    on_ray: Annotated[bool, typer.Option("--ray", help="Run --replicas engine replicas on Ray Serve behind one OpenAI-compatible ingress (pip install 'hybridllm[ray]').")] = False,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="--ray: the cluster to join (auto: the one `ray start` runs here; HEAD:6379); default: start a local one.")] = None,
    replicas: Annotated[int, typer.Option("--replicas", help="--ray: engine replicas, each with its own model, request loop and KV.")] = 1,
    placement: PlacementOptions = PlacementOptions(),
    kv: KVOptions = KVOptions(),
    speed: SpeedOptions = SpeedOptions(),
    spec: SpeculativeOptions = SpeculativeOptions(),
    prefix: PrefixCacheOptions = PrefixCacheOptions(prefix_cache_ram="auto"),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching."""
    from hybridllm.config import parse_bytes

    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {max_queue}")
    if shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace must be >= 0, got {shutdown_grace}")
    if not stream_stall_timeout > 0:
        raise ConfigError(f"--stream-stall-timeout must be > 0 seconds, got {stream_stall_timeout}")
    host_bytes = parse_bytes(host_budget)
    request_bytes = parse_bytes(max_request_bytes)
    if request_bytes is None or request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be a positive size, got {max_request_bytes!r}")
    if not on_ray and (ray_address is not None or replicas != 1):
        raise ConfigError("--ray-address and --replicas need --ray")
    if on_ray:
        from hybridllm.cli.serve_ray import run_ray_server

        if replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {replicas}")
        run_ray_server(llm_kwargs(model, placement, kv, speed, prefix, spec), address=ray_address, replicas=replicas, host=host,
                       port=port, api_key=api_key, max_batch=max_batch, max_queue=max_queue, host_budget=host_bytes,
                       served_model_name=served_model_name, max_request_bytes=request_bytes,
                       shutdown_grace=shutdown_grace, stream_stall_timeout=stream_stall_timeout)
        return
    run_server(llm_kwargs(model, placement, kv, speed, prefix, spec), host=host, port=port, api_key=api_key, max_batch=max_batch,
               max_queue=max_queue, host_budget=host_bytes, served_model_name=served_model_name, log_level=log_level,
               max_request_bytes=request_bytes, shutdown_grace=shutdown_grace, stream_stall_timeout=stream_stall_timeout)


def run_server(llm_options: dict[str, Any], *, host: str, port: int, api_key: str | None, max_batch: int,
               max_queue: int, host_budget: int | None, served_model_name: str | None, log_level: str,
               max_request_bytes: int, shutdown_grace: float, stream_stall_timeout: float) -> None:
    """Load the model and serve it until interrupted; SIGTERM drains first, then exits 0 (1 when
    the grace period ended requests that had not finished).

    Args:
        llm_options: ``LLM`` keyword arguments (:func:`hybridllm.cli.options.llm_kwargs`).
        host_budget: host RAM the KV cache may use, in bytes (None: the RAM available at start).
        max_request_bytes: the largest request body accepted.
        shutdown_grace: seconds SIGTERM waits for in-flight requests.
        stream_stall_timeout: seconds a paused stream waits for its client to read.
    """
    import psutil
    import uvicorn

    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.llm import LLM
    from hybridllm.server.app import create_app
    from hybridllm.server.shutdown import GracefulServer

    llm = LLM(**llm_options)
    if host_budget is None:  # the KV may use the host RAM that is free now
        host_budget = psutil.virtual_memory().available
    scheduler = Scheduler(llm.runtime, max_batch=max_batch, max_queue=max_queue, host_budget=host_budget,
                          prefix_cache=llm.prefix_cache)
    app = create_app(llm, scheduler, model_name=served_model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes, stream_stall_timeout_s=stream_stall_timeout)
    speculation = "" if not llm.speculative.enabled else f", speculative decoding: {llm.speculative.method}"
    typer.echo(f"serving {app.state.model_name} on http://{host}:{port} (max batch {max_batch}, "
               f"KV {scheduler.kv_strategy}, {llm.placement.describe(llm.engine_config.device)}{speculation})", err=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_grace,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = GracefulServer(config, app.state.draining, scheduler, grace_s=shutdown_grace)
    server.run()
    if server.unfinished:
        typer.echo(f"stopped with {server.unfinished} request(s) unfinished (ended with an error)", err=True)
        raise typer.Exit(1)
