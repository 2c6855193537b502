"""The KV strategies by name: the one list the factory, admission, the planner and the bench read.

A new strategy is one module that ends with a :class:`~hybridllm.kvcache.strategy.KVStrategy`
(its cache class, tiers, memory model and builder) plus one line in ``_DECLARED`` below (and its
name in ``config.KV_STRATEGIES``, which validates ``KVConfig`` below this layer).
"""

from __future__ import annotations

from hybridllm.errors import ConfigError
from hybridllm.kvcache import dynamic, host, offloaded, quantized, tiered
from hybridllm.kvcache.base import KVSpec
from hybridllm.kvcache.strategy import KVCost, KVStrategy

_DECLARED = (
    dynamic.STRATEGY,
    offloaded.STRATEGY,
    quantized.STRATEGY,
    tiered.STRATEGY,
    host.STRATEGY,
)
STRATEGIES: dict[str, KVStrategy] = {strategy.name: strategy for strategy in _DECLARED}


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name, in declaration order."""
    return tuple(STRATEGIES)


def get_strategy(name: str) -> KVStrategy:
    """The strategy called ``name``.

    Raises:
        ConfigError: no strategy has that name (the message lists the registered ones).
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown KV cache {name!r}; choose one of {', '.join(STRATEGIES)}") from None


def admission_tiers(name: str) -> tuple[str, ...]:
    """The tiers a strategy stores tokens in: admission counts only those budgets."""
    return get_strategy(name).tiers


def tiers_capacity(tiers: tuple[str, ...], budgets: dict[str, int | None]) -> int | None:
    """Bytes of KV that ``tiers`` may hold together: the sum of their budgets (None when any of
    them is unbounded)."""
    if any(budgets.get(tier) is None for tier in tiers):
        return None
    return sum(budgets[tier] for tier in tiers)


def kv_capacity(name: str, budgets: dict[str, int | None]) -> int | None:
    """Bytes of KV the strategy may hold: the sum of the budgets of the tiers it stores in.

    None when any of those tiers is unbounded.
    """
    return tiers_capacity(admission_tiers(name), budgets)


def host_layers_cost(spec: KVSpec, n_tokens: int) -> KVCost:
    """Cost of the host-tier dense cache that holds a split cache's host layers (and the KV after
    phase migration): every token in the compute dtype in host RAM, attended there."""
    return dynamic.dense_cost("host", spec, n_tokens)


__all__ = ["STRATEGIES", "admission_tiers", "get_strategy", "host_layers_cost", "kv_capacity", "strategy_names",
           "tiers_capacity"]
