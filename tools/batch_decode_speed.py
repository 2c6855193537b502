#!/usr/bin/env python
"""Aggregate decode tok/s of B sequences decoded together (one native call per step) vs one.

    .venv/bin/python tools/batch_decode_speed.py [--batches 1,16,64] [--threads 2] [--context 64] [--model PATH] [--no-amx]

Each of B sequences gets its own cache with the same random ``--context``-token prompt, then
``--steps`` decode steps run for all of them at once through the runner (a ``BatchedCaches``,
as the scheduler does); prints B x steps / seconds per batch size. The thread count is held at
``--threads`` (the run-time policy is bypassed) so that the figures compare the kernels, not the
machine's load; short runs on a shared machine are noisy. ``--no-amx`` turns the AMX tiles off
(the vector kernels then compute every batch: the same results, for comparing rates).
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridllm import LLM
from hybridllm.kernels import native
from hybridllm.kernels.threads import FixedTeam
from hybridllm.kvcache.batch import BatchedCaches


def aggregate_rate(llm: LLM, batch: int, context: int, steps: int) -> float:
    caches = [llm.new_cache() for _ in range(batch)]
    ids = torch.randint(0, min(llm.config.vocab_size, 20000), (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for cache in caches:
            llm.runner(ids, cache, 0)
        rows = BatchedCaches(caches)
        tokens = torch.full((batch, 1), 42)  # (B, 1)
        for _ in range(3):  # warm-up
            llm.runner(tokens, rows, rows.start_positions())
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.runner(tokens, rows, rows.start_positions())
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--model", default=None)
    parser.add_argument("--no-amx", action="store_true", help="the vector kernels for every batch")
    args = parser.parse_args()
    llm = LLM(args.model, threads=args.threads)
    tiles = native.kernels().hl_set_amx(0 if args.no_amx else 1)
    print(f"AMX tiles: {'on' if tiles else 'off'} (kernels {native.kernel_isa()})", flush=True)
    team = llm.runner.backend.steps.team
    if team is not None:
        team.policy = FixedTeam()
    for batch in (int(b) for b in args.batches.split(",")):
        rate = aggregate_rate(llm, batch, args.context, args.steps)
        print(f"batch {batch}: {rate:.1f} tok/s aggregate ({args.threads} threads, {args.context}-token context)",
              flush=True)


if __name__ == "__main__":
    main()
