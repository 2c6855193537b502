"""Re-planning while a request runs: relieve a full device tier instead of failing.

After every step of a generation the engine asks :class:`AdaptivePolicy` whether the device
ledger has crossed its eviction threshold (``--kv-threshold`` of the device budget). If so it
takes the cheapest action that frees device memory, logs it, and records it in the request's
metrics (``adaptive_actions``):

1. a tiered cache whose hot window is larger than one page gets half the window (the older hot
   pages move to the host on the next step);
2. otherwise decoding migrates to the host: the KV moves to host RAM and the request continues
   on a host copy of the weights (the same path as ``--decode-on host``).

A step that cannot fit at all (a tiered cache's budget below one prefill chunk raises
``KVBudgetError`` mid-step) is rolled back to its start and re-run on the host.

When the host tier crosses its threshold, a tiered cache whose cold pages are full precision
quantizes them to 8 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm.engine.migration import PhaseMigration
from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.tiered import TieredCache
from hybridllm.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class AdaptivePolicy:
    """Watches a request's ledger and re-plans when a tier fills up.

    Args:
        migration: gives the host decode model and the host cache (built on first use: the
            host copy of the weights costs memory and time only when it is needed).
    """

    migration: Callable[[], PhaseMigration]

    def relieve(self, cache: KVCache, model: ModelRunner, reserve_tokens: int, actions: list[str]
                ) -> tuple[KVCache, ModelRunner]:
        """The cache and model to continue with: unchanged unless a tier is over its threshold.

        Args:
            cache, model: what the request runs on now.
            reserve_tokens: the request's prompt plus token budget (for a migrated cache).
            actions: receives one line per action taken.
        """
        ledger = cache.ledger
        if ledger.over_threshold("host") and isinstance(cache, TieredCache) and cache.cold_bits == 16:
            cache.quantize_cold(8)
            _log(actions, "host KV over its threshold: cold pages quantized to 8 bits")
        if not ledger.over_threshold("device"):
            return cache, model
        if isinstance(cache, TieredCache) and cache.hot_window > cache.page_size:
            old = cache.hot_window
            cache.hot_window = max(cache.page_size, old // 2)
            _log(actions, f"device KV over its threshold: hot window {old} -> {cache.hot_window} tokens")
            return cache, model
        return self.move_to_host(cache, reserve_tokens, actions, "device KV over its threshold")

    def move_to_host(self, cache: KVCache, reserve_tokens: int, actions: list[str], why: str
                     ) -> tuple[KVCache, ModelRunner]:
        """Migrate the request to the host: its KV to a host cache, the rest of it to the host model."""
        migration = self.migration()
        host_cache = migration.migrate(cache, reserve_tokens)
        _log(actions, f"{why}: decoding moved to the host ({host_cache.bus_bytes['d2h']} bytes of KV migrated)")
        return host_cache, migration.decode_model


def _log(actions: list[str], action: str) -> None:
    logger.warning("adaptive: %s", action)
    actions.append(action)
