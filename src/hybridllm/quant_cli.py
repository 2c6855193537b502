"""``hybridllm quantize`` and ``hybridllm eval perplexity``.

Registered in ``hybridllm.cli`` with ``make_quantize_command(<the cli module>)`` and
``make_eval_app(<the cli module>)``, which reuse the CLI's shared option aliases and error
wrapper without importing ``hybridllm.cli`` (no import cycle). Heavy modules are imported inside
the commands. Annotations are evaluated at definition time (no ``from __future__ import annotations``).
"""

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Annotated, Optional

import typer


def make_quantize_command(cli: ModuleType) -> Callable[..., None]:
    """The ``quantize`` command."""

    def quantize(
        src: Annotated[Path, typer.Argument(help="A Hugging Face folder or a float (F32/F16/BF16) GGUF file.")],
        dst: Annotated[Path, typer.Argument(help="The GGUF file to write.")],
        qtype: Annotated[str, typer.Option("--type", help="Weight type: q4_0, q4_1 or q8_0.")] = "q4_1",
    ) -> None:
        """Write a quantized GGUF file (llama.cpp's format) from a float checkpoint."""
        from collections import Counter

        from hybridllm.loading.gguf import GGUFFile
        from hybridllm.loading.quantize import quantize_checkpoint
        from hybridllm.units import format_bytes

        out = quantize_checkpoint(src, dst, qtype)
        written = GGUFFile(out)
        try:
            types = Counter(info.type_name for info in written.tensors.values())
            tensor_bytes = sum(info.nbytes for info in written.tensors.values())
        finally:
            written.close()
        summary = ", ".join(f"{n} {t}" for t, n in types.most_common())
        typer.echo(f"wrote {out} ({format_bytes(out.stat().st_size)}; tensors: {summary}; "
                   f"{format_bytes(tensor_bytes)} of tensor data)")

    return quantize


def make_eval_app(cli: ModuleType) -> typer.Typer:
    """The ``eval`` sub-command group (``eval perplexity``)."""
    eval_app = typer.Typer(help="Quality evaluations against the float reference of the same model.",
                           no_args_is_help=True)

    @eval_app.command("perplexity")
    @cli.cli_errors
    def perplexity(
        model: cli.ModelOpt = None,
        text: Annotated[Optional[Path], typer.Option("--text", help="UTF-8 text file (default: the text shipped in data/eval/).")] = None,
        context: Annotated[int, typer.Option("--context", help="Tokens per window (non-overlapping; each starts with an empty cache).")] = 512,
        chunk: Annotated[int, typer.Option("--chunk", help="Tokens per forward pass inside a window (what the KV cache sees at once).")] = 64,
        max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Use only the first N tokens of the text.")] = None,
        weights: cli.WeightsOpt = "float",
        dtype: cli.DtypeOpt = "float32",
        device: cli.DeviceOpt = "cpu",
        threads: cli.ThreadsOpt = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        kv_cache: cli.KVCacheOpt = "dynamic",
        kv_page_size: cli.KVPageOpt = 128,
        kv_hot_window: cli.KVHotOpt = 512,
        kv_sink_tokens: cli.KVSinkOpt = 0,
        kv_cold_bits: cli.KVColdBitsOpt = 16,
        kv_bits: cli.KVBitsOpt = 8,
        kv_residual: cli.KVResidualOpt = 128,
        kv_offload_percent: cli.KVOffloadOpt = None,
        vram_budget: cli.VramOpt = None,
    ) -> None:
        """Perplexity of a configuration, its delta vs the float32 model, and the KL divergence."""
        import json
        import sys

        from hybridllm.errors import ConfigError
        from hybridllm.eval.perplexity import encode_text, evaluate_perplexity, is_reference_config, load_text

        if max_tokens is not None and max_tokens < 2:
            raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")
        if context < 2 or chunk < 1:
            raise ConfigError(f"--context must be >= 2 and --chunk >= 1, got {context} and {chunk}")
        body = load_text(text)
        kv = cli._kv_options(kv_cache, kv_page_size, kv_hot_window, kv_sink_tokens, kv_cold_bits, kv_bits,
                             kv_residual, kv_offload_percent, vram_budget)
        llm = cli._load(model, device, dtype, threads, kv, weights=weights)
        if is_reference_config(weights, dtype, kv):
            reference = llm
        else:
            from hybridllm.llm import LLM

            reference = LLM(model=model, device=device, dtype="float32", threads=threads, weights="float")
        ids = encode_text(llm, body, max_tokens)

        def progress(done: int, total: int) -> None:
            if not as_json and sys.stderr.isatty():
                typer.echo(f"\rwindow {done}/{total}", err=True, nl=done == total)

        result = evaluate_perplexity(llm.runtime, reference.runtime, ids, context=context, chunk=chunk, progress=progress)
        if as_json:
            typer.echo(json.dumps(result.to_dict()))
            return
        typer.echo(f"perplexity           {result.perplexity:.4f}  (weights {llm.weights_format}, KV {kv_cache})")
        typer.echo(f"reference perplexity {result.reference_perplexity:.4f}  (float32 weights, dynamic KV)")
        typer.echo(f"delta                {result.delta_percent:+.3f} %")
        typer.echo(f"KL divergence        {result.kl_divergence:.6f} nats/token")
        typer.echo(f"tokens scored        {result.tokens}  (context {context}, chunk {chunk})")

    return eval_app
