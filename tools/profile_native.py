"""Where a native decode step spends its time, phase by phase (a layer's norm, q/k/v, attention ...).

    python tools/profile_native.py --context 512 [--steps 100] [--threads 2] [--batch 1] [--model PATH]

Builds the kernels with ``-DHL_PROFILE`` (thread 0 accumulates the time between the phases'
barriers with ``omp_get_wtime``; the default build has no timers), loads ``LLM(weights="auto")``
on it, prefills a random prompt of ``--context`` tokens and times ``--steps`` decode steps
(the runner on one token per sequence, ``--batch`` sequences in one call; no sampler). "between steps" is everything outside the kernel
call: the embedding lookup, the rotary tables, claiming the cache rows, Python.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from hybridllm import LLM
from hybridllm.kernels import build, native
from hybridllm.kvcache.batch import BatchedCaches

PHASES = ("between steps", "norm", "q/k/v", "rotary + cache write", "attention", "o_proj", "residual + norm",
          "gate/up", "SiLU", "down", "residual", "final norm", "head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (each its own cache)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16"))
    args = parser.parse_args()
    profiled = build.build_library(("-DHL_PROFILE",))
    native.load_decode_library = lambda: profiled  # build_native_steps builds its steps on this library
    llm = LLM(args.model, weights="auto", threads=args.threads, decode_backend="native", kv_dtype=args.kv_dtype)
    model = llm.runner
    if not model.report.build.whole_step:
        raise SystemExit(f"the model has no whole native decode step ({model.report.build.skipped})")
    caches = [llm.new_cache() for _ in range(args.batch)]
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.context), generator=seeded)
    token = torch.full((args.batch, 1), 5)  # (B, 1)
    with torch.inference_mode():
        for cache in caches:
            cache.reserve(args.context + args.steps + 16)
            for start in range(0, args.context, 512):
                model(ids[:, start:start + 512], cache, start)
        cache = BatchedCaches(caches)
        for _ in range(8):  # warm-up
            model(token, cache, cache.start_positions())
        profiled.library.hl_phase_seconds.restype = ctypes.POINTER(ctypes.c_double)
        seconds = profiled.library.hl_phase_seconds()
        for i in range(len(PHASES)):
            seconds[i] = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model(token, cache, cache.start_positions())
        wall = (time.perf_counter() - t0) / args.steps
    layers = llm.config.n_layers
    print(f"context {args.context}, {args.threads} threads, batch {args.batch}, weights auto: {wall * 1e3:.2f} ms/step "
          f"({args.batch / wall:.1f} tok/s) with the timers on")
    print("| phase | ms/step | us/layer | share |")
    print("| --- | --- | --- | --- |")
    for i, name in enumerate(PHASES):
        per_token = seconds[i] / args.steps
        per_layer = "" if name in ("between steps", "final norm", "head") else f"{per_token / layers * 1e6:.1f}"
        print(f"| {name} | {per_token * 1e3:.2f} | {per_layer} | {per_token / wall:.0%} |")


if __name__ == "__main__":
    main()
