"""Time and profile decode steps of the default model (or any model) at a given context.

    python tools/profile_decode.py --context 512 --threads 2 --variants base,fuse
    python tools/profile_decode.py --context 8192 --profile --variants fuse
    python tools/profile_decode.py --context 512 --variants fuse,fuse+compile
    python tools/profile_decode.py --context 512 --variants fuse,fuse+native

Each variant loads its own copy of the model (``LLM(weights=...)``), prefills a random prompt of
``--context`` tokens, and then times ``--steps`` greedy decode steps (``model.forward`` on one
token through the runner, argmax; no tokenizer, no sampler) ``--rounds`` times, interleaving the variants so that
the noise of a shared machine falls on all of them alike. Prints the best and the median
ms/token per variant. ``--profile`` adds a torch.profiler table of one round per variant and
a per-category breakdown (matmuls, attention, elementwise, casts, ...).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridllm import LLM

CATEGORIES = {
    "int4 matmul": ("_weight_int4pack_mm",),
    "int8 matmul (head)": ("_weight_int8pack_mm",),
    "float matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("flash_attention", "scaled_dot_product"),
    "casts/copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone"),
    "compiled graphs": ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph"),
}


def build(args: argparse.Namespace, variant: str):
    # each variant: stacked projections or not (a load option), and its decode backend
    parts = set(variant.split("+"))
    backend = "native" if "native" in parts else "compiled" if "compile" in parts else "eager"
    t0 = time.perf_counter()
    llm = LLM(weights=args.weights, threads=args.threads, kv_cache=args.kv_cache, fuse="fuse" in parts,
              decode_backend=backend, **_kv_options(args))
    model = llm.runner
    cache = llm.new_cache()
    cache.reserve(args.context + args.steps * (args.rounds + 2) + 8)
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.context), generator=seeded)
    with torch.inference_mode():
        for start in range(0, args.context, 512):
            model(ids[:, start:start + 512], cache, cache.seq_length)
        token = torch.tensor([[5]])
        for _ in range(3):  # warm-up (and compilation of the decode graph)
            token = model(token, cache, cache.seq_length)[:, -1].argmax(-1, keepdim=True)
    setup_s = time.perf_counter() - t0
    return model, cache, token, setup_s


def _kv_options(args: argparse.Namespace) -> dict:
    return {"kv_bits": args.kv_bits} if args.kv_cache == "quantized" else {}


def decode_steps(model, cache, token, steps: int) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache, cache.seq_length)[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / steps, token


def categorize(events, steps: int) -> dict[str, float]:
    """ms per token of the profiler's self CPU time, per category."""
    out = {name: 0.0 for name in CATEGORIES}
    out["other aten ops"] = 0.0
    for event in events:
        self_ms = event.self_cpu_time_total / 1e3 / steps
        for name, keys in CATEGORIES.items():
            if any(k in event.key for k in keys):
                out[name] += self_ms
                break
        else:
            if event.key.startswith("aten::"):
                out["other aten ops"] += self_ms
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--kv-cache", default="dynamic")
    parser.add_argument("--kv-bits", type=int, default=8)
    parser.add_argument("--variants", default="base,fuse", help="comma-separated: base, fuse, fuse+compile, fuse+native (native decode kernels; they need fused layers)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    variants = args.variants.split(",")
    built = {v: build(args, v) for v in variants}
    for v, (_, _, _, setup_s) in built.items():
        print(f"{v}: transforms + prefill + warm-up {setup_s:.1f} s")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            model, cache, token, setup_s = built[v]
            dt, token = decode_steps(model, cache, token, args.steps)
            built[v] = (model, cache, token, setup_s)
            times[v].append(dt)
    print(f"context {args.context}, {args.threads} threads, weights {args.weights}, kv {args.kv_cache}")
    for v in variants:
        best, median = min(times[v]), statistics.median(times[v])
        print(f"{v:>16}: best {best * 1e3:6.2f} ms/token ({1 / best:6.1f} tok/s), median {median * 1e3:6.2f} ms "
              f"({1 / median:6.1f} tok/s)")
    if args.profile:
        for v in variants:
            model, cache, token, _ = built[v]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                dt, token = decode_steps(model, cache, token, args.steps)
            events = prof.key_averages()
            print(f"\n== {v}: profiled {dt * 1e3:.2f} ms/token (profiler on)")
            print(events.table(sort_by="self_cpu_time_total", row_limit=18))
            total_ops = sum(e.count for e in events if e.key.startswith("aten::"))
            print(f"aten op calls per token (nested included): {total_ops / args.steps:.0f}")
            for name, ms in categorize(events, args.steps).items():
                print(f"  {name:>20}: {ms:6.2f} ms/token")
            ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
            print(f"  {'ops total':>20}: {ops_ms:6.2f} ms/token; outside ops (Python, dispatch): "
                  f"{dt * 1e3 - ops_ms:6.2f} ms/token")


if __name__ == "__main__":
    main()
