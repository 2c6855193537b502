"""The KV strategies side by side (``--preset kv``): every strategy and its main variants.

A variant is a KV strategy with some of its knobs set (``quantized-int4`` is ``quantized`` with
``kv_bits=4``); each becomes one configuration of the sweep per context, with the knobs in its
``kv_options``. Contexts longer than the default model's window run, when the preset asks for
it (``long_context="random"``), on a model with random weights of exactly the default model's
shape and ``max_position_embeddings`` raised to fit: speed and bytes are those of the real
model, the text is meaningless.

The table shows, per context and variant: prefill and decode tokens/s, the peak KV bytes per
tier, the logical bus traffic host -> device and device -> host, and the pages moved.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridllm.bench import report
from hybridllm.bench.sweep import BenchConfig, build_grid
from hybridllm.config import ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.units import format_bytes

# name -> (strategy, its knobs); the knobs not named keep their defaults.
KV_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic": ("dynamic", {}),
    "offloaded": ("offloaded", {}),
    "quantized-int8": ("quantized", {"kv_bits": 8}),
    "quantized-int4": ("quantized", {"kv_bits": 4}),
    "tiered": ("tiered", {}),  # hot window 512, page 128, cold pages in float32
    "tiered-cold4": ("tiered", {"kv_cold_bits": 4}),
    "host": ("host", {}),
}
LONG_CONTEXT_CHOICES = ("random", "skip")
HEADERS = ("context", "model", "KV cache", "prefill tok/s", "decode tok/s", "decode vs dynamic", "vs llama.cpp",
           "peak KV device", "peak KV host", "bus h2d", "bus d2h", "pages moved", "status")
# Our variant -> the llama.cpp KV type of the same bits (the "vs llama.cpp" column).
LLAMA_CPP_PEER = {"dynamic": "f16", "quantized-int8": "q8_0", "quantized-int4": "q4_0"}


def variant_name(kv_cache: str, kv_options: dict[str, Any]) -> str:
    """The variant a configuration runs: the one of ``kv_cache`` whose knobs it sets, most knobs first."""
    matches = [(len(knobs), name) for name, (strategy, knobs) in KV_VARIANTS.items()
               if strategy == kv_cache and all(kv_options.get(k) == v for k, v in knobs.items())]
    return max(matches)[1] if matches else kv_cache


def long_context_config(config: ModelConfig, max_positions: int) -> dict[str, Any]:
    """A Hugging Face ``config.json`` of ``config``'s shape with a window of ``max_positions`` tokens."""
    return {
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": max_positions, "tie_word_embeddings": config.tie_word_embeddings,
        "_name_or_path": f"random-{config.name or 'default'}-shape-ctx{max_positions}",
    }


def write_long_context_config(config: ModelConfig, max_positions: int, directory: Path | None = None) -> Path:
    """Write :func:`long_context_config` (same content for the same shape: the file is reused)."""
    folder = directory or Path(tempfile.gettempdir()) / "hybridllm-bench"
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9.]+", "-", config.name or "default").strip("-")  # a plain file name
    path = folder / f"random-{stem}-shape-ctx{max_positions}.json"
    path.write_text(json.dumps(long_context_config(config, max_positions), indent=2) + "\n")
    return path


def build_variant_grid(
    contexts: Sequence[int],
    variants: Sequence[str],
    decode_ons: Sequence[str | None] = (None,),
    n_gpu_layers: Sequence[int | None] = (None,),
    long_context: str = "skip",
    **common: Any,
) -> list[BenchConfig]:
    """One configuration of our engine per (context, variant), smallest context first.

    Args:
        contexts: prompt lengths in tokens.
        variants: names from ``KV_VARIANTS``.
        decode_ons: where decode runs, as in ``build_grid``.
        n_gpu_layers: layers on the device, as in ``build_grid``.
        long_context: "random": contexts beyond the default model's window run on a random-weights
            model of its shape; "skip": they become skipped rows.
        **common: the other ``BenchConfig`` fields (``kv_options`` is merged under each variant's knobs).
    """
    unknown = [v for v in variants if v not in KV_VARIANTS]
    if unknown:
        raise ConfigError(f"unknown KV variant {unknown[0]!r}; choose from {', '.join(KV_VARIANTS)}")
    if long_context not in LONG_CONTEXT_CHOICES:
        raise ConfigError(f"long_context must be one of {', '.join(LONG_CONTEXT_CHOICES)}, got {long_context!r}")
    base_options = dict(common.pop("kv_options", None) or {})
    default_config = None
    if long_context == "random" and common.get("model") is None and common.get("random_weights") is None:
        from hybridllm.loading.registry import open_checkpoint

        default_config = open_checkpoint(None).config  # the header only: the shape of the twin
    grid: list[BenchConfig] = []
    for context in sorted(set(contexts)):
        placed = dict(common)
        needed = context + common.get("new_tokens", 128)
        if default_config is not None and needed > default_config.max_position_embeddings:
            placed["random_weights"] = str(write_long_context_config(default_config, needed))
        for name in variants:
            strategy, knobs = KV_VARIANTS[name]
            grid += build_grid([context], [strategy], decode_ons, n_gpu_layers,
                               kv_options={**base_options, **knobs}, **placed)
    return grid


def row_variant(row: dict[str, Any]) -> str:
    """The table's name of a row's KV: our variant, or the peer and its KV type."""
    if row["engine"] != "hybridllm":
        return f"{row['engine']} {row['kv_cache']}"
    return variant_name(row["kv_cache"], row.get("kv_options") or {})


def row_label(row: dict[str, Any]) -> str:
    """The table's KV cell: the variant, and how it was attended where not by the kernels in place
    (a strategy they cannot read falls back visibly)."""
    attention = row.get("kv_attention")
    name = row_variant(row)
    return name if row["engine"] != "hybridllm" or attention in (None, "native") else f"{name} ({attention} attention)"


def _ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def records(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Cells of the table: one line per row, in the sweep's order; decode against our dynamic
    cache and against llama.cpp's KV of the same bits at the same context."""
    ok_rows = [r for r in rows if r["status"] == "ok"]
    dynamic = {r["context"]: r["decode_tps"] for r in ok_rows if r["engine"] == "hybridllm" and row_variant(r) == "dynamic"}
    peers = {(r["context"], r["kv_cache"]): r["decode_tps"] for r in ok_rows if r["engine"] == "llama.cpp"}
    out = []
    for row in rows:
        bus = row.get("bus_bytes_detail") or {}
        kv = row.get("kv_bytes") or {}
        ok = row["status"] == "ok"
        name = row_variant(row)
        ours = ok and row["engine"] == "hybridllm"
        peer = peers.get((row["context"], LLAMA_CPP_PEER.get(name)))
        out.append([
            report.fmt_context(row["context"]), row["model"], row_label(row),
            report.fmt_rate(row.get("prefill_tps")), report.fmt_rate(row.get("decode_tps")),
            _ratio(row.get("decode_tps"), dynamic.get(row["context"])) if ours else "-",
            _ratio(row.get("decode_tps"), peer) if ours else "-",
            format_bytes(kv.get("device")), format_bytes(kv.get("host")),
            format_bytes(bus.get("h2d")) if ok else "-", format_bytes(bus.get("d2h")) if ok else "-",
            "-" if row.get("kv_pages_moved") is None else str(row["kv_pages_moved"]),
            "ok" if ok else f"{row['status']}: {row.get('error') or ''}",
        ])
    return out


def title(settings: dict[str, Any]) -> str:
    """What every row of the table shares."""
    kv_options = settings.get("kv_options") or {}
    return (f"KV strategies: {settings.get('device', 'cpu')} as device, {settings.get('threads')} threads, "
            f"{settings.get('dtype', 'float32')}, {settings.get('new_tokens')} new tokens, VRAM budget "
            f"{kv_options.get('vram_budget') or 'none'}; bus bytes are logical moves between the device and host "
            "tiers over the whole request.")


def print_kv(rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> None:
    report.print_table(HEADERS, records(rows), title=title(settings))


def kv_markdown(rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    return title(settings) + "\n\n" + report.markdown(HEADERS, records(rows))
