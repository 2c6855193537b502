#!/usr/bin/env python
"""Load test of ``hybridllm serve``: a bounded burst of chat requests over loopback.

    .venv/bin/python tools/load_test.py --max-batch 16          # starts its own server, then stops it
    .venv/bin/python tools/load_test.py --max-batch 1           # the same load without batching
    .venv/bin/python tools/load_test.py --url http://127.0.0.1:8000 --model NAME   # an already running server
    .venv/bin/python tools/load_test.py --compare 3 --concurrency 64   # batched vs one at a time, 3 rounds each

Defaults: 64 requests, 16 in flight at once, 32 new tokens each (greedy, end-of-sequence
ignored, so every request generates exactly that many), 16 different chat prompts in turn,
streamed so time to first token is measured. ``--warmup-burst`` first sends one unmeasured burst
of the same shape (a ``--decode-backend cuda-graph`` server captures its graphs there). Bounded:
at most 256 requests and 64 in flight, a total time limit (``--time-limit``), and loopback
addresses only.

Prints requests/s, generated tokens/s, TTFT and latency percentiles and the failure count;
``--json`` writes them. Exits 1 if any request failed.

``--compare N`` runs the burst N times each way, alternating, each on a fresh server: all
``--concurrency`` requests in flight at once (``--max-batch`` = the concurrency), and one at a
time (``--concurrency 1 --max-batch 1``); it prints every round and the ratio of the median
throughputs (alternating keeps a machine whose speed drifts from favouring either side).

``--profile DIR`` samples the server this script started with py-spy during each measured burst
(``hybridllm.bench.spy``: the Python that held the GIL, per thread) and writes the raw samples
and a summary per burst under DIR; without py-spy it says so and measures as usual.

The requests and the server start are ``hybridllm.bench.serve_load``'s (``bench --preset spec``
uses them too); this file is their command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hybridllm.bench.spy import Sampler, summarize
from hybridllm.bench.serve_load import (
    LOOPBACK,
    MAX_CONCURRENCY,
    MAX_REQUESTS,
    ServerStartError,
    run_load,
    start_server,
    stop_server,
    warm_up,
)


def burst(args: argparse.Namespace, concurrency: int, max_batch: int, label: str = "burst") -> dict[str, Any]:
    """One burst against ``args.url``, or against a server started (and stopped) for it (sampled
    by py-spy into ``args.profile``/``label``.* with ``--profile``)."""
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        try:
            proc, url = start_server(args.serve_arg, args.threads, max_batch, max(256, args.requests))
        except ServerStartError as exc:
            raise SystemExit(str(exc)) from None
    try:
        model = warm_up(url, args.model)
        if args.warmup_burst:  # the burst's own shape once, not measured: every batch size and length seen
            asyncio.run(run_load(url, model, concurrency, concurrency, args.max_tokens, args.time_limit))
        sampler = Sampler(proc.pid, args.profile / f"{label}.raw") if args.profile and proc else None
        with sampler or contextlib.nullcontext():
            result = asyncio.run(run_load(url, model, args.requests, concurrency, args.max_tokens, args.time_limit))
        if sampler is not None and sampler.error is None:
            summary = args.profile / f"{label}.txt"
            summary.write_text(summarize(sampler.path))
            result["profile"] = str(summary)
        elif sampler is not None:
            result["profile_error"] = sampler.error
            print(f"no profile of {label}: {sampler.error}", file=sys.stderr)
    finally:
        if proc is not None:
            stop_server(proc)
    result["max_batch"] = max_batch if proc is not None else None
    return result


def print_result(result: dict[str, Any]) -> None:
    print(f"requests:          {result['succeeded']}/{result['requests']} ok, {result['failed']} failed "
          f"({result['concurrency']} concurrent, {result['max_tokens']} new tokens each)")
    print(f"wall time:         {result['wall_s']:.1f} s (the client used {result['client_cpu_s']:.1f} s of CPU)")
    print(f"throughput:        {result['requests_per_s']:.2f} requests/s, "
          f"{result['generated_tokens_per_s']:.1f} generated tokens/s")
    print(f"TTFT p50 / p99:    {result['ttft_p50_s']:.2f} / {result['ttft_p99_s']:.2f} s")
    print(f"latency p50 / p99: {result['latency_p50_s']:.2f} / {result['latency_p99_s']:.2f} s")
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """``--compare N``: batched and one-at-a-time bursts, alternating, and their throughput ratio."""
    rounds: dict[str, list[dict[str, Any]]] = {"batched": [], "one_at_a_time": []}
    for i in range(args.compare):
        for name, concurrency, max_batch in (("batched", args.concurrency, args.concurrency),
                                             ("one_at_a_time", 1, 1)):
            result = burst(args, concurrency, max_batch, f"{name}-{i + 1}")
            rounds[name].append(result)
            print(f"round {i + 1} {name:>14}: {result['wall_s']:6.2f} s, "
                  f"{result['generated_tokens_per_s']:7.1f} generated tok/s, {result['failed']} failed", flush=True)
    medians = {name: statistics.median(r["generated_tokens_per_s"] for r in runs) for name, runs in rounds.items()}
    failed = sum(r["failed"] for runs in rounds.values() for r in runs)
    errors = [error for runs in rounds.values() for r in runs for error in r["errors"]]
    if not medians["one_at_a_time"]:  # nothing generated one at a time: no ratio to give
        ratio = None
        print(f"median generated tok/s: {medians['batched']:.1f} with {args.concurrency} in flight, none one at "
              f"a time: no ratio; {failed} failed requests" + (f" (first error: {errors[0]})" if errors else ""))
    else:
        ratio = medians["batched"] / medians["one_at_a_time"]
        print(f"median generated tok/s: {medians['batched']:.1f} with {args.concurrency} in flight, "
              f"{medians['one_at_a_time']:.1f} one at a time: {ratio:.2f}x; {failed} failed requests")
    return {"rounds": rounds, "median_tokens_per_s": medians, "ratio": ratio, "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (loopback only); default: start one")
    parser.add_argument("--model", help="model id (default: the server's first model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=1200.0, help="seconds for the whole burst")
    parser.add_argument("--max-batch", type=int, default=16, help="--max-batch of the server this script starts")
    parser.add_argument("--threads", type=int, default=2, help="--threads of the server this script starts")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `hybridllm serve` argument")
    parser.add_argument("--compare", type=int, default=0, metavar="N",
                        help="N rounds of the burst with --concurrency in flight vs one at a time (fresh servers)")
    parser.add_argument("--warmup-burst", action="store_true",
                        help="before measuring, one unmeasured burst of --concurrency requests of --max-tokens "
                             "(a cuda-graph server captures its batch sizes and key spans there, not in the measure)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="sample the started server with py-spy during each measured burst; summaries under DIR")
    args = parser.parse_args()
    if not 1 <= args.requests <= MAX_REQUESTS or not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--requests must be in 1..{MAX_REQUESTS} and --concurrency in 1..{MAX_CONCURRENCY}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address")
    if args.compare and args.url:
        parser.error("--compare starts its own servers (one per burst); drop --url")
    if args.profile and args.url:
        parser.error("--profile samples the server this script starts; drop --url")
    if args.compare:
        result = compare(args)
    else:
        result = burst(args, args.concurrency, args.max_batch)
        print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
