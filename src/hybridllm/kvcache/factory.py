"""Build the KV cache a ``KVConfig`` names, on the devices a placement gives."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.registry import STRATEGIES, get_strategy
from hybridllm.kvcache.split import SplitCache


def create_cache(config: KVConfig, spec: KVSpec, ledger: MemoryLedger | None = None,
                 layer_tiers: Sequence[str] | None = None) -> KVCache:
    """A fresh, empty cache of the strategy ``config.kv_cache`` (see :mod:`.registry`).

    Without a ``ledger``, one is made from ``config.vram_budget`` (the whole budget goes to KV).
    ``layer_tiers`` ("device"/"host" per layer, from a placement): layers on the host keep their
    KV in host RAM (:class:`~hybridllm.kvcache.split.SplitCache`); None means every layer on the device.

    Raises:
        ConfigError: ``config.kv_cache`` is not a registered strategy, or it cannot apply the
            model's attention options (sliding window, scale, soft-cap).
    """
    strategy = get_strategy(config.kv_cache)
    check_attention_options(strategy.name, spec)
    if ledger is None:
        ledger = MemoryLedger({"device": config.vram_budget}, threshold=config.kv_threshold)
    if layer_tiers is not None and any(tier != "device" for tier in layer_tiers):
        return SplitCache(spec, layer_tiers, ledger,
                          lambda part_spec, part_ledger: strategy.build(config, part_spec, part_ledger),
                          page_size=config.kv_page_size)
    return strategy.build(config, spec, ledger)


def check_attention_options(name: str, spec: KVSpec) -> None:
    """Raise a one-line ConfigError when strategy ``name`` cannot apply ``spec.attention``
    (a Gemma model's sliding window, score scale or soft-capping) naming those that can."""
    if spec.plain_attention or get_strategy(name).attention_options:
        return
    able = ", ".join(s.name for s in STRATEGIES.values() if s.attention_options)
    raise ConfigError(f"--kv-cache {name} has no sliding-window, scaled or soft-capped attention (this model's); "
                      f"use --kv-cache {able}")
