"""The one read-only view of the engine's state that the server shows.

``/stats`` (:mod:`hybridllm.server.stats`), ``/metrics`` (:mod:`hybridllm.server.metrics`) and the
page at ``/`` read the engine through an :class:`EngineView` and nothing else: requests running and
waiting, KV bytes and pages per tier, bus bytes, weight bytes per tier, the prefix cache, where
every layer and every running sequence's KV pages are. The view reads only the public accessors of
the request loop (:meth:`~hybridllm.engine.scheduler.Scheduler.stats`, ``kv_layout``,
``kv_tiers``), the runtime's facts and the prefix cache's usage; it changes nothing.

    view = EngineView(scheduler)
    state = view.state()           # an EngineState snapshot (cheap: call it per scrape)
    view.placement.layer_tiers     # ("device", ..., "host")
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from hybridllm.engine.scheduler import Scheduler
from hybridllm.engine.sequence import SequenceKV


@dataclass(frozen=True)
class PlacementFacts:
    """Where the model runs and how (fixed when the runtime is built).

    Attributes:
        device: the compute device ("cpu", "cuda:0").
        dtype: the compute dtype.
        weights_format: what the matrices run as ("int4", "float32", ...).
        kv_strategy: the KV cache strategy ("dynamic", "tiered", ...).
        kv_page_size: tokens per KV page.
        max_batch: most sequences running at once.
        prefill_chunk: prompt tokens per prefill forward.
        decode_on: "device", or "host" (phase migration).
        layer_tiers: the tier of each decoder layer's weights.
        embed_tier: the tier of the token embedding.
        head_tier: the tier of the final norm and output head.
    """

    device: str
    dtype: str
    weights_format: str
    kv_strategy: str
    kv_page_size: int
    max_batch: int
    prefill_chunk: int
    decode_on: str
    layer_tiers: tuple[str, ...]
    embed_tier: str
    head_tier: str

    @property
    def n_layers(self) -> int:
        return len(self.layer_tiers)

    @property
    def layers_on_device(self) -> int:
        return sum(tier == "device" for tier in self.layer_tiers)


@dataclass(frozen=True)
class PrefixCacheUsage:
    """The prefix cache: lookups and hits (prompt tokens), pages, bytes and budgets per tier
    ("device", "host": RAM, "disk")."""

    queries: int
    hits: int
    pages: dict[str, int]
    bytes: dict[str, int]
    budgets: dict[str, int]

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups, in prompt tokens (None before any lookup)."""
        return self.hits / self.queries if self.queries else None


@dataclass(frozen=True)
class EngineState:
    """One snapshot of the engine, as a scrape sees it.

    Attributes:
        running: sequences prefilling or decoding.
        paused: sequences paused because their client does not read (their KV kept).
        waiting: requests in the queue.
        kv_bytes: KV bytes held per tier (the ledger).
        kv_pages: KV pages held per tier (bytes over the page's bytes, rounded up).
        kv_budget_bytes: KV budget per tier (None: unbounded).
        kv_reserved_bytes: KV promised to running requests (prompt + max_tokens).
        bus_bytes: bytes moved since start, per direction ("h2d", "d2h", "hidden_states").
        weight_bytes: weight bytes per tier.
        prefix_cache: its usage, or None without a prefix cache.
        sequences: where each running sequence's KV is, per layer.
    """

    running: int
    paused: int
    waiting: int
    kv_bytes: dict[str, int]
    kv_pages: dict[str, int]
    kv_budget_bytes: dict[str, int | None]
    kv_reserved_bytes: int
    bus_bytes: dict[str, int]
    weight_bytes: dict[str, int]
    prefix_cache: PrefixCacheUsage | None
    sequences: list[SequenceKV]


class EngineView:
    """Read-only access to one request loop and its runtime.

    Args:
        scheduler: the request loop (and through it the runtime and the prefix cache).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        runtime = scheduler.runtime
        placement = runtime.placement
        self.placement = PlacementFacts(
            device=str(scheduler.device), dtype=runtime.engine_config.dtype,
            weights_format=str(runtime.weights_format), kv_strategy=scheduler.kv_strategy,
            kv_page_size=scheduler.page_size, max_batch=scheduler.max_batch,
            prefill_chunk=scheduler.prefill_chunk, decode_on=placement.decode_on,
            layer_tiers=tuple(placement.layer_tiers), embed_tier=placement.embed_tier,
            head_tier=placement.head_tier)
        self.kv_holdable_bytes = self._holdable_kv_bytes()  # at start: memory the KV can have

    @property
    def is_running(self) -> bool:
        """Whether the request loop's thread runs."""
        return self._scheduler.is_running

    def requests(self) -> tuple[int, int]:
        """Requests running and waiting now."""
        return self._scheduler.num_running, self._scheduler.num_waiting

    @property
    def device_is_host(self) -> bool:
        """Whether the compute device is the CPU (then "device" and "host" share the RAM)."""
        return self._scheduler.device.type == "cpu"

    def state(self) -> EngineState:
        """A snapshot of the engine now (read from any thread; it may be one step old)."""
        s = self._scheduler
        stats = s.stats()
        prefix = s.prefix_cache
        usage = None
        if prefix is not None:
            usage = PrefixCacheUsage(queries=prefix.stats.queries, hits=prefix.stats.hits,
                                     pages=prefix.pages_per_tier(), bytes=prefix.bytes_per_tier(),
                                     budgets=prefix.budget_per_tier())
        return EngineState(
            running=stats["running"], paused=stats["paused"], waiting=stats["waiting"], kv_bytes=stats["kv_bytes"],
            kv_pages=stats["kv_pages"], kv_budget_bytes=stats["kv_budget_bytes"],
            kv_reserved_bytes=stats["kv_reserved_bytes"], bus_bytes=stats["bus_bytes"],
            weight_bytes=dict(s.runtime.weight_bytes), prefix_cache=usage, sequences=s.kv_layout())

    def memory_capacity(self) -> dict[str, int]:
        """The memory each tier has: the GPU's total on a CUDA device, else (the CPU stands in
        for the device) the host RAM, which both tiers then share."""
        ram = psutil.virtual_memory().total
        device = self._scheduler.device
        on_gpu = device.type == "cuda"
        return {"device": torch.cuda.mem_get_info(device)[1] if on_gpu else ram, "host": ram}

    def _holdable_kv_bytes(self) -> int:
        """KV bytes the engine can hold, counting each memory once.

        The tiers admission counts live in two memories: a GPU's (the device tier on CUDA) and
        the host RAM (the host tier, and the device tier too when the CPU plays the device). A
        memory holds the sum of its tiers' budgets, but no more than it has: its free memory now
        plus the KV it already holds (what an unbounded tier may grow into). Budgets above the
        machine's RAM (a host budget set to the RAM available at start, beside an unbounded CPU
        "device" tier) are so counted once, not twice.
        """
        s = self._scheduler
        stats = s.stats()
        budgets, held = stats["kv_budget_bytes"], stats["kv_bytes"]
        on_gpu = s.device.type == "cuda"
        memories: dict[str, list[str]] = {}
        for tier in s.kv_tiers:
            memories.setdefault("gpu" if tier == "device" and on_gpu else "ram", []).append(tier)
        total = 0
        for memory, tiers in memories.items():
            free = torch.cuda.mem_get_info(s.device)[0] if memory == "gpu" else psutil.virtual_memory().available
            has = free + sum(held[tier] for tier in tiers)
            tier_budgets = [budgets[tier] for tier in tiers]
            total += has if None in tier_budgets else min(has, sum(tier_budgets))
        return total


__all__ = ["EngineState", "EngineView", "PlacementFacts", "PrefixCacheUsage", "SequenceKV"]
