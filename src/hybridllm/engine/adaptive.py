"""Re-planning while a sequence runs: relieve a full device tier instead of failing.

A per-sequence policy of the request loop (called through :mod:`hybridllm.engine.policies`), so
``generate`` and ``serve`` re-plan alike. After every forward of a sequence the loop asks
:class:`AdaptivePolicy` whether the device
ledger has crossed its eviction threshold (``--kv-threshold`` of the device budget). If so it
takes the cheapest action that frees device memory, logs it, and records it in the request's
metrics (``adaptive_actions``; the server counts them in ``/metrics``):

1. a tiered cache whose hot window is larger than one page gets half the window (the older hot
   pages move to the host on the next step);
2. otherwise decoding migrates to the host: the KV moves to host RAM and the sequence continues
   on the host runner (the same path as ``--decode-on host``).

A step that cannot fit at all (a tiered cache's budget below one prefill chunk raises
``KVBudgetError`` mid-step) is rolled back to its start and re-run on the host.

When the host tier crosses its threshold, a tiered cache whose cold pages are full precision
quantizes them to 8 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.tiered import TieredCache
from hybridllm.runtime.migration import PhaseMigration

logger = logging.getLogger(__name__)

# The kinds of action (the server's metrics count them by kind).
SHRINK_HOT_WINDOW, QUANTIZE_COLD, MOVE_TO_HOST = "shrink_hot_window", "quantize_cold", "move_to_host"
ADAPTIVE_ACTION_KINDS = (SHRINK_HOT_WINDOW, QUANTIZE_COLD, MOVE_TO_HOST)


class AdaptiveAction(str):
    """One action's description (the line in ``adaptive_actions``) that also knows its ``kind``."""

    kind: str

    def __new__(cls, kind: str, description: str) -> AdaptiveAction:
        if kind not in ADAPTIVE_ACTION_KINDS:
            raise ValueError(f"unknown adaptive action kind {kind!r}")
        action = super().__new__(cls, description)
        action.kind = kind
        return action


@dataclass
class AdaptivePolicy:
    """Watches a sequence's ledger and re-plans when a tier fills up.

    Args:
        migration: gives the host runner and the host cache (built on first use: the host
            copy of the weights costs memory and time only when it is needed).
    """

    migration: Callable[[], PhaseMigration]

    def relieve(self, cache: KVCache, runner: Any, reserve_tokens: int, actions: list[str]
                ) -> tuple[KVCache, Any]:
        """The cache and runner to continue with: unchanged unless a tier is over its threshold.

        Args:
            cache, runner: what the sequence runs on now.
            reserve_tokens: the sequence's prompt plus token budget (for a migrated cache).
            actions: receives one line per action taken.
        """
        ledger = cache.ledger
        if ledger.over_threshold("host") and isinstance(cache, TieredCache) and cache.cold_bits == 16:
            cache.quantize_cold(8)
            _log(actions, QUANTIZE_COLD, "host KV over its threshold: cold pages quantized to 8 bits")
        if not ledger.over_threshold("device"):
            return cache, runner
        if isinstance(cache, TieredCache) and cache.hot_window > cache.page_size:
            old = cache.hot_window
            cache.hot_window = max(cache.page_size, old // 2)
            _log(actions, SHRINK_HOT_WINDOW,
                 f"device KV over its threshold: hot window {old} -> {cache.hot_window} tokens")
            return cache, runner
        return self.move_to_host(cache, reserve_tokens, actions, "device KV over its threshold")

    def move_to_host(self, cache: KVCache, reserve_tokens: int, actions: list[str], why: str
                     ) -> tuple[KVCache, Any]:
        """Migrate the sequence to the host: its KV to a host cache, its steps to the host runner."""
        migration = self.migration()
        host_cache = migration.migrate(cache, reserve_tokens)
        _log(actions, MOVE_TO_HOST,
             f"{why}: decoding moved to the host ({host_cache.bus_bytes['d2h']} bytes of KV migrated)")
        return host_cache, migration.runner


def _log(actions: list[str], kind: str, description: str) -> None:
    logger.warning("adaptive: %s", description)
    actions.append(AdaptiveAction(kind, description))
