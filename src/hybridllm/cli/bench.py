"""``hybridllm bench``: sweep configurations, each in its own process, and report them.

``--kv-cache``, ``--decode-on`` and ``--n-gpu-layers`` take comma-separated lists (one sweep
axis each); every other shared flag takes one value for all of our engine's configurations.
Heavy modules are imported inside the command, so importing this file is cheap.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from hybridllm.cli.options import (
    KV_PANEL,
    MODEL_PANEL,
    PLACEMENT_PANEL,
    SPEC_PANEL,
    KVOptions,
    ModelOptions,
    PlacementOptions,
    SpeculativeOptions,
    SpeedOptions,
    changed,
    with_option_groups,
)
from hybridllm.errors import ConfigError


def _parse_kv_options(pairs: list[str] | None) -> dict[str, Any]:
    """``--kv-opt KEY=VALUE`` pairs as ``KVConfig`` fields (``hot_window`` means ``kv_hot_window``)."""
    from hybridllm.config import KVConfig

    options: dict[str, Any] = {}
    allowed = set(KVConfig.__dataclass_fields__) - {"kv_cache"}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--kv-opt takes KEY=VALUE, got {pair!r}")
        if not key.startswith("kv_") and key != "vram_budget" and f"kv_{key}" in allowed:
            key = f"kv_{key}"
        if key not in allowed:
            raise ConfigError(f"unknown KV option {key!r}; known: {', '.join(sorted(allowed))}")
        options[key] = _scalar(value.strip())
    return options


def prompt_lengths_flag(prompt_tokens: str | None, old_spelling: str | None) -> str | None:
    """``--prompt-tokens``, or its old spelling ``-c``/``--context`` with a deprecation warning (kept
    for one release: everywhere else ``-c`` is ``--ctx-size``, as in llama.cpp)."""
    if old_spelling is None:
        return prompt_tokens
    if prompt_tokens is not None:
        raise ConfigError("-c/--context is the old spelling of --prompt-tokens; give only --prompt-tokens")
    typer.echo("warning: bench's -c/--context (prompt lengths) is deprecated and will be removed in the next "
               "release; use --prompt-tokens (-c will then mean --ctx-size, as in generate and serve)", err=True)
    return old_spelling


def _kernel_isa() -> str | None:
    """The native kernels' instruction set here (None where they do not build)."""
    from hybridllm.kernels.abi import kernel_isa
    from hybridllm.kernels.build import KernelBuildError

    try:
        return kernel_isa()
    except KernelBuildError:
        return None


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text.lower() in ("none", "null") else text


@with_option_groups(own=("kv_cache", "decode_on", "n_gpu_layers", "ctx_size", "spec"))
def bench(
    model: ModelOptions = ModelOptions(device="auto"),
    random_weights: Annotated[Optional[Path], typer.Option("--random-weights", help="A Hugging Face config.json (e.g. configs/llama-3.2-1b.json): that shape with random weights, nothing downloaded.")] = None,
    prompt_tokens: Annotated[Optional[str], typer.Option("--prompt-tokens", help="Prompt lengths in tokens, comma-separated: 1024,4096 or 1K,4K (llama-bench's -p; --preset multi-turn: the system prompt's length).")] = None,
    old_prompt_tokens: Annotated[Optional[str], typer.Option("--context", "-c", hidden=True, help="Deprecated: the old spelling of --prompt-tokens (-c will mean --ctx-size, as in every other command).")] = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", help="Our engine's context size in tokens (sizes the KV); 0: the model's window.", rich_help_panel=MODEL_PANEL)] = 0,
    new_tokens: Annotated[Optional[int], typer.Option("--new-tokens", "-n", help="Tokens generated after the prompt (greedy, EOS ignored).")] = None,
    kv_cache: Annotated[Optional[str], typer.Option("--kv-cache", help="Our KV strategies, comma-separated: dynamic,offloaded,quantized,tiered,host.", rich_help_panel=KV_PANEL)] = None,
    decode_on: Annotated[Optional[str], typer.Option("--decode-on", help="Where decode runs, comma-separated: device,host.", rich_help_panel=PLACEMENT_PANEL)] = None,
    n_gpu_layers: Annotated[Optional[str], typer.Option("--n-gpu-layers", "-ngl", help="Layers on the device, comma-separated (also passed to llama.cpp).", rich_help_panel=PLACEMENT_PANEL)] = None,
    spec: Annotated[Optional[str], typer.Option("--spec", help="Speculative decoding, comma-separated: none,ngram,draft (ngram: llama.cpp rows use llama-cpp-python's LlamaPromptLookupDecoding; draft: --model-draft).", rich_help_panel=SPEC_PANEL)] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", help="Named chat prompts instead of --prompt-tokens, comma-separated: rewrite (a ~600-token file given back with a class renamed), quote (a document's paragraph repeated), chat (free-form); greedy, stopping at the end of sequence.")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Peers measured the same way, comma-separated: llama.cpp,transformers (or none).")] = None,
    repeat: Annotated[Optional[int], typer.Option("--repeat", "-r", help="Measured runs per configuration (median and spread reported).")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", help="A named grid: paper (the study's), peers (vs llama.cpp and transformers), speed (peers at 16-8064 tokens, --weights auto, ratio to llama.cpp and fraction of the bandwidth limit), kv (every KV strategy and variant: bytes per tier, bus traffic), planner (the planner's predicted vs measured decode, in this process), spec (speculative decoding: the rewrite, quote and chat workloads without and with --spec ngram, next to llama-cpp-python without and with LlamaPromptLookupDecoding) or multi-turn (TTFT per chat turn with the prefix cache off and on, and after a restart from disk; --prompt-tokens sets the system prompt, --turns the turns).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the rows as JSON.")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write the rows as CSV.")] = None,
    plot_out: Annotated[Optional[Path], typer.Option("--plot", help="Write the plots as one PNG.")] = None,
    markdown_out: Annotated[Optional[Path], typer.Option("--markdown", help="Write the table(s) as Markdown.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed per configuration.")] = 1800.0,
    kv_opt: Annotated[Optional[list[str]], typer.Option("--kv-opt", help="More KV options for our engine, KEY=VALUE (repeatable), e.g. kv_hot_window=1024; the --kv-* flags override them.")] = None,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="A short request before the measured ones.")] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --random-weights.")] = 0,
    turns: Annotated[int, typer.Option("--turns", help="--preset multi-turn: user turns of the conversation.")] = 8,
    wait_idle: Annotated[float, typer.Option("--wait-idle", help="--preset planner: seconds to wait, at most, for the other processes to leave the CPUs idle before each generation.")] = 0.0,
    placement: PlacementOptions = PlacementOptions(),
    kv: KVOptions = KVOptions(),
    speed: SpeedOptions = SpeedOptions(),
    speculative: SpeculativeOptions = SpeculativeOptions(),
) -> None:
    """Measure prefill and decode over a grid of prompt lengths, KV strategies, placements, speculation, and peers."""
    from hybridllm.bench import kv_strategies, peers_report, presets, report, spec_report
    from hybridllm.bench.sweep import (
        BASELINES,
        DECODE_ON,
        SPECS,
        BenchConfig,
        model_window,
        parse_contexts,
        parse_layers,
        parse_names,
        run_sweep,
    )
    from hybridllm.bench.workloads import WORKLOADS
    from hybridllm.config import KV_STRATEGIES, EngineConfig, KVConfig, SpeculativeConfig, resolve_device

    if model.path is not None and random_weights is not None:
        raise ConfigError("give either --model or --random-weights, not both")
    prompt_tokens = prompt_lengths_flag(prompt_tokens, old_prompt_tokens)
    baselines = None
    if baseline is not None:
        baselines = [] if baseline.strip().lower() in ("", "none") else parse_names(baseline, BASELINES, "baseline")
    settings = presets.resolve(
        preset,
        contexts=parse_contexts(prompt_tokens) if prompt_tokens is not None else None,
        kv_caches=parse_names(kv_cache, KV_STRATEGIES, "KV cache") if kv_cache is not None else None,
        decode_ons=parse_names(decode_on, DECODE_ON, "--decode-on value") if decode_on is not None else None,
        n_gpu_layers=parse_layers(n_gpu_layers) if n_gpu_layers is not None else None,
        baselines=baselines,
        new_tokens=new_tokens,
        repeat=repeat,
        specs=parse_names(spec, SPECS, "--spec value") if spec is not None else None,
        workloads=parse_names(workload, tuple(WORKLOADS), "workload") if workload is not None else None,
    )
    for key, what in (("contexts", "--prompt-tokens"), ("kv_caches", "--kv-cache"), ("decode_ons", "--decode-on"),
                      ("n_gpu_layers", "--n-gpu-layers"), ("specs", "--spec")):
        if not settings[key]:
            raise ConfigError(f"{what} needs at least one value")
    if settings["new_tokens"] < 1 or settings["repeat"] < 1:
        raise ConfigError("--new-tokens and --repeat must be >= 1")
    if timeout <= 0:
        raise ConfigError("--timeout must be > 0")
    device = resolve_device(model.device)
    threads = model.threads
    if preset == "planner":  # measured in this process: the prediction is about this process's model
        from hybridllm.bench.planner_accuracy import run_preset

        raise typer.Exit(run_preset(settings, threads, wait_idle, json_out, markdown_out,
                                    shlex.join(["hybridllm", *sys.argv[1:]])))
    EngineConfig(device=device, dtype=model.dtype, threads=threads, prefill_chunk=model.prefill_chunk)
    if preset == "multi-turn":  # in this process: the prefix cache is this process's
        from hybridllm.bench.multi_turn import run_preset as run_multi_turn

        if turns < 1:
            raise ConfigError("--turns must be >= 1")
        if random_weights is not None:
            from hybridllm.loading.random_checkpoint import RandomCheckpoint

            source = {"model": RandomCheckpoint(random_weights, seed=seed)}
        else:
            source = {"model": model.path}
        multi_turn_options = {**source, "device": device, "dtype": model.dtype, "threads": threads,
                              "prefill_chunk": model.prefill_chunk, **changed(speed), **changed(kv)}
        if placement.weights is not None:
            multi_turn_options["weights"] = placement.weights
        raise typer.Exit(run_multi_turn(multi_turn_options, settings, turns, json_out,
                                        shlex.join(["hybridllm", *sys.argv[1:]])))
    # A preset's KV options (--preset speed: float16 KV), then --kv-opt, then the KV flags; kv_cache
    # is a sweep axis, never in changed(kv).
    kv_options = {**settings.get("kv_options", {}), **_parse_kv_options(kv_opt), **changed(kv)}
    llm_options = changed(speed)
    spec_options = changed(speculative)  # --spec is the sweep's axis; the other flags go to our engine as they are
    if spec_options.get("model_draft") is not None:
        spec_options["model_draft"] = str(spec_options["model_draft"])
    if "draft" in settings["specs"] and spec_options.get("model_draft") is None:
        raise ConfigError("--spec draft needs --model-draft M")
    SpeculativeConfig(**{**spec_options, "spec": "draft" if spec_options.get("model_draft") else "ngram"})
    llm_options.update(spec_options)
    if ctx_size:
        llm_options["ctx_size"] = ctx_size
    if placement.file is not None:
        from hybridllm.placement.placement import Placement

        Placement.load(placement.file)  # a missing or malformed file fails here, before the sweep
        if any(layers is not None for layers in settings["n_gpu_layers"]):
            raise ConfigError("give a placement file or --n-gpu-layers, not both")
        llm_options["placement"] = str(placement.file)
    weights = placement.weights
    if weights is None:
        weights = settings.get("weights")  # a preset's choice (--preset speed: auto)
    if weights is not None:
        try:
            from hybridllm.models.quantized import check_weights_mode
        except ImportError:  # an engine without weight modes: the rows will say so
            check_weights_mode = None
        if check_weights_mode is not None:
            check_weights_mode(weights)
    for strategy in settings["kv_caches"]:
        KVConfig(kv_cache=strategy, **kv_options)
    if threads is None:
        from hybridllm.bench.peers import default_threads

        threads = default_threads()  # the same number for every engine

    common = dict(model=str(model.path) if model.path else None, random_weights=str(random_weights) if random_weights else None,
                  new_tokens=settings["new_tokens"], repeat=settings["repeat"], threads=threads, device=device,
                  dtype=model.dtype, warmup=warmup, kv_options=kv_options, seed=seed,
                  prefill_chunk=model.prefill_chunk, weights=weights, llm_options=llm_options)
    model_window(BenchConfig(**common))  # a missing or unreadable model fails here, before the sweep
    grid = presets.build_preset_grid(settings, **common)
    from hybridllm.kernels.threads import measure_machine_load

    machine_load = measure_machine_load()  # other work's share of the CPUs: figures from a loaded machine are low
    typer.echo(f"CPU: {machine_load.line()}", err=True)
    started, load_start = dt.datetime.now(dt.UTC), os.getloadavg()[0]
    rows = run_sweep(grid, timeout_s=timeout, progress=True)

    serve_rows: list[dict[str, Any]] = []
    if settings["serve_concurrency"]:  # --preset spec: the servers after the sweep, one at a time
        from hybridllm.bench.spec_serve import compare_serving

        serve_args = [*(["--model", str(model.path)] if model.path else []), "--device", device,
                      *(["--weights", weights] if weights else [])]
        serve_rows = compare_serving(serve_args, threads, settings["repeat"], settings["serve_concurrency"],
                                     min(settings["new_tokens"], settings["serve_new_tokens"]))

    report.print_summary(rows)
    if preset == "peers":
        peers_report.print_peers(rows)
    if settings.get("workloads"):
        spec_report.print_spec(rows)
    if serve_rows:
        spec_report.print_serve(serve_rows)
    if preset == "kv":
        kv_strategies.print_kv(rows, {**settings, "threads": threads, "device": device, "dtype": model.dtype,
                                      "kv_options": kv_options})
    if preset == "paper":
        report.print_table(report.PAPER_HEADERS, report.paper_records(rows), title="the study's layout")
    bandwidth_gbs = device_bandwidth_gbs = None
    if preset == "speed":
        from hybridllm.hardware import measure_host_read

        bandwidth_gbs = measure_host_read(threads=threads)  # after the sweep: nothing else runs
        report.print_speed(rows, bandwidth_gbs)
    elif device.startswith("cuda"):  # on a GPU every run reports bytes per token against the device's bandwidth
        from hybridllm.hardware import measure_gpu

        gpu = measure_gpu(int(device.split(":")[1]) if ":" in device else 0)
        device_bandwidth_gbs = gpu.bandwidth_gbs if gpu is not None else None
        report.print_speed(rows, device_bandwidth_gbs, bandwidth_label="device memory bandwidth")
    recorded = {**settings, "preset": preset, "timeout_s": timeout, "threads": threads, "device": device,
                "dtype": model.dtype, "kv_options": kv_options, "llm_options": llm_options, "weights": weights,
                "host_read_gbs": bandwidth_gbs, "device_bandwidth_gbs": device_bandwidth_gbs,
                "command": shlex.join(["hybridllm", *sys.argv[1:]]),
                "started": started.isoformat(timespec="seconds"), "load_average": [load_start, os.getloadavg()[0]],
                "cpu_busy_elsewhere": machine_load.busy_elsewhere, "machine_loaded": machine_load.loaded,
                "warmup": warmup, "serve": serve_rows}
    if json_out is not None:
        report.write_json(rows, json_out, recorded)
    if csv_out is not None:
        report.write_csv(rows, csv_out)
    if markdown_out is not None:
        text = report.summary_markdown(rows)
        if preset == "paper":
            text = report.paper_markdown(rows) + "\n\n" + text
        if preset == "speed":
            text = report.speed_markdown(rows, bandwidth_gbs) + "\n\n" + text
        if device_bandwidth_gbs:
            text = report.speed_markdown(rows, device_bandwidth_gbs) + "\n\n" + text
        if preset == "peers":
            text = peers_report.section(rows, report.machine_info(), recorded)
        if preset == "kv":
            text = kv_strategies.kv_markdown(rows, recorded) + "\n\n" + text
        if settings.get("workloads"):
            text = spec_report.section(rows, {**report.machine_info(), "kernel_isa": _kernel_isa()}, recorded,
                                       serve_rows)
        markdown_out.expanduser().parent.mkdir(parents=True, exist_ok=True)
        markdown_out.write_text(text + "\n")
    if plot_out is not None:
        from hybridllm.bench.plots import write_plots

        write_plots(rows, plot_out, title=f"hybridllm bench: {rows[0]['model']}" if rows else None)
    written = [str(p) for p in (json_out, csv_out, markdown_out, plot_out) if p is not None]
    if written:
        typer.echo(f"wrote {', '.join(written)}", err=True)
