"""A model's prefill with the AVX-512 VNNI panels on and off, alternating in one process.

    .venv/bin/python tools/panels_ab.py --model PATH [--tokens 2048] [--chunk 512] [--rounds 3]
        [--activations exact|int8] [--threads 2]

The panels (``kernels/dots_panels.h``) and the row kernels give the same bits; this times which is
faster on a real file's shapes: each round prefills ``--tokens`` random tokens into a fresh cache
(float16 KV) in chunks of ``--chunk``, once with the panels and once without (``hl_set_panels``),
and prints every round's tok/s and the ratio of the best of each. On a build without AVX-512 VNNI,
or with AMX tiles on, both runs take the same kernels.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridllm import LLM
from hybridllm.kernels.abi import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--activations", default="exact", choices=("exact", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, weights="auto", activations=args.activations, threads=args.threads,
              decode_backend="native", kv_dtype="float16")
    library = kernels()
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))  # (1, tokens)

    def prefill() -> float:
        cache = llm.new_cache()
        cache.reserve(args.tokens + 16)
        start = time.perf_counter()
        for first in range(0, args.tokens, args.chunk):
            llm.runner(ids[:, first:first + args.chunk], cache, first)
        return args.tokens / (time.perf_counter() - start)

    speeds: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        prefill()  # warm-up
        try:
            for _ in range(args.rounds):
                for on in (True, False):
                    library.hl_set_panels(int(on))
                    speeds[on].append(prefill())
        finally:
            library.hl_set_panels(1)
    for on, label in ((True, "panels"), (False, "row kernels")):
        print(f"{label}: {max(speeds[on]):.1f} tok/s (rounds: {', '.join(f'{s:.1f}' for s in speeds[on])})")
    print(f"panels / row kernels, best of {args.rounds}: {max(speeds[True]) / max(speeds[False]):.3f}x "
          f"({args.model}, {args.activations} activations, {args.tokens} tokens in chunks of {args.chunk})")


if __name__ == "__main__":
    main()
