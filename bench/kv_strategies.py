#!/usr/bin/env python
"""Every KV cache strategy side by side: decode speed, peak KV bytes per tier, bus traffic.

    .venv/bin/python bench/kv_strategies.py                      # contexts 1K, 4K, 16K (~15 min, 2 cores)
    .venv/bin/python bench/kv_strategies.py --contexts 256       # a smoke run (~1 min)

Defaults: the CPU stands in for the device (so "device" bytes are what the ledger put in the
device tier, and bus bytes are logical moves), 2 threads, float32, greedy, end-of-sequence
ignored, random prompt ids (seeded). Contexts up to the default model's window (8,192 tokens)
run on the default model (SmolLM2-135M-Instruct, dequantized to float32). Longer contexts run,
with ``--long-context random`` (the default), on a Llama with random weights of exactly the
default model's shape and ``max_position_embeddings`` raised to fit; with ``--long-context
skip`` they are reported as not possible for this model. The "model" column says which.

Each strategy runs one request per context in this process (the model is loaded once per
model); decode tok/s is over the new tokens after the first. Prints a Markdown table; --json
writes the raw rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridllm import LLM, SamplingParams
from hybridllm.bench import report
from hybridllm.config import KVConfig, ModelConfig
from hybridllm.loading.registry import open_checkpoint
from hybridllm.units import format_bytes

# name -> KV options (the CLI flags in snake case); the knobs not named keep their defaults.
STRATEGIES: dict[str, dict[str, Any]] = {
    "dynamic": {"kv_cache": "dynamic"},
    "offloaded": {"kv_cache": "offloaded"},
    "quantized-int8": {"kv_cache": "quantized", "kv_bits": 8},
    "quantized-int4": {"kv_cache": "quantized", "kv_bits": 4},
    "tiered": {"kv_cache": "tiered"},  # hot window 512, page 128, cold pages in float32
    "tiered-cold4": {"kv_cache": "tiered", "kv_cold_bits": 4},
    "host": {"kv_cache": "host"},
}
DEFAULT_WINDOW = 8192
HEADERS = ("context", "model", "KV cache", "prefill tok/s", "decode tok/s", "peak KV device", "peak KV host",
           "bus h2d", "bus d2h", "pages moved", "status")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,16384", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"any of {', '.join(STRATEGIES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--vram-budget", default=None, help="device budget for every strategy (e.g. 700MB)")
    parser.add_argument("--long-context", choices=("random", "skip"), default="random",
                        help="contexts beyond the default model's window: random-weights model of its shape, or skip")
    parser.add_argument("--json", type=Path, default=None, help="write the raw rows here")
    args = parser.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    return args


def hf_config(config: ModelConfig, max_positions: int) -> dict[str, Any]:
    """A Hugging Face config.json of ``config``'s shape with a longer context window."""
    return {
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": max_positions, "tie_word_embeddings": config.tie_word_embeddings,
        "_name_or_path": f"random-{config.name or 'default'}-shape-ctx{max_positions}",
    }


def load(args: argparse.Namespace, context: int, default_config: ModelConfig, workdir: Path
         ) -> tuple[LLM | None, str]:
    """The model for a context: the default model when it fits, else a random-weights twin (or None)."""
    options = dict(threads=args.threads, dtype="float32", prefill_chunk=args.prefill_chunk)
    if context + args.new_tokens <= DEFAULT_WINDOW:
        return LLM(show_progress=False, **options), "SmolLM2-135M (default)"
    if args.long_context == "skip":
        return None, f"default model: window {DEFAULT_WINDOW} < {context + args.new_tokens}"
    from hybridllm.bench.random_weights import random_llm

    path = workdir / f"ctx{context}.json"
    path.write_text(json.dumps(hf_config(default_config, context + args.new_tokens)))
    return random_llm(path, **options), "random weights, SmolLM2-135M shape"


def measure(llm: LLM, strategy: str, context: int, args: argparse.Namespace) -> dict[str, Any]:
    """One request with ``strategy``: the figures of the table."""
    llm.kv_config = KVConfig(**STRATEGIES[strategy], vram_budget=args.vram_budget)  # read by llm.new_cache
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, llm.config.vocab_size, (context,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    metrics = llm.generate(prompt, params).metrics
    bus = metrics.get("bus_bytes_detail", {})
    return {
        "context": context, "kv_cache": strategy, "status": "ok", "wall_s": time.perf_counter() - started,
        "prefill_tps": metrics.get("prefill_tps"), "decode_tps": metrics.get("decode_tps"),
        "kv_peak_device": metrics["kv_peak_bytes"]["device"], "kv_peak_host": metrics["kv_peak_bytes"]["host"],
        "bus_h2d": bus.get("h2d", 0), "bus_d2h": bus.get("d2h", 0), "pages_moved": metrics.get("kv_pages_moved"),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    default_config = open_checkpoint(None).config  # the header only: the shape of any random twin
    rows: list[dict[str, Any]] = []
    loaded_key, llm, label = None, None, ""
    with tempfile.TemporaryDirectory() as tmp:
        for context in sorted(args.contexts):
            key = "default" if context + args.new_tokens <= DEFAULT_WINDOW else f"random{context}"
            if key != loaded_key:
                llm = None  # free the previous model first
                llm, label = load(args, context, default_config, Path(tmp))
                loaded_key = key
            if llm is not None:  # warm-up at this prefill shape: first-call costs stay out of the figures
                llm.kv_config = KVConfig()
                warm = [i % llm.config.vocab_size for i in range(min(context, args.prefill_chunk))]
                llm.generate(warm, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            for strategy in args.strategies:
                if llm is None:
                    rows.append({"context": context, "kv_cache": strategy, "model": label, "status": "not possible",
                                 "error": label})
                    continue
                print(f"[{context} tokens] {strategy} ...", file=sys.stderr, flush=True)
                try:
                    row = measure(llm, strategy, context, args)
                except Exception as exc:  # a benchmark reports a failure and goes on
                    row = {"context": context, "kv_cache": strategy, "status": "error", "error": repr(exc)}
                row["model"] = label
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    records = []
    for row in rows:
        ok = row["status"] == "ok"
        records.append([
            report.fmt_context(row["context"]), row["model"], row["kv_cache"],
            report.fmt_rate(row.get("prefill_tps")), report.fmt_rate(row.get("decode_tps")),
            format_bytes(row.get("kv_peak_device")), format_bytes(row.get("kv_peak_host")),
            format_bytes(row.get("bus_h2d")), format_bytes(row.get("bus_d2h")),
            str(row.get("pages_moved", "-")), "ok" if ok else f"{row['status']}: {row.get('error', '')}",
        ])
    return report.markdown(HEADERS, records)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print(f"KV strategies: CPU as device, {args.threads} threads, float32, {args.new_tokens} new tokens, "
          f"prefill chunk {args.prefill_chunk}, VRAM budget {args.vram_budget or 'none'}; bus bytes are logical "
          f"moves between the device and host tiers over the whole request.\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
