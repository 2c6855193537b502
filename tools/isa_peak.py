"""This CPU's vector peaks, and the share of them a prefill target needs: the roofline of the
models preset's prefill line.

    .venv/bin/python tools/isa_peak.py [--threads 2] [--march native|x86-64-v3]
        [--models-json models-native.json] [--target 2.0]

Builds tools/isa_peak.cpp with the kernels' compiler and ``-march`` (``$HYBRIDLLM_KERNEL_MARCH``
as the kernels do), runs it on 1 and ``--threads`` threads (best of 3) and prints each
instruction's rate, then the peaks they set:
- integer dots (the quantized products): vpdpbusd on 512-bit registers (64 products each), else
  vpmaddubsw + vpaddw on 256 (32 each); ``--activations exact`` computes two input digits per
  value, so its peak is half the one-digit (``int8``) peak;
- float multiply-adds (the attention's scores and values): vfmadd on the widest registers.
With ``--models-json`` (a ``tools/models_bench.py --json`` file) it gives, per model, the time a
2K prefill's arithmetic takes at those peaks (products at the exact peak, attention at the FMA
peak), and what share of the peaks ``--target`` x llama.cpp's prefill in that run needs (above
100%: out of reach on this CPU however good the kernels) and what our prefill in that run reached.
A kernel only counts the operations named; loads, unpacking and the float steps around the dots
come on top, so these are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

# products per instruction, and which peak each instruction sets
INTEGER_DOTS = {"vpdpbusd_zmm": 64, "vpmaddubsw_vpaddw_ymm": 32}
FLOAT_FMAS = {"vfmadd_zmm": 16, "vfmadd_ymm": 8}


def build(march: str | None, folder: Path) -> Path:
    """tools/isa_peak.cpp compiled like the kernels (their compiler, their -march)."""
    from hybridllm.kernels import build as kernel_build

    compiler = kernel_build.find_compiler()
    flags = [f for f in kernel_build.default_flags(march) if f not in ("-shared", "-fPIC")]
    binary = folder / "isa_peak"
    done = subprocess.run([compiler, *flags, str(Path(__file__).with_name("isa_peak.cpp")), "-o", str(binary)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: isa_peak.cpp did not compile: {kernel_build._first_error(done.stderr)}")
    return binary


def rates(binary: Path, threads: int, iterations: int, best_of: int = 3) -> dict[str, float]:
    """instruction name -> the best of ``best_of`` runs' instructions per second on ``threads`` threads."""
    best: dict[str, float] = {}
    for _ in range(best_of):
        out = subprocess.run([str(binary), str(threads), str(iterations)], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            name, _, per_second, _ = line.split()
            best[name] = max(best.get(name, 0.0), float(per_second))
    return best


def peaks(rate: dict[str, float]) -> dict[str, float]:
    """int8_macs (one input digit), exact_macs (two) and fmas per second, from the widest instructions."""
    dots = next(rate[name] * n for name, n in INTEGER_DOTS.items() if name in rate)
    fmas = next(rate[name] * n for name, n in FLOAT_FMAS.items() if name in rate)
    return {"int8_macs": dots, "exact_macs": dots / 2, "fmas": fmas}


def mean_keys(prompt: int, window: int | None) -> float:
    """The mean number of keys a prompt's positions attend to (all before them, or their window)."""
    return sum(min(i + 1, window or prompt) for i in range(prompt)) / prompt


def prefill_work(config, prompt: int) -> tuple[float, float]:
    """(products, attention) multiply-adds per token of a ``prompt``-token prefill: the layers'
    q/k/v/o and gated MLP weights once per token; q.k and p.v over each layer's keys."""
    attention_weights = config.hidden_size * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
    products = config.n_layers * (attention_weights + 3 * config.hidden_size * config.intermediate_size)
    attention = sum(2 * config.n_heads * config.head_dim * mean_keys(prompt, config.layer_window(layer))
                    for layer in range(config.n_layers))
    return products, attention


def models_table(path: Path, peak: dict[str, float], target: float) -> str:
    from hybridllm.bench import models_preset
    from hybridllm.loading.gguf import GGUFFile
    from hybridllm.loading.local_models import model_name

    data = json.loads(path.read_text())
    by = {(r["model"], r["engine"], r["context"]): r
          for r in models_preset.best_of_rounds(data["rows"]) if r["status"] == "ok"}
    lines = [f"| model | products / attention per token (M multiply-adds) | 2K prefill at the peaks | "
             f"{target:g}x llama.cpp needs | ours reached |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, file in data["settings"]["files"].items():
        ours, peer = (by.get((model_name(Path(file)), engine, models_preset.PREFILL)) for engine in ("hybridllm", "llama.cpp"))
        if not ours or not peer:
            continue
        products, attention = prefill_work(GGUFFile(file).config, models_preset.PREFILL)
        floor_s = products / peak["exact_macs"] + attention / peak["fmas"]  # seconds per token, at the peaks
        needed = floor_s * target * peer["prefill_tps"]
        reached = floor_s * ours["prefill_tps"]
        lines.append(f"| {name} | {products / 1e6:.0f} / {attention / 1e6:.0f} | {1 / floor_s:.0f} tok/s | "
                     f"{needed:.0%} ({target * peer['prefill_tps']:.0f} tok/s) | {reached:.0%} "
                     f"({ours['prefill_tps']:.0f} tok/s) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--march", default=None, help="as HYBRIDLLM_KERNEL_MARCH (default: it, else native)")
    parser.add_argument("--iterations", type=int, default=200_000_000, help="per chain and thread (~0.3 s per instruction)")
    parser.add_argument("--models-json", type=Path, help="a tools/models_bench.py --json file")
    parser.add_argument("--target", type=float, default=2.0, help="the prefill ratio to llama.cpp to cost")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        binary = build(args.march, Path(folder))
        counts = sorted({1, args.threads})
        measured = {threads: rates(binary, threads, args.iterations) for threads in counts}
    march = args.march or os.environ.get("HYBRIDLLM_KERNEL_MARCH") or "native"
    print(f"-march={march}, instructions per second (G), best of 3:")
    print("| instruction | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in counts) + " |")
    print("| --- |" + " ---: |" * len(counts))
    for name in measured[counts[0]]:
        print(f"| {name} | " + " | ".join(f"{measured[t][name] / 1e9:.2f}" for t in counts) + " |")
    peak = peaks(measured[args.threads])
    print(f"\npeaks on {args.threads} threads: int8 products {peak['int8_macs'] / 1e9:.0f} GMAC/s, exact "
          f"(two digits) {peak['exact_macs'] / 1e9:.0f} GMAC/s, float {peak['fmas'] / 1e9:.0f} GFMA/s")
    if args.models_json:
        print("\n" + models_table(args.models_json, peak, args.target))


if __name__ == "__main__":
    main()
