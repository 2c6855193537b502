"""``hybridllm serve``: the OpenAI-compatible server.

Registered in ``hybridllm.cli`` (wrapped by ``cli_errors``) with
``make_serve_command(<the cli module>)``, which reuses the CLI's shared option aliases. FastAPI
and uvicorn are imported inside the command, so the CLI stays quick to start.
"""

from collections.abc import Callable
from types import ModuleType
from typing import Annotated, Any

import typer

from hybridllm.errors import ConfigError


def make_serve_command(cli: ModuleType) -> Callable[..., None]:
    """The ``serve`` command, built with the shared option aliases of the ``cli`` module.

    Taking the module as an argument (instead of importing ``hybridllm.cli``) keeps this file
    free of an import cycle, also when the CLI runs as ``python -m hybridllm.cli``. Annotations
    are evaluated here, at definition time (this file has no ``from __future__ import annotations``).
    """

    def serve(
        model: cli.ModelOpt = None,
        host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless told otherwise).")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 8000,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="HYBRIDLLM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
        max_batch: Annotated[int, typer.Option("--max-batch", help="Most requests running at once (1 disables batching).")] = 16,
        max_queue: Annotated[int, typer.Option("--max-queue", help="Most requests waiting; more get 503 with Retry-After.")] = 256,
        host_budget: Annotated[str | None, typer.Option("--host-budget", help="Host RAM the KV cache may use, e.g. 4GiB (default: the RAM available at start).")] = None,
        prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill chunk, and per scheduler step.")] = 512,
        served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id in the API (default: the checkpoint's name).")] = None,
        log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level: critical, error, warning, info, debug.")] = "info",
        weights: cli.PlacedWeightsOpt = None,
        dtype: cli.DtypeOpt = "float32",
        device: cli.DeviceOpt = "cpu",
        threads: cli.ThreadsOpt = None,
        kv_cache: cli.KVCacheOpt = "dynamic",
        kv_page_size: cli.KVPageOpt = 128,
        kv_hot_window: cli.KVHotOpt = 512,
        kv_sink_tokens: cli.KVSinkOpt = 0,
        kv_cold_bits: cli.KVColdBitsOpt = 16,
        kv_bits: cli.KVBitsOpt = 8,
        kv_residual: cli.KVResidualOpt = 128,
        kv_offload_percent: cli.KVOffloadOpt = None,
        vram_budget: cli.VramOpt = None,
        n_gpu_layers: cli.NGLOpt = None,
        decode_on: cli.DecodeOnOpt = None,
        placement: cli.PlacementOpt = None,
        fuse: cli.FuseOpt = True,
        native_decode: cli.NativeDecodeOpt = True,
        compile: cli.CompileOpt = False,
    ) -> None:
        """Serve the model over an OpenAI-compatible HTTP API with continuous batching."""
        kv = cli._kv_options(kv_cache, kv_page_size, kv_hot_window, kv_sink_tokens, kv_cold_bits, kv_bits,
                             kv_residual, kv_offload_percent, vram_budget)
        kv = {**cli.placement_options(n_gpu_layers, decode_on, placement, kv), "fuse": fuse,
              "native_decode": native_decode, "compile": compile}
        run_server(model=model, host=host, port=port, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
                   host_budget=host_budget, prefill_chunk=prefill_chunk, served_model_name=served_model_name,
                   log_level=log_level, weights=weights, dtype=dtype, device=device, threads=threads, kv=kv)

    return serve


def run_server(*, model: Any, host: str, port: int, api_key: str | None, max_batch: int, max_queue: int,
               host_budget: str | None, prefill_chunk: int, served_model_name: str | None, log_level: str,
               weights: str | None, dtype: str, device: str, threads: int | None, kv: dict[str, Any]) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching.

    ``kv``: the ``LLM`` keyword arguments of the KV and placement flags."""
    from hybridllm.config import EngineConfig
    from hybridllm.units import parse_bytes

    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {max_queue}")
    host_bytes = parse_bytes(host_budget)
    EngineConfig(device=device, dtype=dtype, threads=threads, prefill_chunk=prefill_chunk)  # fail before loading

    import psutil
    import uvicorn

    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.llm import LLM
    from hybridllm.server.app import create_app

    llm = LLM(model=model, device=device, dtype=dtype, threads=threads, prefill_chunk=prefill_chunk, weights=weights,
              **kv)
    if host_bytes is None:  # the KV may use the host RAM that is free now
        host_bytes = psutil.virtual_memory().available
    scheduler = Scheduler(llm.runtime, max_batch=max_batch, max_queue=max_queue, host_budget=host_bytes)
    app = create_app(llm, scheduler, model_name=served_model_name, api_key=api_key)
    typer.echo(f"serving {app.state.model_name} on http://{host}:{port} (max batch {max_batch}, "
               f"KV {scheduler.kv_strategy}, {llm.placement.n_gpu_layers}/{llm.config.n_layers} layers on the "
               f"device, decode on the {llm.placement.decode_on})", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
