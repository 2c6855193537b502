"""``GET /stats``: the engine's state as one small JSON object, for the page at ``/`` (and scripts).

Where ``/metrics`` is Prometheus text for a scraper, ``/stats`` is what a person looks at: memory
per tier (weights, KV and prefix-cache pages on the device and the host, page files on disk),
bytes over the bus per second, requests running and waiting, decode tokens per second, the prefix
cache's pages and hit rate, the placement (the tier of every layer) and, for every running
sequence, how many of its tokens each layer holds on the host (the rest are on the device). Both
read the same :class:`~hybridllm.server.engine_view.EngineView`.

Rates come from samples of the counters taken as ``/stats`` is read (at most one per
:data:`MIN_SAMPLE_INTERVAL_S`), kept for :data:`HISTORY_S` seconds: ``history`` holds them (the
page's sparklines), and a rate is the change between the last two samples over their interval.
``/stats?since=T`` returns only the history after ``T`` (the page asks for what it lacks).

:class:`Stats` (pydantic) is the body's schema; it is in the server's OpenAPI document.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from hybridllm import __version__
from hybridllm.server.engine_view import EngineState, EngineView
from hybridllm.server.metrics import ServerMetrics

HISTORY_S = 300.0  # the sparklines' window
MIN_SAMPLE_INTERVAL_S = 0.5  # two readers (two open pages) do not halve the interval


# ---- the body's schema -------------------------------------------------------------------
class TierMemory(BaseModel):
    """Bytes held in one memory tier, and what it has."""

    weights: int = Field(description="Model weight bytes in this tier.")
    kv: int = Field(description="KV cache bytes of the running requests (the ledger).")
    kv_budget: int | None = Field(description="The KV budget of this tier (null: unbounded).")
    prefix_cache: int = Field(description="Bytes of reusable KV pages the prefix cache holds here.")
    capacity: int = Field(description="The tier's memory: the GPU's, or the host RAM.")


class DiskMemory(BaseModel):
    prefix_cache: int = Field(description="Bytes of prefix-cache page files.")
    budget: int = Field(description="Bytes of page files allowed (0: no disk tier).")


class Memory(BaseModel):
    device: TierMemory
    host: TierMemory
    disk: DiskMemory
    device_is_host: bool = Field(description="The CPU stands in for the device: both tiers share the host RAM.")


class Requests(BaseModel):
    running: int = Field(description="Sequences prefilling or decoding.")
    waiting: int = Field(description="Requests in the queue.")


class KVStats(BaseModel):
    strategy: str
    page_size: int = Field(description="Tokens per KV page.")
    pages: dict[str, int] = Field(description="KV pages held per tier (device, host).")
    reserved_bytes: int = Field(description="KV promised to running requests (prompt + max_tokens).")
    holdable_bytes: int = Field(description="KV bytes the engine can hold (kv_cache_holdable_bytes).")


class Bus(BaseModel):
    bytes: dict[str, int] = Field(description="Bytes moved since start, per direction (h2d, d2h, hidden_states).")
    bytes_per_s: float = Field(description="All directions, over the last sample interval.")


class Decode(BaseModel):
    tokens_per_s: float = Field(description="Tokens generated per second, all requests, over the last sample "
                                "interval.")
    generated_tokens: int = Field(description="Tokens generated since start.")
    prompt_tokens: int = Field(description="Prompt tokens prefilled since start.")


class PrefixCacheStats(BaseModel):
    pages: dict[str, int] = Field(description="Pages held per tier (device, host: RAM, disk).")
    bytes: dict[str, int] = Field(description="Bytes held per tier.")
    budgets: dict[str, int] = Field(description="Bytes allowed per tier.")
    queries: int = Field(description="Prompt tokens looked up.")
    hits: int = Field(description="Prompt tokens whose KV the cache supplied.")
    hit_rate: float | None = Field(description="hits / queries (null before any lookup).")


class PlacementStats(BaseModel):
    device: str
    dtype: str
    weights: str = Field(description="The weight format (int4, int8, float32 ...).")
    decode_on: str
    embed: str = Field(description="The tier of the token embedding.")
    head: str = Field(description="The tier of the output head.")
    layers: list[str] = Field(description="The tier of each decoder layer's weights.")
    max_batch: int
    prefill_chunk: int


class SequenceLayout(BaseModel):
    id: str = Field(description="The request id.")
    index: int = Field(description="Which of the request's n sequences.")
    tokens: list[int] = Field(description="Tokens cached per layer.")
    host_tokens: list[int] = Field(description="Of those, the tokens held in the host tier, per layer.")


class HistoryPoint(BaseModel):
    t: float = Field(description="Unix time of the sample.")
    decode_tokens_per_s: float
    bus_bytes_per_s: float
    running: int
    waiting: int
    kv_bytes: int = Field(description="KV bytes held, all tiers.")


class Stats(BaseModel):
    """The body of ``GET /stats``."""

    model: str
    version: str
    time: float = Field(description="Unix time of this snapshot.")
    uptime_s: float
    requests: Requests
    memory: Memory
    kv: KVStats
    bus: Bus
    decode: Decode
    prefix_cache: PrefixCacheStats | None = Field(description="null when the prefix cache is off.")
    placement: PlacementStats
    sequences: list[SequenceLayout] = Field(description="Where each running sequence's KV is.")
    history: list[HistoryPoint] = Field(description=f"Samples of the last {HISTORY_S:.0f} s (after ?since=).")


# ---- the samples -------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """The counters at one moment, and the rates since the sample before."""

    t: float
    generated_tokens: int
    bus_bytes: int
    decode_tokens_per_s: float
    bus_bytes_per_s: float
    running: int
    waiting: int
    kv_bytes: int

    def point(self) -> dict[str, Any]:
        return {"t": self.t, "decode_tokens_per_s": self.decode_tokens_per_s, "bus_bytes_per_s": self.bus_bytes_per_s,
                "running": self.running, "waiting": self.waiting, "kv_bytes": self.kv_bytes}


class SampleHistory:
    """Samples of the last ``window_s`` seconds, at most one per ``min_interval_s``.

    Args:
        window_s: how long a sample is kept.
        min_interval_s: a reading sooner than this after the last sample takes none.
    """

    def __init__(self, window_s: float = HISTORY_S, min_interval_s: float = MIN_SAMPLE_INTERVAL_S) -> None:
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.samples: collections.deque[Sample] = collections.deque()

    def record(self, t: float, generated_tokens: int, bus_bytes: int, running: int, waiting: int,
               kv_bytes: int) -> Sample:
        """Take a sample at ``t`` (or keep the last one when it is too recent); returns the latest."""
        last = self.samples[-1] if self.samples else None
        if last is not None and t - last.t < self.min_interval_s:
            return last
        decode_rate = bus_rate = 0.0
        if last is not None:
            interval = t - last.t
            decode_rate = max(0, generated_tokens - last.generated_tokens) / interval
            bus_rate = max(0, bus_bytes - last.bus_bytes) / interval
        sample = Sample(t, generated_tokens, bus_bytes, decode_rate, bus_rate, running, waiting, kv_bytes)
        self.samples.append(sample)
        while self.samples and self.samples[0].t < t - self.window_s:
            self.samples.popleft()
        return sample

    def points(self, since: float | None = None) -> list[dict[str, Any]]:
        return [s.point() for s in self.samples if since is None or s.t > since]


# ---- the body ----------------------------------------------------------------------------
class ServerStats:
    """The ``/stats`` body of one server.

    Args:
        view: the engine.
        metrics: the server's counters (tokens generated and prefilled).
        model_name: the served model id.
        clock: the time source (Unix seconds).
    """

    def __init__(self, view: EngineView, metrics: ServerMetrics, model_name: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.view = view
        self.metrics = metrics
        self.model_name = model_name
        self.clock = clock
        self.started = clock()
        self.history = SampleHistory()

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The body (:class:`Stats`), sampling the counters; ``since``: history after this time only."""
        now = self.clock()
        state = self.view.state()
        tokens = self.metrics.token_totals()
        bus_total = sum(state.bus_bytes.values())
        sample = self.history.record(now, tokens["generated"], bus_total, state.running, state.waiting,
                                     sum(state.kv_bytes.values()))
        placement = self.view.placement
        return {
            "model": self.model_name,
            "version": __version__,
            "time": now,
            "uptime_s": now - self.started,
            "requests": {"running": state.running, "waiting": state.waiting},
            "memory": self._memory(state),
            "kv": {"strategy": placement.kv_strategy, "page_size": placement.kv_page_size,
                   "pages": state.kv_pages, "reserved_bytes": state.kv_reserved_bytes,
                   "holdable_bytes": self.view.kv_holdable_bytes},
            "bus": {"bytes": state.bus_bytes, "bytes_per_s": sample.bus_bytes_per_s},
            "decode": {"tokens_per_s": sample.decode_tokens_per_s, "generated_tokens": tokens["generated"],
                       "prompt_tokens": tokens["prompt"]},
            "prefix_cache": None if state.prefix_cache is None else {
                "pages": state.prefix_cache.pages, "bytes": state.prefix_cache.bytes,
                "budgets": state.prefix_cache.budgets, "queries": state.prefix_cache.queries,
                "hits": state.prefix_cache.hits, "hit_rate": state.prefix_cache.hit_rate},
            "placement": {"device": placement.device, "dtype": placement.dtype, "weights": placement.weights_format,
                          "decode_on": placement.decode_on, "embed": placement.embed_tier,
                          "head": placement.head_tier, "layers": list(placement.layer_tiers),
                          "max_batch": placement.max_batch, "prefill_chunk": placement.prefill_chunk},
            "sequences": [{"id": seq.request_id, "index": seq.index, "tokens": list(seq.tokens),
                           "host_tokens": list(seq.host_tokens)} for seq in state.sequences],
            "history": self.history.points(since),
        }

    def _memory(self, state: EngineState) -> dict[str, Any]:
        capacity = self.view.memory_capacity()
        prefix = state.prefix_cache.bytes if state.prefix_cache is not None else {}
        budgets = state.prefix_cache.budgets if state.prefix_cache is not None else {}
        tiers = {tier: {"weights": state.weight_bytes.get(tier, 0), "kv": state.kv_bytes.get(tier, 0),
                        "kv_budget": state.kv_budget_bytes.get(tier), "prefix_cache": prefix.get(tier, 0),
                        "capacity": capacity[tier]} for tier in ("device", "host")}
        return {**tiers, "disk": {"prefix_cache": prefix.get("disk", 0), "budget": budgets.get("disk", 0)},
                "device_is_host": self.view.device_is_host}
