#!/usr/bin/env python
"""Decode and prefill speed of hybridllm next to llama.cpp and transformers, measured in one run.

    .venv/bin/python bench/compare_peers.py --threads 2

Defaults: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF), prompts of exactly 16, 512 and
1500 tokens, 128 new tokens, greedy, end-of-sequence ignored. hybridllm and transformers run in
float32 on the CPU (both dequantize the same GGUF file); llama.cpp (llama-cpp-python, installed
by `make bench-peers`) runs the file as it is. Every configuration runs in its own process with
the same thread count, through the harness of `hybridllm bench` (same prompt ids, same method).

Prints a Markdown section (machine, command, date, table) ready for docs/benchmarks.md; writes it
with --markdown and the raw rows with --json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
from pathlib import Path

from hybridllm.bench import report
from hybridllm.bench.sweep import build_grid, parse_contexts, run_sweep
from hybridllm.units import format_bytes

HEADING = "## Foundation: decode and prefill vs llama.cpp and transformers (CPU, 2 threads)"
ENGINE_ORDER = {"hybridllm": 0, "llama.cpp": 1, "transformers": 2}
HEADERS = ("prompt tokens", "engine", "prefill tok/s", "TTFT", "decode tok/s", "decode vs llama.cpp", "TPOT p50",
           "TPOT p99", "peak host RSS", "status")


def table(rows: list[dict]) -> str:
    records, notes = [], []
    llama = {r["context"]: r.get("decode_tps") for r in rows if r["engine"] == "llama.cpp" and r["status"] == "ok"}
    for row in sorted(rows, key=lambda r: (r["context"], ENGINE_ORDER.get(r["engine"], 9))):
        ok = row["status"] == "ok"
        status = "ok"
        if not ok:
            notes.append(f"{row['engine']} at {row['context']} tokens: {row['status']}: {row['error']}")
            status = f"{row['status']} [{len(notes)}]"
        reference = llama.get(row["context"])
        ratio = f"{row['decode_tps'] / reference:.2f}x" if ok and reference and row.get("decode_tps") else "-"
        records.append([
            str(row["context"]), row["engine"],
            report.fmt_rate(row.get("prefill_tps"), row.get("prefill_tps_spread")),
            report.fmt_seconds(row.get("ttft_s")),
            report.fmt_rate(row.get("decode_tps"), row.get("decode_tps_spread")),
            ratio,
            report.fmt_seconds(row.get("tpot_p50_s")),
            report.fmt_seconds(row.get("tpot_p99_s")),
            format_bytes(row.get("peak_host_bytes")),
            status,
        ])
    text = report.markdown(HEADERS, records)
    return text + ("\n\n" + "\n".join(f"[{i}] {n}" for i, n in enumerate(notes, 1)) if notes else "")


def section(rows: list[dict], machine: dict, command: str, args: argparse.Namespace, started: dt.datetime,
            load: tuple[float, float]) -> str:
    versions = ", ".join(f"{k} {machine[k]}" for k in ("torch", "transformers", "llama-cpp-python"))
    variants = sorted({f"{r['engine']}: {r['variant']}" for r in rows if r.get("variant")})
    lines = [
        HEADING,
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC with:",
        "",
        "```",
        command,
        "```",
        "",
        (f"- machine: {machine['cpu']}, {machine['cores']} cores, {format_bytes(machine['ram_bytes'], 0)} RAM, "
         f"{'GPU ' + machine['gpu'] if machine['gpu'] else 'no GPU'}; {machine['os']}"),
        f"- software: Python {machine['python']}, {versions}",
        (f"- 1-minute load average of the machine (other work included): {load[0]:.2f} at the start, "
         f"{load[1]:.2f} at the end"),
        (f"- model: {rows[0]['model'] if rows else '?'}; {args.threads} threads for every engine; "
         f"{args.new_tokens} new tokens, greedy, end-of-sequence ignored; median of {args.repeat} run(s) after a "
         "warm-up (± is half the spread); each configuration in its own process"),
        ("- hybridllm and transformers dequantize the GGUF file to float32 (transformers: manual greedy loop with "
         "its DynamicCache); llama.cpp runs the Q4_1 file as it is"),
        f"- engines: {'; '.join(variants) if variants else 'hybridllm'}",
        "- prefill tok/s = prompt tokens / TTFT; decode tok/s = 1 / mean time between later tokens",
        "",
        table(rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="16,512,1500", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the Markdown section here")
    args = parser.parse_args(argv)

    started = dt.datetime.now(dt.UTC)
    load_start = os.getloadavg()[0]
    command = shlex.join(["python", "bench/compare_peers.py", *(sys.argv[1:] if argv is None else argv)])
    grid = build_grid(parse_contexts(args.contexts), ["dynamic"], [None], [None], ["llama.cpp", "transformers"],
                      model=args.model, new_tokens=args.new_tokens, repeat=args.repeat, threads=args.threads,
                      device="cpu", dtype="float32")
    rows = run_sweep(grid, timeout_s=args.timeout)
    machine = report.machine_info()
    text = section(rows, machine, command, args, started, (load_start, os.getloadavg()[0]))
    print(text)
    if args.json is not None:
        report.write_json(rows, args.json, {"command": command, **vars(args) | {"json": str(args.json),
                                                                                 "markdown": str(args.markdown)}},
                          machine)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
