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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from hybridllm.engine.metrics import percentile

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Tell me a joke about computers.",
    "Explain gravity to a child.",
    "What is 2+2? Explain your reasoning.",
    "Name a fruit that is yellow.",
    "Who wrote Hamlet?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe a cat in one paragraph.",
    "What are the planets of the solar system?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes fly?",
    "Translate 'good morning' into French and Spanish.",
    "Write a short poem about autumn leaves.",
]
MAX_REQUESTS = 256
MAX_CONCURRENCY = 64
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"]}
                if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - start
    if usage is None:
        return {"ok": False, "error": "no usage in the stream"}
    return {"ok": True, "latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


async def run_load(url: str, model: str, n_requests: int, concurrency: int, max_tokens: int,
                   time_limit: float) -> dict[str, Any]:
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit), limits=limits) as http:
        async def bounded(i: int) -> dict[str, Any]:
            async with semaphore:
                return await one_request(http, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)

        start, cpu_start = time.perf_counter(), time.process_time()
        results = await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(n_requests))), time_limit)
        wall, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    latencies = [r["latency_s"] for r in ok] or [0.0]
    ttfts = [r["ttft_s"] for r in ok] or [0.0]
    return {
        "requests": n_requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "succeeded": len(ok),
        "failed": len(failed),
        "errors": sorted({r["error"] for r in failed})[:5],
        "wall_s": wall,
        "client_cpu_s": client_cpu,  # this script's own CPU time (it shares the machine with the server)
        "requests_per_s": len(ok) / wall,
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": percentile(latencies, 99),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "hybridllm.cli", "serve", "--port", str(port), "--max-batch",
               str(max_batch), "--max-queue", str(max(256, args.requests)), "--log-level", "warning",
               *(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg]
    print("starting:", " ".join(command[1:]), file=sys.stderr)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit("the server did not start within 300 s")


def burst(args: argparse.Namespace, concurrency: int, max_batch: int) -> dict[str, Any]:
    """One burst against ``args.url``, or against a server started (and stopped) for it."""
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args, max_batch)
    try:
        model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={  # warm-up, not measured
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        if args.warmup_burst:  # the burst's own shape once, not measured: every batch size and length seen
            asyncio.run(run_load(url, model, concurrency, concurrency, args.max_tokens, args.time_limit))
        result = asyncio.run(run_load(url, model, args.requests, concurrency, args.max_tokens, args.time_limit))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
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
            result = burst(args, concurrency, max_batch)
            rounds[name].append(result)
            print(f"round {i + 1} {name:>14}: {result['wall_s']:6.2f} s, "
                  f"{result['generated_tokens_per_s']:7.1f} generated tok/s, {result['failed']} failed", flush=True)
    medians = {name: statistics.median(r["generated_tokens_per_s"] for r in runs) for name, runs in rounds.items()}
    ratio = medians["batched"] / medians["one_at_a_time"]
    failed = sum(r["failed"] for runs in rounds.values() for r in runs)
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
    args = parser.parse_args()
    if not 1 <= args.requests <= MAX_REQUESTS or not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--requests must be in 1..{MAX_REQUESTS} and --concurrency in 1..{MAX_CONCURRENCY}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address")
    if args.compare and args.url:
        parser.error("--compare starts its own servers (one per burst); drop --url")
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
