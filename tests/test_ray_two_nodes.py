"""docs/ray.md's two-machine recipe, as far as one machine allows: two Ray nodes on the loopback
interface (a head and a worker, ``ray start`` each, 1 CPU each), ``hybridllm serve --ray
--ray-address HEAD --replicas 2 --threads 1`` on them, then the worker node killed.

What it checks (issue 38, findings 9-12): the ingress runs on the head node and so outlives the
worker; the worker's replica is reported "unreachable" or "down" and taken out of routing; its
requests in flight end with a 503-style error (an SSE error event and ``[DONE]``) instead of
hanging; ``/health`` answers at once throughout; new requests go to the replica that lives; and
when the server exits, its port is free (Ray Serve, which it started on the cluster, is shut down)
while the cluster keeps running.

On one host Ray replaces 127.0.0.1 with the machine's interface address, so each node is given
its own other loopback address (127.0.0.2, 127.0.0.3): every byte stays on the loopback
interface. Ray 2.60's token authentication is on: every process gets ``RAY_AUTH_MODE=token`` and
the same ``RAY_AUTH_TOKEN``. Ray Serve's HTTP proxies share their port (``SO_REUSEPORT``), so on
one machine the worker's proxy would take some of the clients' connections (and lose them with
its node); it is given its own port (``RAY_SERVE_WORKER_PROXY_HTTP_PORT``), as a second machine's
proxy has its own address. Every process is started by this test and ended by its id.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import RAY_MISSING, import_extra
from test_ray_serve import stop_tree
from test_server_hardening import long_tiny  # noqa: F401  (the fixture: a tiny model with an 8K context)

import hybridllm
from hybridllm.bench.ports import distinct_free_ports, free_port

import_extra("ray", RAY_MISSING)  # the `ray` command beside this Python

pytestmark = pytest.mark.slow  # two Ray nodes and a Serve application

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
BOUND_S = 240
RAY = str(Path(sys.executable).with_name("ray"))


NODE_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                   "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def node_ports(ports: list[int]) -> list[str]:
    """Every port a node binds, given (two nodes share the machine, and so may other Ray
    clusters: none of Ray's fixed defaults is used)."""
    return [item for flag, port in zip(NODE_PORT_FLAGS, ports, strict=True) for item in (flag, str(port))]


def running(proc: subprocess.Popen, log: Path) -> bool:
    """True while ``proc`` runs; an AssertionError with its log's tail once it has exited (no
    waiting out the bound for a node that died at start)."""
    if proc.poll() is None:
        return True
    raise AssertionError(f"exited with {proc.returncode}: {log.read_text()[-1500:]}")


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 a node: its ``ray start`` and every process under it, at once."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.wait()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if condition():
                return
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.3)


@pytest.fixture
def cluster(tmp_path_factory):
    """A head and a worker node on loopback addresses: (GCS address, env, head, worker)."""
    tmp = Path(f"/tmp/hl38-{secrets.token_hex(4)}")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(hybridllm.__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # "0" would refuse the worker node
    logs = tmp_path_factory.mktemp("ray-nodes")
    gcs, dashboard, client, *head_ports = distinct_free_ports(3 + len(NODE_PORT_FLAGS))
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address", HEAD_IP, "--port", str(gcs), "--num-cpus", "1",
         "--include-dashboard", "false", "--dashboard-port", str(dashboard), "--ray-client-server-port",
         str(client), "--disable-usage-stats", "--temp-dir", str(tmp), *node_ports(head_ports)],
        env=env, stdout=open(logs / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        address = f"{HEAD_IP}:{gcs}"

        def nodes() -> int:
            out = subprocess.run([RAY, "status", "--address", address], env=env, capture_output=True, text=True,
                                 timeout=60).stdout
            return sum(line.strip().startswith("1 node_") for line in out.split("Pending:")[0].splitlines())

        wait_for(lambda: running(head, logs / "head.log") and nodes() == 1, "the head node up")
        # Ray Serve's proxies bind their port with SO_REUSEPORT: on one machine the worker's proxy
        # would share the head's port (and its connections), so it gets its own
        proxy, *worker_ports = distinct_free_ports(1 + len(NODE_PORT_FLAGS))
        worker_env = {**env, "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy)}
        worker = subprocess.Popen(
            [RAY, "start", "--block", "--address", address, "--node-ip-address", WORKER_IP, "--num-cpus", "1",
             "--disable-usage-stats", *node_ports(worker_ports)],
            env=worker_env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: running(worker, logs / "worker.log") and nodes() == 2, "the worker node joined")
        yield address, env, head, worker
    finally:
        try:
            if worker is not None:
                stop_tree(worker)  # SIGTERM: `ray start --block` stops its node
        finally:
            stop_tree(head)
            shutil.rmtree(tmp, ignore_errors=True)


# Tokens per stream: long enough that the lost replica's streams are still decoding when the test
# has seen every stream begun (a poll of /replicas through Ray) and kills the worker. With 1500
# (~2-3 s on a 2-core machine) a slow poll let them finish first: nothing was cut (CI, once).
STREAM_TOKENS = 6000  # the prompt's few tokens + 6000 < the model's 8K context


def stream(base: str, model: str, prompt: str, out: list[str], begun: list[int]) -> None:
    """One long stream; its status goes to ``begun`` once the response has begun, its whole text to ``out``."""
    with httpx.stream("POST", f"{base}/v1/completions", timeout=BOUND_S, json={
            "model": model, "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}) as r:
        begun.append(r.status_code)
        out.append(f"{r.status_code}\n" + "".join(r.iter_text()))


def test_two_nodes_one_killed_the_ingress_survives_and_the_lost_replica_is_reported(cluster, long_tiny, tmp_path):
    address, env, head, worker = cluster
    port = free_port()
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "hybridllm.cli", "serve", "--ray", "--ray-address", address, "--replicas", "2",
         "--threads", "1", "--model", str(long_tiny), "--max-batch", "4", "--host-budget", "256MiB",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert serve.poll() is None, log.read_text()[-3000:]
            r = httpx.get(f"{base}/health", timeout=10)
            return r.status_code == 200 and set(r.json()["replicas"].values()) == {"ok"}

        wait_for(healthy, "both replicas ok")
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        table = {r["replica"]: r for r in httpx.get(f"{base}/replicas", timeout=30).json()}
        on_worker = {p.pid for p in psutil.Process(worker.pid).children(recursive=True)}
        lost = next(r for r, entry in table.items() if entry["pid"] in on_worker)  # the worker's replica
        kept = next(r for r in table if r != lost)
        assert table[kept]["pid"] not in on_worker  # one replica on each node

        # long streams on both replicas, then the worker node dies under them
        results: list[str] = []
        begun: list[int] = []
        threads = [threading.Thread(target=stream, args=(base, model, f"story number {i}", results, begun))
                   for i in range(6)]
        for t in threads:
            t.start()
        # every response begun (a request not yet begun when its replica is lost gets a plain 503, which
        # tests/test_ray_ingress.py covers; here each lost one must end mid-stream)
        wait_for(lambda: len(begun) == 6 and all(r["running"] for r in httpx.get(f"{base}/replicas", timeout=30).json()),
                 "all six streams begun, both replicas decoding")
        assert begun == [200] * 6
        kill_tree(worker)

        statuses = []

        def reported_lost() -> bool:
            r = httpx.get(f"{base}/health", timeout=5)  # at once, whatever the replicas do
            statuses.append(r.json()["replicas"][lost])
            return r.status_code == 200 and statuses[-1] in ("down", "unreachable") \
                and r.json()["replicas"][kept] == "ok"

        wait_for(reported_lost, "the worker's replica reported lost")
        for t in threads:
            t.join(BOUND_S)
        assert len(results) == 6  # none hangs
        cut = [text for text in results if '"replica_unavailable"' in text]
        done = [text for text in results if '"finish_reason": "length"' in text]
        assert cut and done and len(cut) + len(done) == 6, [text[:4] + " ... " + text[-240:] for text in results]
        for text in cut:
            events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        # the ingress (on the head) still answers, and routes to the replica that lives
        reply = httpx.post(f"{base}/v1/completions", timeout=BOUND_S,
                           json={"model": model, "prompt": "hello", "max_tokens": 4})
        assert reply.status_code == 200
        table = {r["replica"]: r for r in httpx.get(f"{base}/replicas", timeout=30).json()}
        assert table[lost]["live"] is False and table[kept]["live"] is True
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(BOUND_S)
    assert code == 0, log.read_text()[-3000:]
    with pytest.raises(httpx.TransportError):  # the port is free: Serve, which the server started, is gone
        httpx.get(f"{base}/health", timeout=10)
    assert head.poll() is None  # the cluster itself keeps running
