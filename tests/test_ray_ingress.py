"""The ``serve --ray`` ingress and engine replicas in one process, without a Ray cluster.

Real :class:`Ingress` and :class:`EngineReplica` objects (a tiny random model each); between them,
stand-ins for Ray Serve's deployment handles that call the replica directly and can play a
replica whose process died (Ray's ``ActorDiedError``) or hangs (no answer at all). Checks the
forwarding (answers equal the engine's own), the merged ``/metrics``, and what clients get when a
replica dies or stops answering mid-request.
(The real cluster: tests/test_ray_serve.py, slow.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from conftest import RAY_MISSING, import_extra
from starlette.requests import Request

from hybridllm import LLM
from hybridllm.config import SamplingParams
from hybridllm.server.routing import prefix_key

ActorDiedError = import_extra("ray.exceptions", RAY_MISSING).ActorDiedError

from hybridllm.server.ray.ingress import Ingress  # noqa: E402  (these import ray: after the skip)
from hybridllm.server.ray.replica import EngineReplica, ServerOptions  # noqa: E402


class FakeResponse:
    """What ``handle.method.remote()`` gives: awaitable and cancellable."""

    def __init__(self, coro: Any) -> None:
        self.coro = coro

    def __await__(self):
        return self.coro.__await__()

    def cancel(self) -> None:
        self.coro.close()


class FakeStream:
    """What ``handle.options(stream=True).method.remote()`` gives: an async iterator, cancellable;
    its replica's death raises ``ActorDiedError`` after ``fail_after`` parts."""

    def __init__(self, parts: AsyncIterator[Any], handle: FakeHandle) -> None:
        self.parts = parts
        self.handle = handle
        self.sent = 0
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        await self.handle.unless_hung()
        if self.handle.fail_after is not None and self.sent >= self.handle.fail_after:
            self.handle.fail_after = 0  # the process is gone: every call fails from now on
            await self.parts.aclose()  # and its request with it
            raise ActorDiedError()
        self.sent += 1
        return await self.parts.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class Remote:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class FakeHandle:
    """A deployment handle of one engine replica, calling it in this process.

    ``fail_after``: None while the replica lives; 0: its process died, calls fail; N: it dies after
    a stream's N next parts. ``hung``: set while its process answers nothing (calls wait)."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.fail_after: int | None = None
        self.hung = False
        self.handle_http = Remote(lambda request: FakeStream(self.replica.handle_http(request), self))
        self.describe = Remote(lambda: FakeResponse(self.call(self.replica.describe)))
        self.metrics_text = Remote(lambda: FakeResponse(self.call(self.replica.metrics_text)))
        self.stats = Remote(lambda since=None: FakeResponse(self.call(lambda: self.replica.stats(since))))

    def options(self, stream: bool = False) -> FakeHandle:
        return self

    async def unless_hung(self) -> None:
        while self.hung:
            await asyncio.sleep(0.01)

    async def call(self, method: Callable[[], Any]) -> Any:
        await self.unless_hung()
        if self.fail_after == 0:
            raise ActorDiedError()
        return method()


@pytest.fixture(scope="module")
def replicas(tiny_models):
    folder = tiny_models["llama"][0]
    made = [EngineReplica(str(i), {"model": folder, "device": "cpu", "threads": 1}, ServerOptions(max_batch=4))
            for i in range(2)]
    yield made
    for replica in made:
        replica.scheduler.stop()


Body = Callable[[httpx.AsyncClient, Ingress, list["FakeHandle"]], Any]


def run_with_ingress(replicas: list[EngineReplica], body: Body, probe_timeout_s: float = 5.0) -> Any:
    """Run ``body(client, ingress, handles)`` against an ingress in front of ``replicas``."""
    handles = [FakeHandle(replica) for replica in replicas]
    ingress = Ingress(handles, max_imbalance=4, probe_timeout_s=probe_timeout_s)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress",
                                     timeout=60) as client:
            return await body(client, ingress, handles)

    return asyncio.run(main())


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "unused-check", "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}


def finished(metrics: str) -> dict[str, float]:
    """Finished requests per replica label, from the ingress's /metrics text."""
    served: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("hybridllm:request_success_total{"):
            replica = line.split('replica="')[1].split('"')[0]
            served[replica] = served.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return served


def served_model(replica: EngineReplica) -> str:
    return replica.app.state.model_name


def test_ingress_forwards_to_both_replicas_and_merges_metrics(replicas):
    model = served_model(replicas[0])
    prompts = [f"prompt number {i} says" for i in range(12)]

    async def body(client: httpx.AsyncClient, ingress: Ingress, handles: list[FakeHandle]) -> Any:
        replies = await asyncio.gather(*(client.post("/v1/completions", json=completion(p) | {"model": model})
                                         for p in prompts))
        bad = await client.post("/v1/completions", json=completion("x"))  # wrong model: the replica's 400
        models = await client.get("/v1/models")
        for _ in range(100):  # the loop counts a request just after its client hears the end
            metrics = (await client.get("/metrics")).text
            if sum(finished(metrics).values()) >= len(prompts):
                break
            await asyncio.sleep(0.05)
        table = (await client.get("/replicas")).json()
        return replies, bad, models, metrics, table

    replies, bad, models, metrics, table = run_with_ingress(replicas, body)
    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["choices"][0]["text"] for r in replies)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "model_not_found"
    assert models.json()["data"][0]["id"] == model
    served = finished(metrics)
    assert served["0"] > 0 and served["1"] > 0 and sum(served.values()) == len(prompts)
    assert 'hybridllm:ingress_replica_up{replica="0"} 1.0' in metrics
    assert [(r["replica"], r["live"]) for r in table] == [("0", True), ("1", True)]
    assert all(isinstance(r["pid"], int) for r in table)


def test_answers_equal_the_engine_greedy_output(replicas, tiny_models):
    model = served_model(replicas[0])
    prompts = ["Hello there", "def add(a, b):", "The quick brown"]
    llm = LLM(tiny_models["llama"][0], device="cpu", threads=1)  # the single engine, outside any replica
    expected = [llm.generate(p, SamplingParams(max_tokens=6, temperature=0)).text for p in prompts]

    async def body(client: httpx.AsyncClient, ingress: Ingress, handles: list[FakeHandle]) -> Any:
        return await asyncio.gather(*(client.post("/v1/completions", json=completion(p) | {"model": model})
                                      for p in prompts))

    replies = run_with_ingress(replicas, body)
    assert [r.json()["choices"][0]["text"] for r in replies] == expected


def test_a_dead_replica_gets_503_or_an_sse_error_and_comes_back(replicas):
    model = served_model(replicas[0])

    async def body(client: httpx.AsyncClient, ingress: Ingress, handles: list[FakeHandle]) -> Any:
        out = {}
        # the process dies after the response started: a stream ends with an error event and [DONE]
        request = completion("a story", stream=True, max_tokens=20) | {"model": model}
        home = ingress.ring.preferred(prefix_key(request), ingress.replicas)
        handles[int(home)].fail_after = 3
        out["stream"] = await client.post("/v1/completions", json=request)
        out["live_after_stream"], out["home"] = set(ingress.liveness.live), home
        # both dead before answering: 503 replica_unavailable, then no replica at all: 503 no_replica
        for replica in ingress.replicas:
            ingress.liveness.answered(replica)
        handles[0].fail_after = handles[1].fail_after = 0
        out["json"] = await client.post("/v1/completions", json=completion("a tale") | {"model": model})
        out["json2"] = await client.post("/v1/completions", json=completion("a tale") | {"model": model})
        out["none"] = await client.post("/v1/completions", json=completion("a tale") | {"model": model})
        out["health_down"] = await client.get("/health")
        # Ray brought them back: the next probe (every second) routes to them again
        handles[0].fail_after = handles[1].fail_after = None
        for _ in range(200):
            out["health_up"] = await client.get("/health")
            if out["health_up"].status_code == 200 and set(out["health_up"].json()["replicas"].values()) == {"ok"}:
                break
            await asyncio.sleep(0.05)
        out["after"] = await client.post("/v1/completions", json=completion("a tale") | {"model": model})
        out["metrics"] = (await client.get("/metrics")).text
        return out

    out = run_with_ingress(replicas, body)
    events = [line[len("data: "):] for line in out["stream"].text.splitlines() if line.startswith("data: ")]
    assert out["stream"].status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    assert out["live_after_stream"] == {"0", "1"} - {out["home"]}  # the stream's replica is down, not the other
    for key in ("json", "json2"):
        assert out[key].status_code == 503 and out[key].headers["retry-after"] == "1"
        assert out[key].json()["error"]["code"] == "replica_unavailable"
    assert out["none"].status_code == 503 and out["none"].json()["error"]["code"] == "no_replica"
    assert out["health_down"].status_code == 503 and out["health_down"].headers["retry-after"] == "1"
    assert out["health_down"].json()["replicas"] == {"0": "down", "1": "down"}
    assert out["health_up"].status_code == 200 and out["health_up"].json()["replicas"] == {"0": "ok", "1": "ok"}
    assert out["after"].status_code == 200
    failures = sum(float(line.rsplit(" ", 1)[1]) for line in out["metrics"].splitlines()
                   if line.startswith("hybridllm:ingress_replica_failures_total{"))
    assert failures == 3  # the stream and the two 503s; no_replica is not a replica's failure


def test_the_ingress_serves_the_page_and_every_replicas_stats(replicas):
    from test_stats import check_schema

    async def body(client: httpx.AsyncClient, ingress: Ingress, handles: list[FakeHandle]) -> Any:
        out = {"page": await client.get("/"), "script": await client.get("/page/app.js")}
        out["both"] = (await client.get("/stats")).json()
        handles[1].fail_after = 0  # replica 1's process died
        out["one"] = (await client.get("/stats?since=0")).json()
        handles[1].fail_after = None
        out["bad"] = await client.get("/stats?since=soon")
        return out

    out = run_with_ingress(replicas, body)
    assert out["page"].status_code == 200 and "<title>hybridllm</title>" in out["page"].text
    assert "connect-src 'self'" in out["page"].headers["content-security-policy"]
    assert out["script"].headers["content-type"].startswith("text/javascript")
    both = out["both"]["replicas"]
    assert [(r["replica"], r["live"]) for r in both] == [("0", True), ("1", True)]
    for entry, replica in zip(both, replicas, strict=True):
        stats = check_schema(entry["stats"])
        assert stats.memory.device.weights == replica.scheduler.runtime.weight_bytes["device"]
    one = out["one"]["replicas"]
    assert one[0]["live"] and check_schema(one[0]["stats"]).requests.running == 0
    assert one[1]["live"] is False and one[1]["stats"] is None
    assert out["bad"].status_code == 400 and out["bad"].json()["error"]["param"] == "since"


def test_a_hung_replica_is_unreachable_its_requests_get_503_and_health_never_waits(replicas):
    """A replica that answers nothing (a hung process, a node gone): its probe times out, it is
    "unreachable" and out of routing, its requests in flight are answered at once (503 with
    Retry-After; an SSE error event and [DONE]), /health answers from what the probes found while
    a probe still waits, and the replica is "ok" again at its next answer."""
    model = served_model(replicas[0])

    async def body(client: httpx.AsyncClient, ingress: Ingress, handles: list[FakeHandle]) -> Any:
        out: dict[str, Any] = {"fresh": dict(ingress.liveness.status)}  # a new ingress trusts no replica yet
        out["first"] = await client.get("/health")  # the probes start with this call
        for _ in range(200):
            if set(ingress.liveness.status.values()) == {"ok"}:
                break
            await asyncio.sleep(0.02)
        out["before"] = await client.get("/health")
        request = completion("a story", max_tokens=8) | {"model": model}
        home = ingress.ring.preferred(prefix_key(request), ingress.replicas)
        other = next(r for r in ingress.replicas if r != home)
        handles[int(home)].hung = True
        # answered by the hung replica's loss, not by its (never coming) reply
        json_reply, stream_reply = await asyncio.gather(
            client.post("/v1/completions", json=request),
            client.post("/v1/completions", json=request | {"stream": True}))
        out["json"], out["stream"], out["home"], out["other"] = json_reply, stream_reply, home, other
        out["during"] = await client.get("/health")  # a probe of the hung replica is waiting now
        out["table"] = (await client.get("/replicas")).json()
        out["rerouted"] = await client.post("/v1/completions", json=request)  # to the other replica
        handles[int(home)].hung = False
        for _ in range(300):
            if ingress.liveness.status[home] == "ok":
                break
            await asyncio.sleep(0.02)
        out["after"] = await client.get("/health")
        out["metrics"] = (await client.get("/metrics")).text
        return out

    # a long probe timeout beside the test's client timeout: /health must not wait for a probe
    out = run_with_ingress(replicas, body, probe_timeout_s=0.5)
    home, other = out["home"], out["other"]
    assert out["fresh"] == {"0": "unknown", "1": "unknown"}
    assert out["first"].status_code in (200, 503)
    assert out["before"].json()["replicas"] == {"0": "ok", "1": "ok"}
    assert out["json"].status_code == 503 and out["json"].headers["retry-after"] == "1"
    assert out["json"].json()["error"]["code"] == "replica_unavailable"
    assert "stopped answering" in out["json"].json()["error"]["message"]
    events = [line[len("data: "):] for line in out["stream"].text.splitlines() if line.startswith("data: ")]
    assert out["stream"].status_code in (200, 503)
    if out["stream"].status_code == 200:  # the stream had begun: an error event, then [DONE]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "replica_unavailable"
    else:
        assert out["stream"].json()["error"]["code"] == "replica_unavailable"
    assert out["during"].status_code == 200
    assert out["during"].json()["replicas"] == {home: "unreachable", other: "ok"}
    assert {r["replica"]: (r["status"], r["live"]) for r in out["table"]} == {home: ("unreachable", False),
                                                                           other: ("ok", True)}
    assert out["rerouted"].status_code == 200
    assert out["after"].json()["replicas"] == {"0": "ok", "1": "ok"}
    failures = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in out["metrics"].splitlines() if line.startswith("hybridllm:ingress_replica_failures_total{")}
    assert failures[home] == 2 and failures[other] == 0
