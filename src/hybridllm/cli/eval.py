"""``hybridllm eval``: quality evaluations against the float reference: ``eval perplexity`` and
``eval lm-eval`` (lm-evaluation-harness tasks on our engine, the optional ``eval`` extra)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from hybridllm.cli.options import (
    KV_PANEL,
    PLACEMENT_PANEL,
    Activations,
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
    weights: Weights = "auto",
    dtype: Dtype = "float32",
    device: Device = "auto",
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    activations: Activations = "exact",
    kv: KVOptions = KVOptions(),
) -> None:
    """Perplexity of the model as generate and serve run it (default: --weights auto, the file's own
    4/8-bit weights, on --device auto), its delta vs the float32 reference of the same file, and the
    KL divergence between them."""
    from hybridllm.eval.perplexity import (
        DEFAULT_TEXT_NAME,
        encode_text,
        evaluate_perplexity,
        is_reference_config,
        load_text,
    )
    from hybridllm.loading.local_models import model_name

    if max_tokens is not None and max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")
    if context < 2 or chunk < 1:
        raise ConfigError(f"--context must be >= 2 and --chunk >= 1, got {context} and {chunk}")
    body = load_text(text)
    engine = ModelOptions(path=model, device=device, dtype=dtype, threads=threads)
    llm = load_llm(engine, PlacementOptions(weights=weights), kv, SpeedOptions(activations=activations))
    if activations == SpeedOptions().activations and is_reference_config(weights, dtype, dataclasses.asdict(kv)):
        reference = llm
    else:
        reference = load_llm(dataclasses.replace(engine, dtype="float32"), PlacementOptions(weights="float"),
                             KVOptions(), SpeedOptions())
    ids = encode_text(llm, body, max_tokens)
    measured = {"weights": weights, "weights_format": llm.weights_format, "dtype": dtype, "kv_cache": kv.kv_cache}
    if activations != SpeedOptions().activations:  # named only where not the default's exact products
        measured["activations"] = activations
    baseline = {"weights": "float", "weights_format": reference.weights_format, "dtype": "float32",
                "kv_cache": "dynamic"}
    setup = {"model": model_name(llm.checkpoint.path), "device": llm.engine_config.device,
             "text": str(text) if text is not None else "data/eval/" + DEFAULT_TEXT_NAME,
             "measured": measured, "reference": baseline}
    if not as_json:
        served = weights == "auto" and dtype == ModelOptions().dtype and kv == KVOptions() \
            and activations == SpeedOptions().activations
        typer.echo(f"model      {setup['model']} on {setup['device']}, text {setup['text']}")
        typer.echo(f"measured   {describe_config(measured)}" + ("  (as generate and serve run it)" if served else ""))
        typer.echo(f"reference  {describe_config(baseline)}  (the same file's weights in float32"
                   + ("; the measured configuration itself)" if reference is llm else ")"))

    def progress(done: int, total: int) -> None:
        if not as_json and sys.stderr.isatty():
            typer.echo(f"\rwindow {done}/{total}", err=True, nl=done == total)

    result = evaluate_perplexity(llm.runtime, reference.runtime, ids, context=context, chunk=chunk, progress=progress)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), **setup}))
        return
    typer.echo(f"perplexity           {result.perplexity:.4f}  (measured)")
    typer.echo(f"reference perplexity {result.reference_perplexity:.4f}  (float32 reference)")
    typer.echo(f"delta                {result.delta_percent:+.3f} %")
    typer.echo(f"KL divergence        {result.kl_divergence:.6f} nats/token  (reference || measured)")
    typer.echo(f"tokens scored        {result.tokens}  (context {context}, chunk {chunk})")


def describe_config(config: dict[str, str]) -> str:
    """``weights auto -> int4, float32 compute, dynamic KV``: a configuration as requested and as run
    (``, int8 activations`` where the products' inputs are not exact)."""
    activations = config.get("activations", "exact")
    return (f"weights {config['weights']} -> {config['weights_format']}, {config['dtype']} compute, "
            f"{config['kv_cache']} KV" + ("" if activations == "exact" else f", {activations} activations"))


@with_option_groups(own=("kv_cache", "weights"))
def lm_eval(
    tasks: Annotated[str, typer.Option("--tasks", help="lm-eval task names, comma-separated (lm-eval's own, or in --include-path).")],
    include_path: Annotated[Optional[Path], typer.Option("--include-path", help="A folder of task YAML files (your own tasks).")] = None,
    limit: Annotated[Optional[float], typer.Option("--limit", help="Items per task: a count, or a fraction below 1.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option("--num-fewshot", help="Few-shot examples per item (default: the task's).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests running at once in the request loop.")] = 16,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the table (and lm-eval's results) as JSON.")] = None,
    kv_cache: Annotated[str, typer.Option("--kv-cache", help="KV formats, comma-separated: dynamic, offloaded, quantized, tiered, host, and int8 / int4 (the quantized strategy with --kv-bits 8 / 4). KV formats change what later forwards read: with --prefill-chunk below the prompt length and --kv-residual 0 a prompt is scored from the quantized cache.", rich_help_panel=KV_PANEL)] = "dynamic",
    weights: Annotated[Optional[str], typer.Option("--weights", help="Weights modes, comma-separated: float, auto (the file's own 4/8-bit weights; the default), int8, int4.", rich_help_panel=PLACEMENT_PANEL)] = None,
    model: ModelOptions = ModelOptions(),
    placement: PlacementOptions = PlacementOptions(),
    kv: KVOptions = KVOptions(),
    speed: SpeedOptions = SpeedOptions(),
) -> None:
    """Task accuracy with lm-evaluation-harness on our engine; several KV formats or weights: one table with deltas.

    Each --weights x --kv-cache pair runs; deltas are against dynamic KV with the least lossy weights listed.
    """
    from hybridllm.eval.lm_eval_runs import (
        INSTALL_HINT,
        configurations,
        evaluate_tasks,
        format_table,
        metric_rows,
        parse_kv_list,
        parse_weights_list,
        with_deltas,
    )

    try:
        from hybridllm.eval.lm_eval_model import HybridLLMEvalModel
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    task_names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not task_names:
        raise ConfigError("--tasks needs at least one task name")
    if limit is not None and limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {limit}")
    configs = configurations(parse_weights_list(weights), parse_kv_list(kv_cache))
    rows, results = [], []
    for index, config in enumerate(configs):
        config_kv = dataclasses.replace(kv, kv_cache=config.kv_cache, kv_bits=config.kv_bits or kv.kv_bits)
        llm = load_llm(model, dataclasses.replace(placement, weights=config.weights), config_kv, speed)
        typer.echo(f"[{index + 1}/{len(configs)}] weights {config.weights_label} ({llm.weights_format}), "
                   f"KV {config.kv_label}", err=True)
        lm = HybridLLMEvalModel(llm.runtime, batch_size=batch_size)
        output = evaluate_tasks(lm, task_names, include_path, limit=_count(limit), num_fewshot=num_fewshot)
        del lm, llm  # free this configuration's weights before the next one loads
        rows += metric_rows(output["results"], config, reference=index == 0)
        results.append({"weights": config.weights_label, "kv_cache": config.kv_label, "results": output["results"]})
    rows = with_deltas(rows)
    for line in format_table(rows):
        typer.echo(line)
    if json_out is not None:
        json_out.write_text(json.dumps({"reference": {"weights": configs[0].weights_label, "kv_cache": configs[0].kv_label},
                                        "rows": [row.to_dict() for row in rows], "runs": results}, indent=2, default=str))


def _count(limit: float | None) -> float | int | None:
    """lm-eval's limit: a whole number counts items, a fraction below 1 is a share of them."""
    return int(limit) if limit is not None and limit >= 1 else limit
