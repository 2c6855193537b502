"""Time to first token of a repeated ~4K-token prompt across a `hybridllm serve` restart.

Three servers of the default model in turn (2 threads, CPU): one with no prefix cache (cold),
one with a disk tier that answers the prompt and is stopped, and a restarted one on the same
directory. Prints each TTFT (first streamed text, timed by the client) and cached tokens.

    .venv/bin/python tools/prefix_restart_ttft.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import httpx

from hybridllm.bench.ports import free_port

TEXT = ("The archive holds records of ships, harbours and the goods they carried between the northern ports, "
        "with the dates of each voyage, the names of the crews and the weather they met. ") * 115  # ~4.2K tokens


def first_token(*serve_args: str) -> tuple[float, dict]:
    """Start a server, stream one completion of TEXT, stop it: (TTFT in s, usage)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybridllm.cli", "serve", "--port", str(port), "--threads", "2",
                             "--device", "cpu", "--log-level", "warning", *serve_args], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": TEXT, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        start, ttft, usage = time.perf_counter(), None, {}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        return ttft, usage
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hybridllm-prefix-") as disk:
        cold = first_token("--prefix-cache-ram", "0")
        first = first_token("--prefix-cache-disk", disk)
        restarted = first_token("--prefix-cache-disk", disk)
    for name, (ttft, usage) in (("cold", cold), ("first, disk tier", first), ("restarted", restarted)):
        details = usage.get("prompt_tokens_details") or {}
        print(f"{name:>17}: TTFT {ttft:.3f} s, {usage.get('prompt_tokens')} prompt tokens, "
              f"{details.get('cached_tokens')} cached")
    print(f"restarted / cold: {restarted[0] / cold[0]:.3f}x")


if __name__ == "__main__":
    main()
