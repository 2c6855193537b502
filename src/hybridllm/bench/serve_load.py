"""Bursts of chat requests against ``hybridllm serve`` over loopback (``tools/load_test.py``,
``bench --preset spec``'s serving comparison).

    proc, url = start_server(["--spec", "ngram"], threads=2, max_batch=16)
    result = asyncio.run(run_load(url, model, n_requests=16, concurrency=16, max_tokens=128, time_limit=600))
    stop_server(proc)

Each request is a streamed chat completion at temperature 0 (so a server with and without
speculative decoding generates the same tokens), with ``include_usage`` so that the generated,
proposed and accepted tokens come back; time to first token is measured from the stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from hybridllm.bench.ports import free_port
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


class ServerStartError(RuntimeError):
    """``hybridllm serve`` exited, or did not answer /health in time."""


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      ignore_eos: bool = True) -> dict[str, Any]:
    """One streamed greedy chat completion: ok, latency, TTFT and the usage's token counts (or the error)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
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
    details = usage.get("completion_tokens_details") or {}
    return {"ok": True, "latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "draft_tokens": details.get("speculative_draft_tokens") or 0,
            "accepted_tokens": details.get("accepted_prediction_tokens") or 0}


async def run_load(url: str, model: str, n_requests: int, concurrency: int, max_tokens: int,
                   time_limit: float, ignore_eos: bool = True,
                   prompts: Sequence[str] = PROMPTS) -> dict[str, Any]:
    """``n_requests`` requests (``prompts`` in turn), at most ``concurrency`` in flight: throughput,
    TTFT and latency percentiles, failures, and the proposed and accepted tokens of speculation."""
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit), limits=limits) as http:
        async def bounded(i: int) -> dict[str, Any]:
            async with semaphore:
                return await one_request(http, url, model, prompts[i % len(prompts)], max_tokens, ignore_eos)

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
        "client_cpu_s": client_cpu,  # this process's own CPU time (it shares the machine with the server)
        "requests_per_s": len(ok) / wall,
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "draft_tokens": sum(r["draft_tokens"] for r in ok),
        "accepted_tokens": sum(r["accepted_tokens"] for r in ok),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": percentile(latencies, 99),
    }


def start_server(serve_args: Sequence[str], threads: int | None, max_batch: int,
                 max_queue: int = 256) -> tuple[subprocess.Popen, str]:
    """``hybridllm serve`` with ``serve_args`` on a free loopback port, once its /health answers:
    (the process, its URL).

    Raises:
        ServerStartError: it exited, or did not answer within 300 s (then it is stopped).
    """
    port = free_port()
    command = [sys.executable, "-m", "hybridllm.cli", "serve", "--port", str(port), "--max-batch", str(max_batch),
               "--max-queue", str(max_queue), "--log-level", "warning",
               *(["--threads", str(threads)] if threads else []), *serve_args]
    print("starting:", " ".join(command[1:]), file=sys.stderr)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise ServerStartError("the server did not start within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def warm_up(url: str, model: str | None = None) -> str:
    """One unmeasured request (the server's first forward sets things up); the model id it used
    (``model``, or the server's first)."""
    model = model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return model
