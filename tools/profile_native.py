"""Where a native decode step (or a prefill) spends its time, phase by phase (a layer's norm, q/k/v, attention ...).

    python tools/profile_native.py --context 512 [--steps 100] [--threads 2] [--batch 1] [--model PATH]
    python tools/profile_native.py --prefill 2048 [--chunk 512] [--repeat 2] [--model PATH]

Builds the kernels with ``-DHL_PROFILE`` (thread 0 accumulates the time between the phases'
barriers with ``omp_get_wtime``; the default build has no timers), loads ``LLM(weights="auto")``
on it, prefills a random prompt of ``--context`` tokens and times ``--steps`` decode steps
(the runner on one token per sequence, ``--batch`` sequences in one call; no sampler). "between steps" is everything outside the kernel
call: the embedding lookup, the rotary tables, claiming the cache rows, Python.

``--prefill N`` times instead a prefill of N random tokens in chunks of ``--chunk`` (a fresh cache
each of ``--repeat`` times, after one untimed prefill), by the same phases; "between steps" is
then the time between the chunks' kernel calls.
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
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill of this many tokens instead")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (with --prefill)")
    parser.add_argument("--repeat", type=int, default=2, help="timed prefills (with --prefill)")
    args = parser.parse_args()
    profiled = build.build_library(("-DHL_PROFILE",))
    native.load_decode_library = lambda: profiled  # build_native_steps builds its steps on this library
    llm = LLM(args.model, weights="auto", threads=args.threads, decode_backend="native", kv_dtype=args.kv_dtype)
    model = llm.runner
    if not model.report.build.whole_step:
        raise SystemExit(f"the model has no whole native decode step ({model.report.build.skipped})")
    profiled.library.hl_phase_seconds.restype = ctypes.POINTER(ctypes.c_double)
    seconds = profiled.library.hl_phase_seconds()
    seeded = torch.Generator().manual_seed(0)
    if args.prefill:
        wall, label = time_prefill(llm, seconds, seeded, args)
    else:
        wall, label = time_decode(llm, seconds, seeded, args)
    layers = llm.config.n_layers
    print(label)
    unit = "prefill" if args.prefill else "step"
    print(f"| phase | ms/{unit} | us/layer | share |")
    print("| --- | --- | --- | --- |")
    runs = args.repeat if args.prefill else args.steps
    for i, name in enumerate(PHASES):
        per_run = seconds[i] / runs  # per step, or per prefill
        per_layer = "" if name in ("between steps", "final norm", "head") else f"{per_run / layers * 1e6:.1f}"
        print(f"| {name} | {per_run * 1e3:.2f} | {per_layer} | {per_run / wall:.0%} |")


def prefill_chunks(model, ids: torch.Tensor, cache, chunk: int) -> None:
    """ids (1, N) into ``cache`` through the runner, ``chunk`` positions per call."""
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start:start + chunk], cache, start)


def reset(seconds) -> None:
    for i in range(len(PHASES)):
        seconds[i] = 0.0


def time_decode(llm, seconds, seeded: torch.Generator, args) -> tuple[float, str]:
    """Seconds per decode step of ``args.batch`` sequences at ``args.context`` (timers summed into ``seconds``)."""
    model = llm.runner
    caches = [llm.new_cache() for _ in range(args.batch)]
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.context), generator=seeded)
    token = torch.full((args.batch, 1), 5)  # (B, 1)
    with torch.inference_mode():
        for cache in caches:
            cache.reserve(args.context + args.steps + 16)
            prefill_chunks(model, ids, cache, 512)
        cache = BatchedCaches(caches)
        for _ in range(8):  # warm-up
            model(token, cache, cache.start_positions())
        reset(seconds)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model(token, cache, cache.start_positions())
        wall = (time.perf_counter() - t0) / args.steps
    return wall, (f"context {args.context}, {args.threads} threads, batch {args.batch}, weights auto: "
                  f"{wall * 1e3:.2f} ms/step ({args.batch / wall:.1f} tok/s) with the timers on")


def time_prefill(llm, seconds, seeded: torch.Generator, args) -> tuple[float, str]:
    """Seconds per prefill of ``args.prefill`` tokens in chunks of ``args.chunk`` (timers summed into ``seconds``)."""
    model = llm.runner
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.prefill), generator=seeded)  # (1, N)

    def prefill() -> None:
        cache = llm.new_cache()
        cache.reserve(args.prefill + 16)
        prefill_chunks(model, ids, cache, args.chunk)

    with torch.inference_mode():
        prefill()  # warm-up
        reset(seconds)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            prefill()
        wall = (time.perf_counter() - t0) / args.repeat
    return wall, (f"prefill of {args.prefill} tokens in chunks of {args.chunk}, {args.threads} threads, weights auto: "
                  f"{wall * 1e3:.1f} ms ({args.prefill / wall:.1f} tok/s) with the timers on")


if __name__ == "__main__":
    main()
