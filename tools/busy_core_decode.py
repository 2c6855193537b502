#!/usr/bin/env python
"""Decode speed with one core taken by another process, as a share of the idle speed.

    .venv/bin/python tools/busy_core_decode.py [--threads 2] [--context 256] [--rounds 3] [--model PATH]

Loads ``LLM(threads=...)`` (native decode), prefills a random ``--context``-token prompt, then
each round times decode steps (batch 1, the runner on one token) with the machine as it is, then
with a busy loop pinned to the last usable CPU (a child process, ``os.sched_setaffinity``; it is
killed at the end of the round). The engine picks its threads at run time
(``hybridllm.kernels.threads``), so each loaded run decodes for ``--settle`` seconds before it is
timed. Prints tok/s for both and their ratio per round (issue 20 asks for >= 40%). Short
measurements on a shared machine are noisy: compare rounds, and run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from hybridllm import LLM

BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def decode_rate(llm: LLM, ids: torch.Tensor, steps: int, settle_s: float) -> float:
    """Decode tok/s over ``steps`` steps after ``settle_s`` seconds of untimed steps."""
    cache = llm.new_cache()
    with torch.inference_mode():
        llm.runner(ids, cache, 0)
        token = torch.tensor([[42]])
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < settle_s:
            llm.runner(token, cache, cache.seq_length)
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.runner(token, cache, cache.seq_length)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=1.5, help="seconds of untimed decode before each timing")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, threads=args.threads)
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, args.context),
                        generator=torch.Generator().manual_seed(0))
    core = max(os.sched_getaffinity(0))
    for round_ in range(1, args.rounds + 1):
        idle = decode_rate(llm, ids, args.steps, args.settle)
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])
        try:
            loaded = decode_rate(llm, ids, args.steps, args.settle)
        finally:
            busy.kill()
            busy.wait()
        print(f"round {round_}: idle {idle:.1f} tok/s, CPU {core} busy {loaded:.1f} tok/s, "
              f"ratio {loaded / idle:.0%} ({args.threads} threads, {args.context}-token context)", flush=True)


if __name__ == "__main__":
    main()
