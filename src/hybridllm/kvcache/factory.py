"""Build the KV cache a ``KVConfig`` names, on the devices a placement gives."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.host import HostCache
from hybridllm.kvcache.offloaded import OffloadedCache
from hybridllm.kvcache.quantized import QuantizedCache
from hybridllm.kvcache.split import SplitCache
from hybridllm.kvcache.tiered import TieredCache


def create_cache(config: KVConfig, spec: KVSpec, ledger: MemoryLedger | None = None,
                 layer_tiers: Sequence[str] | None = None) -> KVCache:
    """A fresh, empty cache of the strategy ``config.kv_cache``.

    Without a ``ledger``, one is made from ``config.vram_budget`` (the whole budget goes to KV).
    ``layer_tiers`` ("device"/"host" per layer, from a placement): layers on the host keep their
    KV in host RAM (:class:`~hybridllm.kvcache.split.SplitCache`); None means every layer on the device.
    """
    if ledger is None:
        ledger = MemoryLedger({"device": config.vram_budget}, threshold=config.kv_threshold)
    if layer_tiers is not None and any(tier != "device" for tier in layer_tiers):
        return SplitCache(spec, layer_tiers, ledger, lambda part_spec, part_ledger: create_cache(config, part_spec, part_ledger),
                          page_size=config.kv_page_size)
    strategy = config.kv_cache
    if strategy == "dynamic":
        return DynamicCache(spec, ledger, page_size=config.kv_page_size)
    if strategy == "offloaded":
        return OffloadedCache(spec, ledger, page_size=config.kv_page_size)
    if strategy == "host":
        return HostCache(spec, ledger, page_size=config.kv_page_size)
    if strategy == "quantized":
        return QuantizedCache(spec, ledger, bits=config.kv_bits, group_size=config.kv_group_size,
                              residual=config.kv_residual)
    if strategy == "tiered":
        return TieredCache(
            spec, ledger,
            page_size=config.kv_page_size,
            hot_window=config.kv_hot_window,
            sink_tokens=config.kv_sink_tokens,
            cold_bits=config.kv_cold_bits,
            group_size=config.kv_group_size,
            offload_percent=config.kv_offload_percent,
        )
    raise ConfigError(f"KV cache strategy {strategy!r} is not available")
