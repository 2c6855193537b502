"""Build the KV cache a ``KVConfig`` names, on the devices a placement gives."""

from __future__ import annotations

from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache


def create_cache(config: KVConfig, spec: KVSpec, ledger: MemoryLedger | None = None) -> KVCache:
    """A fresh, empty cache of the strategy ``config.kv_cache``."""
    if ledger is None:
        ledger = MemoryLedger({"device": config.vram_budget}, threshold=config.kv_threshold)
    if config.kv_cache == "dynamic":
        return DynamicCache(spec, ledger, page_size=config.kv_page_size)
    raise ConfigError(f"KV cache strategy {config.kv_cache!r} is not available yet")
