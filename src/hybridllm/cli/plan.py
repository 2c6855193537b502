"""``hybridllm plan``: the planner on the command line (the arithmetic lives in ``hybridllm.planner``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridllm.units import format_bytes, parse_bytes

DEFAULT_PROMPT = "Explain in a few sentences how a CPU and a GPU can share the work of running a language model."


def plan(
    model: Annotated[Path | None, typer.Option("--model", "-m", help="GGUF file, Hugging Face folder, or a config.json (numbers only, no weights). Default: the embedded model.")] = None,
    vram: Annotated[str | None, typer.Option("--vram", help="Device memory budget, e.g. 8GiB (default: the probed GPU's free memory; without a GPU and without --vram the plan is CPU only).")] = None,
    ram: Annotated[str | None, typer.Option("--ram", help="Host memory budget, e.g. 32GiB (default: available RAM).")] = None,
    context: Annotated[int | None, typer.Option("--context", help="Tokens the KV cache must hold (prompt + reply); TTFT is for a prompt this long. Default: 4096 or the model's window.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Compute dtype (float weights and KV): float32, bfloat16, float16. Default: float16 with a GPU, float32 CPU only.")] = None,
    weights: Annotated[str, typer.Option("--weights", help="Weight formats to consider: auto, or a comma list of float32,float16,bfloat16,int8,int4,q4_k_m.")] = "auto",
    device_bandwidth: Annotated[float | None, typer.Option("--device-bandwidth", help="Device memory bandwidth in GB/s (default: probed, else 256 for a typical 8 GiB card).")] = None,
    pcie_bandwidth: Annotated[float | None, typer.Option("--pcie-bandwidth", help="Host<->device bandwidth in GB/s (default: probed pinned, else 12).")] = None,
    host_bandwidth: Annotated[float | None, typer.Option("--host-bandwidth", help="Host memory bandwidth in GB/s (default: probed).")] = None,
    device_tflops: Annotated[float | None, typer.Option("--device-tflops", help="Device matmul rate in TFLOP/s (default: probed, else 20).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads to probe and run with.")] = None,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill step.")] = 512,
    no_probe: Annotated[bool, typer.Option("--no-probe", help="Do not measure this machine: use the given and documented default figures.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    apply: Annotated[bool, typer.Option("--apply", help="Run a generation with the plan and report predicted and measured figures.")] = False,
    prompt: Annotated[str, typer.Option("--prompt", help="--apply: the prompt.")] = DEFAULT_PROMPT,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="--apply: new tokens (greedy).")] = 64,
    target_tps: Annotated[float | None, typer.Option("--target-tokens-per-s", help="Decode tokens/s the service must give in all: print how many engine replicas (serve --ray --replicas N) take, at the predicted rate of one.")] = None,
) -> None:
    """Choose where weights and KV live for a model on this machine (or given budgets), and predict TTFT and TPS."""
    from hybridllm import planner
    from hybridllm.errors import ConfigError

    cfg, name, has_weights = planner.load_model_config(model)
    vram_bytes, ram_bytes = parse_bytes(vram), parse_bytes(ram)
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    for flag, value in (("--device-bandwidth", device_bandwidth), ("--pcie-bandwidth", pcie_bandwidth),
                        ("--host-bandwidth", host_bandwidth), ("--device-tflops", device_tflops)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if target_tps is not None and not target_tps > 0:
        raise ConfigError(f"--target-tokens-per-s must be > 0, got {target_tps}")
    if apply and not has_weights:
        raise ConfigError("--apply needs a model with weights (a GGUF file or a Hugging Face folder), not a config.json")

    profile = None
    if not no_probe:
        from hybridllm.config import parse_dtype
        from hybridllm.planner.engine_probe import probe_machine

        # decode bandwidth is measured at this model's matrix shapes, in the host's compute dtype
        profile = probe_machine(threads=threads, quick=True, model_config=cfg,
                                dtype=parse_dtype(dtype) if dtype else parse_dtype("float32"))
    hw, sources = planner.hardware_from(profile, vram_bytes, ram_bytes, device_bandwidth, pcie_bandwidth,
                                        host_bandwidth, device_tflops)
    gpu_here = profile is not None and profile.gpu is not None
    if apply and hw.has_device and not gpu_here:
        raise ConfigError("--apply runs the plan on this machine, which has no GPU: drop --vram to plan for the CPU")
    compute_dtype = dtype or ("float16" if hw.has_device else "float32")
    if weights.strip() == "auto":
        formats = planner.engine_weight_formats(compute_dtype) if apply else None
    else:
        formats = [f.strip() for f in weights.split(",") if f.strip()]
        if not formats:
            raise ConfigError("--weights: give auto or a comma list of formats")
    ctx = context if context is not None else min(4096, cfg.max_position_embeddings)
    result = planner.plan(cfg, hw, ctx, compute_dtype, formats, prefill_chunk, model_name=name, sources=sources)
    if apply and not result.fits:
        raise ConfigError(result.reason)

    capacity = None
    if target_tps is not None and result.fits:
        from hybridllm.planner.capacity import Capacity

        capacity = Capacity(target_tps, result.prediction.decode_tps)
    if not apply:
        if as_json:
            typer.echo(json.dumps({**result.to_dict(), **({"capacity": capacity.to_dict()} if capacity else {})}))
        else:
            print_plan(result, cfg)
            if capacity is not None:
                typer.echo(f"replicas: {capacity.describe()}")
        return
    _apply(result, cfg, model, prompt, max_tokens, threads, prefill_chunk, gpu_here, as_json)


def _apply(result: Any, cfg: Any, model: Path | None, prompt: str, max_tokens: int, threads: int | None,
           prefill_chunk: int, gpu_here: bool, as_json: bool) -> None:
    """Run ``generate`` with the plan's placement; print predicted next to measured figures."""
    from hybridllm.config import SamplingParams
    from hybridllm.llm import LLM
    from hybridllm.planner.search import predicted_for_run

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm = LLM(model=model, placement=result.placement, threads=threads, dtype=result.compute_dtype,
              device="cuda" if gpu_here else "cpu", prefill_chunk=prefill_chunk)
    run = llm.generate(prompt, params)
    predicted = predicted_for_run(result, cfg, len(run.prompt_token_ids), len(run.token_ids), prefill_chunk)
    if as_json:
        typer.echo(json.dumps({"predicted": predicted, "measured": run.metrics, "plan": result.to_dict()}))
        return
    print_plan(result, cfg)
    from rich.table import Table

    m = run.metrics
    table = Table(title=f"plan --apply: {m['prompt_tokens']} prompt tokens, {m['generated_tokens']} generated")
    table.add_column("figure")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_row("TTFT", f"{predicted['ttft_s']:.3f} s", f"{m['ttft_s']:.3f} s")
    table.add_row("decode", f"{predicted['decode_tps']:.1f} tok/s",
                  "-" if m["decode_tps"] is None else f"{m['decode_tps']:.1f} tok/s")
    for figure, key in (("peak device", "peak_device_bytes"), ("peak host", "peak_host_bytes")):
        table.add_row(figure, format_bytes(predicted[key], 2), format_bytes(m[key], 2))
    _console().print(table)


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)


def _rate(value: float, source: str | None, unit: str) -> str:
    return f"{value:.1f} {unit}" + (f" ({source})" if source else "")


def print_plan(result: Any, cfg: Any) -> None:
    """The plan as one table: model numbers, machine, placement, prediction, reason."""
    from rich.table import Table

    from hybridllm.planner.memory import GB

    hw, src = result.hardware, result.sources
    pred = result.prediction

    def decimal_bytes(n: float) -> str:  # GB next to the GB/s bandwidths, as in the planner's reason
        return format_bytes(n, 2, decimal=True)

    table = Table(title=f"hybridllm plan: {result.model}, {result.context} tokens", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("figure")
    if hw.has_device:
        machine = (f"GPU: {format_bytes(hw.device_budget, 2)} budget ({src.get('vram')}), "
                   f"{_rate(hw.device_bandwidth / GB, src.get('device_bandwidth'), 'GB/s')}, "
                   f"PCIe {_rate(hw.pcie_bandwidth / GB, src.get('pcie_bandwidth'), 'GB/s')}, "
                   f"{_rate(hw.device_flops / 1e12, src.get('device_flops'), 'TFLOP/s')}; "
                   f"host: {format_bytes(hw.host_budget, 2)} RAM ({src.get('ram')}), "
                   f"{_rate(hw.host_bandwidth / GB, src.get('host_bandwidth'), 'GB/s')}")
    else:
        machine = (f"CPU only (no GPU; no --vram): the CPU stands in for the device and decode_on host is the same "
                   f"device; {format_bytes(hw.host_budget, 2)} RAM ({src.get('ram')}), "
                   f"{_rate(hw.host_bandwidth / GB, src.get('host_bandwidth'), 'GB/s')}, "
                   f"{_rate(hw.host_flops / 1e9, src.get('host_flops'), 'GFLOP/s')}, "
                   f"{hw.host_layer_overhead_s * 1e6:.0f} us/layer overhead ({src.get('host_layer_overhead')})")
    table.add_row("machine", machine)
    table.add_row("weights", " | ".join(f"{k} {decimal_bytes(v)}" for k, v in result.weights_bytes.items()))
    table.add_row("KV per token", " | ".join(f"{k} {v} B" for k, v in result.kv_bytes_per_token.items()))
    tier = "device" if hw.has_device else "CPU (device tier)"
    limit = result.device_only_max_context
    if limit >= cfg.max_position_embeddings:
        overflow = f"never overflows the {tier}: the model's whole {limit}-token window fits"
    elif limit == 0:
        overflow = f"the {result.weight_format} weights alone do not fit on the {tier}"
    else:
        overflow = f"overflows the {tier} above {limit} tokens"
    table.add_row("device-only KV", f"{overflow} ({result.weight_format} weights, all layers, "
                  f"{result.compute_dtype} KV)")
    table.add_row("placement", result.candidate.describe(cfg, hw.has_device))
    table.add_row("predicted TTFT", f"{pred.ttft_s:.2f} s for a {result.context}-token prompt")
    split = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in pred.decode_s.items())
    table.add_row("predicted decode", f"{pred.decode_tps:.1f} tok/s at {result.context} cached tokens ({split})")
    if hw.has_device:
        table.add_row("peak device", f"{decimal_bytes(pred.peak_device_bytes)} of {decimal_bytes(hw.device_budget)}")
    else:
        table.add_row("peak device tier", f"{decimal_bytes(pred.peak_device_bytes)} (weights + KV, in RAM)")
    table.add_row("peak host", f"{decimal_bytes(pred.peak_host_bytes)} of {decimal_bytes(hw.host_budget)}")
    table.add_row("fits", "yes" if result.fits else "NO")
    table.add_row("reason", result.reason)
    _console().print(table)
