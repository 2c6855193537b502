"""The KV strategy registry: each strategy's declared memory model equals what its real cache
allocates (measured with the ledger), admission counts the declared tiers, and a new strategy
needs only a registry entry for the factory and the split cache to build it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridllm import config as config_module
from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import TIERS, KVSpec
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.factory import create_cache
from hybridllm.kvcache.registry import (
    STRATEGIES,
    admission_tiers,
    get_strategy,
    host_layers_cost,
    kv_capacity,
    strategy_names,
)
from hybridllm.kvcache.split import SplitCache
from hybridllm.kvcache.strategy import KVStrategy

SPEC = KVSpec(n_layers=3, n_kv_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
              max_tokens=4096)
PAGE = 16
# Knobs whose allocations are exact at the lengths below: whole pages, whole quantization groups,
# and (tiered) cold stores of a power-of-two number of pages (they grow by doubling).
CONFIGS = {
    "dynamic": KVConfig(kv_cache="dynamic", kv_page_size=PAGE),
    "host": KVConfig(kv_cache="host", kv_page_size=PAGE),
    "offloaded": KVConfig(kv_cache="offloaded", kv_page_size=PAGE),
    "quantized-int8": KVConfig(kv_cache="quantized", kv_bits=8, kv_group_size=16, kv_residual=16),
    "quantized-int4": KVConfig(kv_cache="quantized", kv_bits=4, kv_group_size=8, kv_residual=32),
    "tiered": KVConfig(kv_cache="tiered", kv_page_size=PAGE, kv_hot_window=32),
    "tiered-cold4": KVConfig(kv_cache="tiered", kv_page_size=PAGE, kv_hot_window=32, kv_cold_bits=4,
                             kv_group_size=16),
    "tiered-cold8-sinks": KVConfig(kv_cache="tiered", kv_page_size=PAGE, kv_hot_window=28, kv_sink_tokens=4,
                                   kv_cold_bits=8, kv_group_size=8),
}
SHORT, LONG = 32 + 4 * PAGE, 32 + 8 * PAGE  # tiered: 4 and 8 cold pages


def filled_ledger(config: KVConfig, n_tokens: int) -> dict[str, int]:
    """Bytes per tier the ledger counts once a fresh cache holds ``n_tokens`` (reserved first,
    filled a page at a time)."""
    cache = create_cache(config, SPEC)
    cache.reserve(n_tokens)
    gen = torch.Generator().manual_seed(0)
    for _ in range(n_tokens // PAGE):
        for layer in range(SPEC.n_layers):
            q = torch.randn(1, 4, PAGE, SPEC.head_dim, generator=gen)  # (B, H, T, D)
            k, v = (torch.randn(1, SPEC.n_kv_heads, PAGE, SPEC.head_dim, generator=gen) for _ in range(2))
            cache.attend(layer, q, k, v)
    assert cache.seq_length == n_tokens
    return cache.bytes_per_tier()


def test_every_config_strategy_is_registered():
    assert set(strategy_names()) == set(config_module.KV_STRATEGIES)
    assert all(name == strategy.name for name, strategy in STRATEGIES.items())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_declared_bytes_per_token_equal_the_ledger(name):
    config = CONFIGS[name]
    strategy = get_strategy(config.kv_cache)
    short, long = filled_ledger(config, SHORT), filled_ledger(config, LONG)
    declared = strategy.token_bytes(config, SPEC)
    assert set(declared) <= set(TIERS)
    for tier in TIERS:
        assert (long[tier] - short[tier]) / (LONG - SHORT) == pytest.approx(declared.get(tier, 0), abs=1e-9), tier
        # the memory model grows at the declared rate too
        modelled = strategy.memory(config, SPEC, LONG).get(tier, 0) - strategy.memory(config, SPEC, SHORT).get(tier, 0)
        assert modelled == pytest.approx(declared.get(tier, 0) * (LONG - SHORT)), tier


@pytest.mark.parametrize("name", ["dynamic", "host", "offloaded"])
def test_memory_model_equals_the_ledger_without_fixed_windows(name):
    config = CONFIGS[name]
    held = get_strategy(config.kv_cache).memory(config, SPEC, LONG)
    assert {tier: held.get(tier, 0) for tier in TIERS} == filled_ledger(config, LONG)


def test_memory_model_of_the_fixed_windows():
    full = SPEC.n_layers * SPEC.token_bytes()
    quantized = CONFIGS["quantized-int8"]
    # the newest kv_residual tokens stay in full precision: the model counts them at full size
    rate = get_strategy("quantized").token_bytes(quantized, SPEC)["device"]
    assert get_strategy("quantized").memory(quantized, SPEC, LONG)["device"] == pytest.approx(
        16 * full + (LONG - 16) * rate)
    tiered = CONFIGS["tiered-cold8-sinks"]
    held = get_strategy("tiered").memory(tiered, SPEC, LONG)
    assert held["device"] == (4 + 28) * full  # sinks and the hot window
    assert held["host"] == pytest.approx((LONG - 32) * get_strategy("tiered").token_bytes(tiered, SPEC)["host"])
    assert host_layers_cost(SPEC, 10).memory == {"host": 10 * full}


def test_admission_tiers():
    assert {name: admission_tiers(name) for name in STRATEGIES} == {
        "dynamic": ("device",), "quantized": ("device",), "offloaded": ("host",), "host": ("host",),
        "tiered": ("device", "host")}


def test_kv_capacity_sums_the_tiers_the_strategy_stores_in():
    budgets = {"device": 1000, "host": 5000}
    assert kv_capacity("dynamic", budgets) == 1000
    assert kv_capacity("quantized", budgets) == 1000
    assert kv_capacity("tiered", budgets) == 6000
    assert kv_capacity("offloaded", budgets) == 5000
    assert kv_capacity("host", budgets) == 5000
    unbounded_device = {"device": None, "host": 5000}
    assert kv_capacity("dynamic", unbounded_device) is None
    assert kv_capacity("tiered", unbounded_device) is None
    assert kv_capacity("host", unbounded_device) == 5000


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="unknown KV cache 'paged'") as info:
        get_strategy("paged")
    for name in STRATEGIES:
        assert name in str(info.value)
    with pytest.raises(ConfigError):
        kv_capacity("paged", {})


def test_a_new_strategy_needs_only_a_registry_entry(monkeypatch):
    """The factory and the split cache build a strategy they have never heard of."""
    dense = get_strategy("dynamic")
    toy = KVStrategy(name="toy", tiers=("device",),
                     build=lambda config, spec, ledger: DynamicCache(spec, ledger, page_size=8),
                     token_bytes=dense.token_bytes, cost=dense.cost, describe=lambda config: "toy KV")
    monkeypatch.setitem(STRATEGIES, "toy", toy)
    monkeypatch.setattr(config_module, "KV_STRATEGIES", (*config_module.KV_STRATEGIES, "toy"))
    config = KVConfig(kv_cache="toy")
    assert isinstance(create_cache(config, SPEC), DynamicCache)
    split = create_cache(config, SPEC, layer_tiers=["device", "host", "host"])
    assert isinstance(split, SplitCache) and split.device_part.page_size == 8
    assert split.device_part.spec == replace(SPEC, n_layers=1)
    assert kv_capacity("toy", {"device": 7, "host": None}) == 7
