"""Ours vs llama.cpp vs transformers on the models people run: real shapes as Q4_K_M files.

Builds (once, into --folder) a GGUF file of each published config in configs/ with random weights,
quantized to Q4_K_M by llama.cpp's own quantizer (hybridllm.bench.model_files), then measures
every engine on each (hybridllm.bench.models_preset): decode at 512 and 8K (or the window), prefill
at 2K, resident weights against the file's tensor bytes, peak RSS against llama.cpp's.

    .venv/bin/python tools/models_bench.py --threads 2 [--models qwen2.5-0.5b,gemma-3-270m]
        [--baseline llama.cpp,transformers] [--new-tokens 64] [--repeat 1] [--rounds 1] [--json out.json]
        [--markdown out.md] [--folder ~/.cache/hybridllm/models] [--kv-dtype float16]
        [--activations int8]

Run it on a quiet machine (each configuration runs in its own process; the ratios compare engines
measured in the same run). ``HYBRIDLLM_KERNEL_MARCH=x86-64-v3`` measures the AVX2 build.
``--rounds N`` runs the whole grid N times (the engines alternate, each configuration in a fresh
process every round); the table takes each cell's best speed and worst peak RSS over the rounds
(``models_preset.best_of_rounds``), the JSON keeps every round's row. Before each round and after
every row the parent reads 256 MiB (``hardware.measure_host_read``, --threads threads): each
row keeps the memory's read rate before and after it (``memory_read_gbs``), the Markdown header
their range, since a VM's memory can change speed between the engines' runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path


def main() -> None:
    from hybridllm.bench import models_preset, report
    from hybridllm.bench.sweep import run_sweep
    from hybridllm.hardware import measure_host_read

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models_preset.MODELS))
    parser.add_argument("--configs", default=str(Path(__file__).resolve().parents[1] / "configs"))
    parser.add_argument("--folder", default="~/.cache/hybridllm/models")
    parser.add_argument("--baseline", default="llama.cpp,transformers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="generations per process")
    parser.add_argument("--rounds", type=int, default=1, help="runs of the whole grid (fresh processes)")
    parser.add_argument("--kv-dtype", default="float16", help="our KV storage (llama.cpp's default cache is f16)")
    parser.add_argument("--activations", default="exact", help="our products' input rounding: exact or int8")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    baselines = [b.strip() for b in args.baseline.split(",") if b.strip() and b.strip() != "none"]
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    load_start = os.getloadavg()[0]
    files = models_preset.model_files(names, args.configs, args.folder)
    grid = models_preset.models_grid(files, baselines, new_tokens=args.new_tokens, threads=args.threads,
                                     repeat=args.repeat, weights="auto", kv_options={"kv_dtype": args.kv_dtype},
                                     llm_options={"activations": args.activations})
    command = "HYBRIDLLM_KERNEL_MARCH=" + os.environ.get("HYBRIDLLM_KERNEL_MARCH", "native") + " " + \
        " ".join(shlex.quote(a) for a in [".venv/bin/python", "tools/models_bench.py", *sys.argv[1:]])
    machine = report.machine_info()
    done: list[dict] = []

    def write(rows: list[dict]) -> None:
        """The JSON and Markdown of the rows so far (after every row: an interrupted run keeps them)."""
        settings = {"command": command, "started": started, "load_average": [load_start, os.getloadavg()[0]],
                    "machine": machine, "files": {n: str(p) for n, p in files.items()}}
        if args.json:
            Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
        if args.markdown:
            Path(args.markdown).write_text(
                f"Measured {started[:16].replace('T', ' ')} UTC on {machine['cpu']}, {machine['cores']} cores "
                f"(load average {load_start:.2f} at the start, {settings['load_average'][1]:.2f} at the end"
                + (f"; each cell the best of {args.rounds} rounds" if args.rounds > 1 else "")
                + (f"; {note}" if (note := models_preset.memory_note(rows)) else "") + "):\n\n"
                f"```\n{command}\n```\n\n" + models_preset.table_markdown(rows, files) + "\n")

    last_read = 0.0  # the memory's read rate measured last (GB/s): the next row's "before"

    def on_row(round_number: int, row: dict) -> None:
        nonlocal last_read
        before, last_read = last_read, measure_host_read(threads=args.threads)
        done.append({**row, "round": round_number, "memory_read_gbs": [before, last_read]})
        write(done)

    for round_number in range(1, args.rounds + 1):  # on_row writes the files after every row
        last_read = measure_host_read(threads=args.threads)
        run_sweep(grid, progress=True, on_row=functools.partial(on_row, round_number))
    rows = done
    if not rows:  # an empty grid still writes its (empty) files
        write(rows)
    models_preset.print_models(rows, files)


if __name__ == "__main__":
    main()
