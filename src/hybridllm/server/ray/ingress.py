"""The ingress: one OpenAI-compatible HTTP front for the engine replicas, with KV-aware routing.

Every request but three is forwarded whole to one replica's app (:class:`EngineReplica`), so the
API is the single server's. Chat and completion requests go to the replica that most likely holds
their prompt's prefix (:mod:`hybridllm.server.routing`); the others to the least loaded. Its own
routes:

- ``GET /metrics``: every live replica's series with a ``replica="<id>"`` label
  (:mod:`hybridllm.server.replica_metrics`), plus the ingress's routing series.
- ``GET /health`` (and ``HEAD``): 200 while at least one replica answers, else 503 with
  ``Retry-After``; per replica ``ok``, ``down``, ``unreachable`` or ``unknown``
  (:mod:`.liveness`). It reads what the background probes found, so it answers at once whatever
  the replicas do.
- ``GET /replicas``: per replica: its status, live or not, requests in flight through the
  ingress, and what it last reported (process id, host, running and waiting requests).
- ``GET /`` (and the page's files): the page of the single server (:mod:`hybridllm.server.page_assets`),
  which shows each replica.
- ``GET /stats``: ``{"replicas": [...]}``, per replica its ``/replicas`` entry and ``stats``: its own
  ``/stats`` body (null while it does not answer).

The ingress probes every replica each second. A replica whose process dies is replaced by Ray
Serve (its health checks); the ingress stops routing to it at its first failed call or probe
(``down``), or at a probe that times out (``unreachable``: a hung process, a node gone), and routes
to it again once it answers. Its requests in flight are answered at once: 503 with ``Retry-After``
and an OpenAI error object, or, when their SSE stream had begun, an error event and ``[DONE]``.
The ingress deployment is placed on the Ray head node (``build_app``), so a worker node's loss
does not take the HTTP front with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridllm.loading.registry import open_checkpoint
from hybridllm.server.asgi_bridge import ForwardedRequest, ResponseStart
from hybridllm.server.metrics import CONTENT_TYPE, PREFIX
from hybridllm.server.page_assets import PAGE_FILES, page_response
from hybridllm.server.protocol import RETRY_AFTER_S, error_body
from hybridllm.server.replica_metrics import REPLICA_LABEL, merge_replica_metrics
from hybridllm.server.ray.liveness import DOWN, UNREACHABLE, ReplicaLiveness
from hybridllm.server.routing import DEFAULT_MAX_IMBALANCE, HashRing, PageKey, Route, choose_replica, prefix_key

logger = logging.getLogger(__name__)

# what a call raises when its replica's process died or Ray stopped routing to it
REPLICA_ERRORS = (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
PROBE_TIMEOUT_S = 5.0  # a replica that does not describe itself within this is unreachable
WATCH_INTERVAL_S = 1.0
SKIPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


class ReplicaLost(Exception):
    """The replica of a request in flight stopped being live (its probe timed out, or another
    call saw its process end)."""


def unavailable(message: str, code: str) -> JSONResponse:
    """A 503 with an OpenAI error object and Retry-After."""
    return JSONResponse(error_body(message, type="server_error", code=code), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def replica_failed_message(replica: str, status: str = DOWN) -> str:
    why = "stopped answering" if status == UNREACHABLE else "failed (its process ended)"
    return f"engine replica {replica} {why} while answering this request; retry the request"


async def until_lost(awaitable: Any, lost: asyncio.Event) -> Any:
    """``awaitable``'s result, or :class:`ReplicaLost` (``awaitable`` cancelled) once ``lost`` is set."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(lost.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ReplicaLost()


def replica_error_message(replica: str, exc: RayTaskError) -> str:
    cause = exc.cause if isinstance(exc.cause, BaseException) else exc
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return f"internal error in engine replica {replica}: {lines[-1] if lines else type(cause).__name__}"


def sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def response_headers(start: ResponseStart) -> dict[str, str]:
    """The app's headers to send again (the ingress's server sets the framing ones)."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in start.headers
            if name.decode("latin-1") not in SKIPPED_HEADERS}


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # the replica's app answers it with a 400
        return None


class IngressMetrics:
    """The ingress's own series, each with a ``replica`` label: requests routed (by reason:
    ``prefix`` or ``least_loaded``), requests failed with their replica, and at scrape time
    requests in flight and whether each replica is live.

    Args:
        ingress: read at scrape time.
    """

    def __init__(self, ingress: Ingress) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter(f"{PREFIX}ingress_routed", "Requests the ingress sent to each replica, by reason.",
                              [REPLICA_LABEL, "reason"], registry=self.registry)
        self.failed = Counter(f"{PREFIX}ingress_replica_failures",
                              "Requests answered 503 (or ended by an SSE error) because their replica failed.",
                              [REPLICA_LABEL], registry=self.registry)
        for replica in ingress.replicas:
            self.failed.labels(replica)
            for reason in ("prefix", "least_loaded"):
                self.routed.labels(replica, reason)
        self.registry.register(_IngressCollector(ingress))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IngressCollector(Collector):
    """Gauges read from the ingress when scraped: in-flight requests and liveness per replica."""

    def __init__(self, ingress: Ingress) -> None:
        self.ingress = ingress

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(f"{PREFIX}ingress_in_flight", "Requests each replica is answering for "
                                      "the ingress.", labels=[REPLICA_LABEL])
        up = GaugeMetricFamily(f"{PREFIX}ingress_replica_up", "1 while the replica answers, 0 while it is down.",
                               labels=[REPLICA_LABEL])
        live = set(self.ingress.liveness.live)
        for replica in self.ingress.replicas:
            in_flight.add_metric([replica], self.ingress.in_flight[replica])
            up.add_metric([replica], float(replica in live))
        yield in_flight
        yield up


class Ingress:
    """The HTTP front of the engine replicas (a Ray Serve deployment's callable).

    Args:
        engines: a handle per engine replica's deployment; replica ids are their positions.
        max_imbalance: a request leaves its prefix's replica for the least loaded one when that
            replica has this many more requests in flight.
        route_by_pages: route by the first prefix-cache page of token ids, tokenized with
            ``model``'s tokenizer (False: by the prompt's first characters, :func:`prefix_key`).
        model: the served model (a path, or None for the default model).
        probe_timeout_s: a replica that does not answer a probe within this is unreachable.
    """

    def __init__(self, engines: list[DeploymentHandle], max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 route_by_pages: bool = False, model: str | None = None,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.route_key = PageKey(open_checkpoint(model).tokenizer()) if route_by_pages else prefix_key
        self.replicas = [str(i) for i in range(len(engines))]
        self.handles = dict(zip(self.replicas, engines, strict=True))
        self.ring = HashRing(self.replicas)
        self.max_imbalance = max_imbalance
        self.probe_timeout_s = probe_timeout_s
        self.liveness = ReplicaLiveness(self.replicas)  # every replica unknown until probed
        self.in_flight = dict.fromkeys(self.replicas, 0)
        self.reported: dict[str, dict[str, Any]] = {}  # each replica's last describe()
        self.metrics = IngressMetrics(self)
        self._watcher: asyncio.Task[None] | None = None

    async def check_health(self) -> None:
        """Ray Serve's health check of the ingress: starts the replica probes if no request has."""
        self._watch()

    async def __call__(self, request: Request) -> Response:
        self._watch()
        path = request.url.path
        if request.method in ("GET", "HEAD") and path == "/health":
            return self.health()
        if not self.liveness.probed.is_set():  # just started: answer once the replicas have been asked
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.liveness.probed.wait(), self.probe_timeout_s + 1)
        if request.method == "GET" and path == "/metrics":
            return Response(await self.metrics_text(), media_type=CONTENT_TYPE)
        if request.method == "GET" and path == "/replicas":
            return JSONResponse(self.replica_table())
        if request.method == "GET" and path in PAGE_FILES:
            return page_response(path)
        if request.method == "GET" and path == "/stats":
            return await self.stats(request.query_params.get("since"))
        body = await request.body()
        key = self.route_key(parse_json(body)) if request.method == "POST" and path in ROUTED_PATHS else None
        route = choose_replica(key, self.ring, self.liveness.live, self.in_flight, self.max_imbalance)
        if route is None:
            return unavailable("no engine replica is answering (Ray Serve is restarting them); retry shortly",
                               "no_replica")
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     [(bytes(k), bytes(v)) for k, v in request.scope["headers"]], body)
        return await self.forward(route, forwarded)

    # ---- forwarding ----------------------------------------------------------------------
    async def forward(self, route: Route, request: ForwardedRequest) -> Response:
        """Send ``request`` to the route's replica: SSE bodies are relayed as they come, others read whole."""
        replica = route.replica
        self.metrics.routed.labels(replica, route.reason).inc()
        self.in_flight[replica] += 1
        lost = self.liveness.lost(replica)
        stream: DeploymentResponseGenerator | None = None
        relayed = finished = False
        try:
            stream = self.handles[replica].options(stream=True).handle_http.remote(request)
            start = await until_lost(stream.__anext__(), lost)
            if start.is_event_stream:
                relayed = True
                return StreamingResponse(self.relay(replica, stream, lost), status_code=start.status,
                                         headers=response_headers(start))
            parts = []
            while True:
                try:
                    parts.append(await until_lost(stream.__anext__(), lost))
                except StopAsyncIteration:
                    break
            finished = True
            return Response(b"".join(parts), status_code=start.status, headers=response_headers(start))
        except REPLICA_ERRORS as exc:
            finished = True
            self.replica_failed(replica, exc)
            return unavailable(replica_failed_message(replica), "replica_unavailable")
        except ReplicaLost:
            self.metrics.failed.labels(replica).inc()
            return unavailable(replica_failed_message(replica, self.liveness.status[replica]), "replica_unavailable")
        except RayTaskError as exc:  # the replica raised outside its app's error handlers
            finished = True
            logger.error("%s", exc)
            return JSONResponse(error_body(replica_error_message(replica, exc), type="server_error"), status_code=500)
        finally:
            if not relayed:
                self.in_flight[replica] -= 1
                if not finished and stream is not None:  # cancelled (the client went away): the replica aborts
                    stream.cancel()

    async def relay(self, replica: str, stream: DeploymentResponseGenerator,
                    lost: asyncio.Event) -> AsyncIterator[bytes]:
        """The rest of an SSE body; a replica failure, or the replica lost, ends it with an error
        event and ``[DONE]``."""
        finished = False
        try:
            while True:
                try:
                    part = await until_lost(stream.__anext__(), lost)
                except StopAsyncIteration:
                    break
                yield part
            finished = True
        except (*REPLICA_ERRORS, ReplicaLost) as exc:
            if isinstance(exc, ReplicaLost):
                self.metrics.failed.labels(replica).inc()
            else:
                finished = True
                self.replica_failed(replica, exc)
            yield sse_event(error_body(replica_failed_message(replica, self.liveness.status[replica]),
                                       type="server_error", code="replica_unavailable"))
            yield b"data: [DONE]\n\n"
        except RayTaskError as exc:
            finished = True
            logger.error("%s", exc)
            yield sse_event(error_body(replica_error_message(replica, exc), type="server_error"))
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight[replica] -= 1
            if not finished:  # the client closed the stream: the replica aborts the request
                stream.cancel()

    def replica_failed(self, replica: str, exc: BaseException) -> None:
        """A request's replica failed: count it, and route no more to the replica until it answers."""
        self.metrics.failed.labels(replica).inc()
        self.mark_down(replica, exc)

    def mark_down(self, replica: str, exc: BaseException) -> None:
        self.liveness.lose(replica, DOWN, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    # ---- liveness ------------------------------------------------------------------------
    def _watch(self) -> None:
        """Start probing the replicas every :data:`WATCH_INTERVAL_S` (once, on the serving loop)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            await self.probe_all()
            self.liveness.probed.set()
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def probe(self, replica: str) -> None:
        """Ask ``replica`` to describe itself: an answer makes it ``ok``, a Ray failure ``down``,
        no answer within the probe timeout ``unreachable`` (either way its requests in flight
        are answered 503 at once)."""
        response = self.handles[replica].describe.remote()
        try:
            self.reported[replica] = await asyncio.wait_for(asyncio.ensure_future(response), self.probe_timeout_s)
        except REPLICA_ERRORS as exc:
            self.mark_down(replica, exc)
            return
        except asyncio.TimeoutError:
            response.cancel()
            self.liveness.lose(replica, UNREACHABLE, f"no answer to a probe within {self.probe_timeout_s:.0f} s")
            return
        self.liveness.answered(replica, self.reported[replica].get("pid"))

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in self.replicas))

    def replica_table(self) -> list[dict[str, Any]]:
        live = set(self.liveness.live)
        return [{**self.reported.get(replica, {}), "replica": replica, "status": self.liveness.status[replica],
                 "live": replica in live, "in_flight": self.in_flight[replica]} for replica in self.replicas]

    def health(self) -> JSONResponse:
        """200 while a replica is live, else 503 with Retry-After; each replica's status. Never
        waits for a replica: the background probes keep the status."""
        live = self.liveness.live
        body = {"status": "ok" if live else "unavailable", "replicas": dict(self.liveness.status)}
        if live:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def stats(self, since: str | None) -> JSONResponse:
        """Every replica's ``/replicas`` entry with its ``/stats`` body (null when it did not answer)."""
        try:
            after = float(since) if since is not None else None
        except ValueError:
            return JSONResponse(error_body(f"invalid value for since: {since!r} is not a number", param="since",
                                           code="invalid_value"), status_code=400)
        live = self.liveness.live
        responses = [self.handles[replica].stats.remote(after) for replica in live]
        results = await asyncio.gather(*(asyncio.wait_for(asyncio.ensure_future(r), self.probe_timeout_s)
                                         for r in responses), return_exceptions=True)
        bodies: dict[str, dict[str, Any]] = {}
        for replica, result in zip(live, results, strict=True):
            if isinstance(result, dict):
                bodies[replica] = result
            elif isinstance(result, REPLICA_ERRORS):
                self.mark_down(replica, result)
        return JSONResponse({"replicas": [{**entry, "stats": bodies.get(entry["replica"])}
                                          for entry in self.replica_table()]})

    # ---- metrics -------------------------------------------------------------------------
    async def metrics_text(self) -> bytes:
        """Every live replica's exposition, relabelled, then the ingress's own series."""
        live = self.liveness.live
        responses = [self.handles[replica].metrics_text.remote() for replica in live]
        results = await asyncio.gather(*(asyncio.wait_for(asyncio.ensure_future(r), self.probe_timeout_s)
                                         for r in responses), return_exceptions=True)
        texts = {}
        for replica, result in zip(live, results, strict=True):
            if isinstance(result, str):
                texts[replica] = result
            elif isinstance(result, REPLICA_ERRORS):
                self.mark_down(replica, result)
        return merge_replica_metrics(texts) + self.metrics.render()
