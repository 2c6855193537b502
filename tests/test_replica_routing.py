"""The pieces of ``serve --ray`` that need no Ray: the routing key and ring, the merge of the
replicas' /metrics, the ASGI bridge a replica answers through, and the CLI's refusals."""

from __future__ import annotations

import asyncio
import collections
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from hybridllm.server.asgi_bridge import ForwardedRequest, ResponseStart, call_asgi
from hybridllm.server.replica_metrics import merge_replica_metrics
from hybridllm.server.routing import PREFIX_CHARS, PREFIX_TOKENS, HashRing, Route, choose_replica, prefix_key

REPLICAS = ["0", "1", "2"]


# ---- the routing key -------------------------------------------------------------------------
def chat(*contents: str) -> dict:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


def test_prefix_key_is_the_first_page_of_the_prompt():
    base = "x" * PREFIX_CHARS
    assert prefix_key({"prompt": base + "tail one"}) == prefix_key({"prompt": base + "something else"})
    assert prefix_key({"prompt": "a" + base}) != prefix_key({"prompt": "b" + base})
    assert prefix_key({"prompt": [base + "1"]}) == prefix_key({"prompt": base + "2"})  # a batch of one prompt
    ids = list(range(PREFIX_TOKENS))
    assert prefix_key({"prompt": ids + [1, 2]}) == prefix_key({"prompt": ids + [3]})
    assert prefix_key({"prompt": [7] + ids}) != prefix_key({"prompt": [8] + ids})
    # chat: the messages in order, roles included; a long first message decides alone
    assert prefix_key(chat(base, "one")) == prefix_key(chat(base, "two"))
    assert prefix_key(chat("hi", "one")) != prefix_key(chat("hi", "two"))
    assert prefix_key(chat("hi")) != prefix_key({"messages": [{"role": "system", "content": "hi"}]})
    assert prefix_key(chat("hi")) == prefix_key(chat("hi"))
    for no_prompt in (None, [], {}, {"prompt": ""}, {"prompt": []}, {"messages": []}, {"model": "m"}):
        assert prefix_key(no_prompt) is None


def test_prefix_key_is_stable_across_processes():
    """The key is a content hash (not ``hash()``, which is salted per process): the same in every process."""
    import subprocess

    code = "from hybridllm.server.routing import prefix_key; print(prefix_key({'prompt': 'The capital of'}))"
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
           for _ in range(2)}
    assert out == {f"{prefix_key({'prompt': 'The capital of'})}\n"}


# ---- the ring and the choice -----------------------------------------------------------------
def test_ring_spreads_keys_and_moves_only_a_dead_replicas_keys():
    ring = HashRing(REPLICAS)
    keys = [prefix_key({"prompt": f"prompt {i}"}) for i in range(600)]
    owners = {key: ring.preferred(key, REPLICAS) for key in keys}
    counts = collections.Counter(owners.values())
    assert set(counts) == set(REPLICAS) and min(counts.values()) > 100  # roughly even over three
    live = ["0", "2"]
    for key, owner in owners.items():
        moved = ring.preferred(key, live)
        assert moved == owner if owner != "1" else moved in live
    assert ring.preferred(keys[0], []) is None


def test_choose_replica_prefers_the_prefix_replica_until_it_is_much_busier():
    ring = HashRing(REPLICAS)
    key = prefix_key({"prompt": "hello"})
    home = ring.preferred(key, REPLICAS)
    other = next(r for r in REPLICAS if r != home)
    idle = dict.fromkeys(REPLICAS, 0)
    assert choose_replica(key, ring, REPLICAS, idle) == Route(home, "prefix")
    busy = {**idle, home: 3, other: 0}
    assert choose_replica(key, ring, REPLICAS, busy, max_imbalance=4) == Route(home, "prefix")
    busier = {**dict.fromkeys(REPLICAS, 1), home: 5}
    chosen = choose_replica(key, ring, REPLICAS, busier, max_imbalance=4)
    assert chosen.reason == "least_loaded" and chosen.replica != home
    # no key: the least loaded (ties: the first live one)
    assert choose_replica(None, ring, REPLICAS, {"0": 2, "1": 1, "2": 1}) == Route("1", "least_loaded")
    # the home replica is down: the next one on the ring, still by prefix
    live = [r for r in REPLICAS if r != home]
    assert choose_replica(key, ring, live, idle) == Route(ring.preferred(key, live), "prefix")
    assert choose_replica(key, ring, [], idle) is None


# ---- the merged /metrics ---------------------------------------------------------------------
def replica_exposition(requests: float, tier_bytes: dict[str, float]) -> str:
    """A replica's registry, shaped like ServerMetrics' (a counter, a histogram, labelled gauges)."""
    registry = CollectorRegistry()
    Counter("hybridllm:request_success", "Finished requests.", ["model_name", "finished_reason"],
            registry=registry).labels("m", "stop").inc(requests)
    Histogram("hybridllm:e2e_request_latency_seconds", "Latency.", ["model_name"], buckets=(1.0, 2.0),
              registry=registry).labels("m").observe(1.5)
    gauge = Gauge("hybridllm:kv_cache_bytes", 'KV bytes "held".', ["model_name", "tier"], registry=registry)
    for tier, n in tier_bytes.items():
        gauge.labels("m", tier).set(n)
    return generate_latest(registry).decode()


def test_merge_labels_every_sample_with_its_replica_and_keeps_each_family_once():
    texts = {"0": replica_exposition(3, {"device": 10, "host": 20}), "1": replica_exposition(5, {"host": 7})}
    merged = merge_replica_metrics(texts).decode()
    families = list(text_string_to_metric_families(merged))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # each family once: valid exposition for Prometheus
    by_name = {f.name: f for f in families}
    success = {s.labels["replica"]: s.value for s in by_name["hybridllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"0": 3.0, "1": 5.0}
    kv = {(s.labels["replica"], s.labels["tier"]): s.value for s in by_name["hybridllm:kv_cache_bytes"].samples}
    assert kv == {("0", "device"): 10.0, ("0", "host"): 20.0, ("1", "host"): 7.0}
    assert by_name["hybridllm:kv_cache_bytes"].documentation == 'KV bytes "held".'
    hist = by_name["hybridllm:e2e_request_latency_seconds"]
    assert hist.type == "histogram"
    assert {s.labels["replica"] for s in hist.samples} == {"0", "1"}
    # every sample line of the text carries the label, the other labels kept
    lines = [line for line in merged.splitlines() if line and not line.startswith("#")]
    assert lines and all('replica="' in line and 'model_name="m"' in line for line in lines)
    assert merge_replica_metrics({}) == b""


# ---- the ASGI bridge -------------------------------------------------------------------------
def bridge_app(aborted: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": (await request.body()).decode(), "query": request.url.query,
                "auth": request.headers.get("authorization")}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                aborted.append("closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    return app


def forwarded(method: str, path: str, body: bytes = b"", query: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest(method, path, query, [(b"authorization", b"Bearer k"), (b"content-type", b"text/plain")],
                            body)


def test_asgi_bridge_answers_like_the_app():
    async def run() -> None:
        aborted: list[str] = []
        app = bridge_app(aborted)
        parts = [p async for p in call_asgi(app, forwarded("POST", "/echo", b"hello", b"x=1"))]
        start, body = parts[0], b"".join(parts[1:])
        assert isinstance(start, ResponseStart) and start.status == 200 and not start.is_event_stream
        assert body == b'{"body":"hello","query":"x=1","auth":"Bearer k"}'

        missing = [p async for p in call_asgi(app, forwarded("GET", "/nowhere"))]
        assert missing[0].status == 404

        failing = [p async for p in call_asgi(app, forwarded("GET", "/boom"))]
        assert failing[0].status == 500

        # a stream closed early: the app's generator is closed (the server aborts the request there)
        stream = call_asgi(app, forwarded("GET", "/stream"))
        first = await stream.__anext__()
        assert first.is_event_stream
        assert await stream.__anext__() == b"data: 0\n\n"
        await stream.aclose()
        await asyncio.sleep(0.05)
        assert aborted == ["closed"]

    asyncio.run(run())


# ---- the CLI ---------------------------------------------------------------------------------
def test_serve_ray_without_ray_says_how_to_install(monkeypatch):
    from hybridllm.cli import app

    for name in [m for m in sys.modules if m == "ray" or m.startswith(("ray.", "hybridllm.server.ray"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ModuleNotFoundError
    result = CliRunner().invoke(app, ["serve", "--ray", "--replicas", "2"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'hybridllm[ray]'" in lines[0], result.output


@pytest.mark.parametrize("args", [["--replicas", "2"], ["--ray-address", "auto"]])
def test_ray_flags_need_ray(args):
    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2 and "need --ray" in result.output


def test_replicas_must_be_positive():
    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["serve", "--ray", "--replicas", "0"])
    assert result.exit_code == 2 and "--replicas must be >= 1" in result.output


def test_serve_ray_with_a_missing_model_fails_before_starting_a_cluster(tmp_path):
    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["serve", "--ray", "--model", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model not found"), result.output


def test_page_key_routes_by_the_first_prefix_cache_page(tiny_models):
    """With the model's tokenizer, the key is the first page of token ids the replica will see:
    the same for prompts that share it (text, ids or chat), different otherwise."""
    from hybridllm.kvcache.prefix_hash import PAGE_TOKENS
    from hybridllm.loading.registry import open_checkpoint
    from hybridllm.server.routing import PageKey

    tokenizer = open_checkpoint(tiny_models["llama"][0]).tokenizer()
    key = PageKey(tokenizer)
    ids = [5 + i for i in range(PAGE_TOKENS)]
    assert key({"prompt": ids + [1, 2]}) == key({"prompt": ids + [9]})
    assert key({"prompt": [7] + ids}) != key({"prompt": [8] + ids})
    text = "word " * 80
    assert key({"prompt": text + "one"}) == key({"prompt": tokenizer.encode(text + "two")})
    system = {"role": "system", "content": "rules " * 60}
    assert key({"messages": [system, {"role": "user", "content": "a"}]}) == \
        key({"messages": [system, {"role": "user", "content": "b"}]})
    assert key({"model": "m"}) is None
    assert key({"messages": [{"role": "nobody", "content": 3}]}) == prefix_key({"messages": [{"role": "nobody", "content": 3}]})
