"""The ``hybridllm`` command.

Errors caused by the user's input print one line (``error: ...``) and exit with code 2.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from hybridllm.errors import HybridLLMError

app = typer.Typer(
    name="hybridllm",
    help="Local LLM inference that splits work between host (CPU/RAM) and device (GPU/VRAM), and measures it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

EXIT_USAGE = 2


def fail(message: str) -> None:
    """Print a one-line error and exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def cli_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn user-facing errors into one line and exit code 2 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except HybridLLMError as exc:
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


# ---- shared options (the same names on generate, chat, and later serve/bench) ------------
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: PyTorch's).")]
KVCacheOpt = Annotated[str, typer.Option("--kv-cache", help="KV strategy: dynamic, offloaded, quantized, tiered or host.")]
KVPageOpt = Annotated[int, typer.Option("--kv-page-size", help="Tokens per KV page.")]
KVHotOpt = Annotated[int, typer.Option("--kv-hot-window", help="tiered: newest tokens kept on the device.")]
KVSinkOpt = Annotated[int, typer.Option("--kv-sink-tokens", help="tiered: first tokens kept on the device (attention sinks).")]
KVColdBitsOpt = Annotated[int, typer.Option("--kv-cold-bits", help="tiered: bits of cold pages in host RAM: 16, 8 or 4.")]
KVBitsOpt = Annotated[int, typer.Option("--kv-bits", help="quantized: 8 or 4.")]
KVResidualOpt = Annotated[int, typer.Option("--kv-residual", help="quantized: newest tokens kept in full precision.")]
KVOffloadOpt = Annotated[Optional[float], typer.Option("--kv-offload-percent", help="tiered: percent of cached tokens kept on the host instead of a window.")]
VramOpt = Annotated[Optional[str], typer.Option("--vram-budget", help="Device memory budget, e.g. 8GiB (weights + KV).")]
WeightsOpt = Annotated[str, typer.Option("--weights", help="Weights in memory: float, auto (keep the file's 4/8-bit quantization where a kernel exists), int8 or int4.")]
PlacedWeightsOpt = Annotated[Optional[str], typer.Option("--weights", help="Weights in memory: float, auto (keep the file's 4/8-bit quantization where a kernel exists), int8 or int4 (default: the placement file's, else auto).")]
NGLOpt = Annotated[Optional[int], typer.Option("--n-gpu-layers", "-ngl", help="Layers on the device (the first N; the rest on the host), like llama.cpp.")]
DecodeOnOpt = Annotated[Optional[str], typer.Option("--decode-on", help="device, or host: prefill on the device, then move the KV to the host and decode there.")]
PlacementOpt = Annotated[Optional[Path], typer.Option("--placement", help="Placement JSON file (per-layer tiers, KV policy, decode tier; `hybridllm plan --json` writes one).")]
FuseOpt = Annotated[bool, typer.Option("--fuse/--no-fuse", help="Stack q/k/v and gate/up into one projection each (fewer operator calls per token).")]
NativeDecodeOpt = Annotated[bool, typer.Option("--native-decode/--no-native-decode", help="Decode host layers with the native C++ kernels (one call per token; built once with the host's C++ compiler).")]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile the decode step's dense parts (compile time counts in the cold start).")]
KVAdaptiveOpt = Annotated[bool, typer.Option("--kv-adaptive/--no-kv-adaptive", help="When device KV fills up mid-request, shrink the hot window or move decoding to the host instead of failing.")]


def _kv_options(kv_cache: str, kv_page_size: int, kv_hot_window: int, kv_sink_tokens: int, kv_cold_bits: int,
                kv_bits: int, kv_residual: int, kv_offload_percent: float | None, vram_budget: str | None,
                kv_adaptive: bool = True) -> dict[str, Any]:
    return {
        "kv_cache": kv_cache, "kv_page_size": kv_page_size, "kv_hot_window": kv_hot_window,
        "kv_sink_tokens": kv_sink_tokens, "kv_cold_bits": kv_cold_bits, "kv_bits": kv_bits,
        "kv_residual": kv_residual, "kv_offload_percent": kv_offload_percent, "vram_budget": vram_budget,
        "kv_adaptive": kv_adaptive,
    }


def placement_options(n_gpu_layers: int | None, decode_on: str | None, placement: Path | None,
                      kv: dict[str, Any]) -> dict[str, Any]:
    """``LLM`` keyword arguments for the placement flags and the KV flags.

    With a placement file, only the KV flags that differ from their defaults are passed, so
    they override the file's KV policy instead of resetting it.
    """
    from hybridllm.config import KVConfig

    KVConfig(**kv)  # validate before the slow load
    if placement is not None:
        defaults = vars(KVConfig())
        kv = {key: value for key, value in kv.items() if value != defaults[key]}
    return {"n_gpu_layers": n_gpu_layers, "decode_on": decode_on, "placement": placement, **kv}


def _load(model: Path | None, device: str, dtype: str, threads: int | None, options: dict[str, Any],
          weights: str | None = None):
    from hybridllm.config import EngineConfig
    from hybridllm.llm import LLM
    from hybridllm.models.quantized import check_weights_mode

    EngineConfig(device=device, dtype=dtype, threads=threads)  # validate before the slow load
    if weights is not None:
        check_weights_mode(weights)
    return LLM(model=model, device=device, dtype=dtype, threads=threads, weights=weights, **options)


@app.command()
@cli_errors
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (read from stdin when omitted).")] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Maximum new tokens.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 means greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 disables.")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", help="0 disables.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="1 disables.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Format with the model's chat template (default: when it has one).")] = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text, ids and metrics.")] = False,
    kv_cache: KVCacheOpt = "dynamic",
    kv_page_size: KVPageOpt = 128,
    kv_hot_window: KVHotOpt = 512,
    kv_sink_tokens: KVSinkOpt = 0,
    kv_cold_bits: KVColdBitsOpt = 16,
    kv_bits: KVBitsOpt = 8,
    kv_residual: KVResidualOpt = 128,
    kv_offload_percent: KVOffloadOpt = None,
    vram_budget: VramOpt = None,
    kv_adaptive: KVAdaptiveOpt = True,
    weights: PlacedWeightsOpt = None,
    n_gpu_layers: NGLOpt = None,
    decode_on: DecodeOnOpt = None,
    placement: PlacementOpt = None,
    fuse: FuseOpt = True,
    native_decode: NativeDecodeOpt = True,
    compile: CompileOpt = False,
) -> None:
    """Generate a completion and report what each phase cost."""
    from hybridllm.config import SamplingParams

    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            fail("give a prompt as an argument or on standard input")
        prompt = sys.stdin.read()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, stop=list(stop or []), ignore_eos=ignore_eos,
    )
    kv = _kv_options(kv_cache, kv_page_size, kv_hot_window, kv_sink_tokens, kv_cold_bits, kv_bits, kv_residual,
                     kv_offload_percent, vram_budget, kv_adaptive)
    llm = _load(model, device, dtype, threads,
                {**placement_options(n_gpu_layers, decode_on, placement, kv), "fuse": fuse, "native_decode": native_decode,
                 "compile": compile},
                weights=weights)
    use_chat = llm.tokenizer.has_chat_template if chat is None else chat
    request = [{"role": "user", "content": prompt}] if use_chat else prompt
    result = None
    for event in llm.stream_events(request, params):
        if event.result is not None:
            result = event.result
        elif not as_json:
            typer.echo(event.text, nl=False)
    if as_json:
        typer.echo(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "finish_reason": result.finish_reason,
            "metrics": result.metrics,
        }))
    else:
        typer.echo("")
        sys.stdout.flush()
        from hybridllm.report import print_metrics

        print_metrics(result.metrics, llm.cold_start)


@app.command()
@cli_errors
def chat(
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 512,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    kv_cache: KVCacheOpt = "dynamic",
    vram_budget: VramOpt = None,
    weights: PlacedWeightsOpt = None,
    n_gpu_layers: NGLOpt = None,
    decode_on: DecodeOnOpt = None,
    placement: PlacementOpt = None,
    fuse: FuseOpt = True,
    native_decode: NativeDecodeOpt = True,
    compile: CompileOpt = False,
) -> None:
    """Interactive chat that streams tokens. /reset clears the history, /exit (or Ctrl-D) quits."""
    from hybridllm.config import KVConfig, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    kv = {k: v for k, v in vars(KVConfig(kv_cache=kv_cache, vram_budget=vram_budget)).items()}
    llm = _load(model, device, dtype, threads,
                {**placement_options(n_gpu_layers, decode_on, placement, kv), "fuse": fuse, "native_decode": native_decode,
                 "compile": compile},
                weights=weights)
    if not llm.tokenizer.has_chat_template:
        fail("this model has no chat template; use `hybridllm generate --no-chat` instead")
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    typer.echo(f"{llm.config.name or 'model'} ready. /reset clears the history, /exit quits.", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            typer.echo("", err=True)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        result = None
        for event in llm.stream_events(history, params):
            if event.result is not None:
                result = event.result
            else:
                reply.append(event.text)
                typer.echo(event.text, nl=False)
        typer.echo("")
        m = result.metrics
        typer.echo(
            f"[{m['generated_tokens']} tokens, TTFT {m['ttft_s']:.3f} s, "
            f"{(m['decode_tps'] or 0):.1f} tok/s]", err=True,
        )
        history.append({"role": "assistant", "content": "".join(reply)})


from hybridllm.bench.cli import bench as _bench  # noqa: E402  (the harness lives in hybridllm.bench)

app.command(name="bench")(cli_errors(_bench))

from hybridllm.doctor import doctor as _doctor  # noqa: E402  (checks and measurements live in hybridllm.doctor)
from hybridllm.placement.plan_cli import plan as _plan  # noqa: E402  (the planner lives in hybridllm.placement)

app.command(name="doctor")(cli_errors(_doctor))
app.command(name="plan")(cli_errors(_plan))

from hybridllm.server.cli import make_serve_command  # noqa: E402  (the server lives in hybridllm.server)

app.command(name="serve")(cli_errors(make_serve_command(sys.modules[__name__])))

from hybridllm.quant_cli import make_eval_app, make_quantize_command  # noqa: E402  (quantized weights, perplexity)

app.command(name="quantize")(cli_errors(make_quantize_command(sys.modules[__name__])))
app.add_typer(make_eval_app(sys.modules[__name__]), name="eval")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
