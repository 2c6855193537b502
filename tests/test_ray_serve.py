"""``hybridllm serve --ray``, end to end: a local Ray cluster on the loopback interface with two
engine replicas of the default model (1 thread, small KV budgets each) behind the ingress.

32 concurrent requests through the official ``openai`` client all succeed with the single
engine's greedy outputs, and both replicas answer some (their ``replica`` series in the
ingress's ``/metrics``). Then one replica's process is killed mid-run: every request in flight
gets its answer or a 503 (an SSE error event when its stream had begun), none hangs, and Ray
Serve brings the replica back. The server and every process it started are stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import OPENAI_MISSING, import_extra
from serving_helpers import CHAT_PROMPTS, reference

import hybridllm
from hybridllm.bench.ports import free_port

openai = import_extra("openai", OPENAI_MISSING)

pytestmark = pytest.mark.slow  # a Ray cluster and two engine processes

STARTUP_TIMEOUT_S = 240
RECOVERY_TIMEOUT_S = 150
CLIENT_TIMEOUT_S = 150  # a request still unanswered after this has hung
MAX_TOKENS = 16
SUFFIXES = ("", " Be brief.", " Answer in one sentence.", " Explain.")
PROMPTS = [prompt + suffix for suffix in SUFFIXES for prompt in CHAT_PROMPTS]  # 32 distinct prompts


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/replicas", timeout=30).json()


def requests_per_replica(base: str) -> dict[str, float]:
    """Finished requests per ``replica`` label, summed over finish reasons, from the ingress's /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("hybridllm:request_success_total{"):
            replica = re.search(r'replica="([^"]*)"', line).group(1)
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def error_code(exc: openai.APIError) -> str | None:
    """The OpenAI error object's code (clients give the object, or the body holding it)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body).get("code")


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the server (it stops Serve and its Ray cluster), then kill what it started and left."""
    started: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        started = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    """``hybridllm serve --ray --replicas 2`` in its own session: (base URL, log path)."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    src = str(Path(hybridllm.__file__).resolve().parents[1])  # the replicas import this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's switch for a loopback-only local cluster
    args = ["--ray", "--replicas", "2", "--threads", "1", "--weights", "float", "--max-batch", "8",
            "--max-queue", "64", "--host-budget", "256MiB", "--port", str(port), "--log-level", "warning"]
    with open(log, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "hybridllm.cli", "serve", *args], stdout=subprocess.DEVNULL,
                                stderr=log_file, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve --ray exited with {proc.returncode}: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve --ray did not become healthy: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, log
    finally:
        stop_tree(proc)


@pytest.fixture(scope="module")
def client(ray_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ray_server[0]}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def test_concurrent_requests_match_one_engine_and_use_both_replicas(ray_server, client, model_id, default_llm):
    base, _ = ray_server
    expected = [reference(default_llm, prompt, MAX_TOKENS).text for prompt in PROMPTS]

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=MAX_TOKENS)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))  # any failure raises here

    assert answers == expected
    deadline = time.monotonic() + 30  # the loop counts a request just after its client hears the end
    while sum(requests_per_replica(base).values()) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.2)
    served = requests_per_replica(base)
    assert set(served) == {"0", "1"}
    assert served["0"] > 0 and served["1"] > 0, served
    assert sum(served.values()) >= len(PROMPTS)
    assert {r["replica"]: r["live"] for r in replicas(base)} == {"0": True, "1": True}


def test_killed_replica_answers_503_and_comes_back(ray_server, client, model_id):
    base, _ = ray_server
    before = {r["replica"]: r["pid"] for r in replicas(base)}
    victim = "0"
    prompts = [f"Write a long story about a {thing}." for thing in
               ("dragon", "robot", "sailor", "baker", "comet", "forest", "violin", "lighthouse")]

    def ask(index: int) -> str:
        """'ok', or '503' for a replica failure (a 503 reply, or an SSE error event mid-stream)."""
        messages = [{"role": "user", "content": prompts[index]}]
        try:
            if index % 2:
                text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                    model=model_id, messages=messages, temperature=0, max_tokens=48, stream=True) if chunk.choices)
            else:
                text = client.chat.completions.create(model=model_id, messages=messages, temperature=0,
                                                      max_tokens=48).choices[0].message.content
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            assert error_code(exc) in ("replica_unavailable", "no_replica"), exc.body
            return "503"
        except openai.APIError as exc:  # the stream's error event
            assert error_code(exc) == "replica_unavailable", exc.body
            return "503"
        assert text
        return "ok"

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(ask, i) for i in range(len(prompts))]
        deadline = time.monotonic() + 60
        while not next(r for r in replicas(base) if r["replica"] == victim)["running"]:
            assert time.monotonic() < deadline, "the victim replica never ran a request"
            time.sleep(0.05)
        os.kill(before[victim], signal.SIGKILL)
        outcomes = [future.result(timeout=CLIENT_TIMEOUT_S + 10) for future in futures]  # none hangs

    assert set(outcomes) <= {"ok", "503"}
    assert "503" in outcomes  # the killed replica's requests were told, not lost
    assert "ok" in outcomes  # the other replica's were answered

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        now = {r["replica"]: r for r in replicas(base)}
        if all(r["live"] for r in now.values()) and now[victim].get("pid") not in (None, before[victim]):
            break
        assert time.monotonic() < deadline, f"Ray did not bring replica {victim} back: {now}"
        time.sleep(1)
    with ThreadPoolExecutor(4) as pool:  # both replicas serve again
        replies = list(pool.map(lambda p: client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=4), PROMPTS[:4]))
    assert all(reply.choices[0].message.content for reply in replies)
    failures = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
                if line.startswith("hybridllm:ingress_replica_failures_total{")}
    assert failures['replica="0"'] == outcomes.count("503")
