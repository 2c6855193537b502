"""``hybridllm eval``: quality evaluations (``eval perplexity``) against the float reference."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybridllm.cli.options import (
    Device,
    Dtype,
    KVOptions,
    Model,
    ModelOptions,
    PlacementOptions,
    SpeedOptions,
    Threads,
    Weights,
    load_llm,
    with_option_groups,
)
from hybridllm.errors import ConfigError


@with_option_groups
def perplexity(
    model: Model = None,
    text: Annotated[Optional[Path], typer.Option("--text", help="UTF-8 text file (default: the text shipped in data/eval/).")] = None,
    context: Annotated[int, typer.Option("--context", help="Tokens per window (non-overlapping; each starts with an empty cache).")] = 512,
    chunk: Annotated[int, typer.Option("--chunk", help="Tokens per forward pass inside a window (what the KV cache sees at once).")] = 64,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Use only the first N tokens of the text.")] = None,
    weights: Weights = "float",
    dtype: Dtype = "float32",
    device: Device = "cpu",
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    kv: KVOptions = KVOptions(),
) -> None:
    """Perplexity of a configuration, its delta vs the float32 model, and the KL divergence."""
    from hybridllm.eval.perplexity import encode_text, evaluate_perplexity, is_reference_config, load_text

    if max_tokens is not None and max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")
    if context < 2 or chunk < 1:
        raise ConfigError(f"--context must be >= 2 and --chunk >= 1, got {context} and {chunk}")
    body = load_text(text)
    engine = ModelOptions(path=model, device=device, dtype=dtype, threads=threads)
    llm = load_llm(engine, PlacementOptions(weights=weights), kv, SpeedOptions())
    if is_reference_config(weights, dtype, dataclasses.asdict(kv)):
        reference = llm
    else:
        reference = load_llm(dataclasses.replace(engine, dtype="float32"), PlacementOptions(weights="float"),
                             KVOptions(), SpeedOptions())
    ids = encode_text(llm, body, max_tokens)

    def progress(done: int, total: int) -> None:
        if not as_json and sys.stderr.isatty():
            typer.echo(f"\rwindow {done}/{total}", err=True, nl=done == total)

    result = evaluate_perplexity(llm.runtime, reference.runtime, ids, context=context, chunk=chunk, progress=progress)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    typer.echo(f"perplexity           {result.perplexity:.4f}  (weights {llm.weights_format}, KV {kv.kv_cache})")
    typer.echo(f"reference perplexity {result.reference_perplexity:.4f}  (float32 weights, dynamic KV)")
    typer.echo(f"delta                {result.delta_percent:+.3f} %")
    typer.echo(f"KL divergence        {result.kl_divergence:.6f} nats/token")
    typer.echo(f"tokens scored        {result.tokens}  (context {context}, chunk {chunk})")
