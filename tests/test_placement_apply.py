"""Applying a placement: every split of weights and KV gives the all-on-device tokens.

The CPU stands in for the device (both tiers are the CPU), so these runs check the bookkeeping
(which tier holds what, what crosses between tiers) and that no placement changes a token.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.factory import create_cache
from hybridllm.kvcache.split import SplitCache
from hybridllm.kvcache.tiered import TieredCache
from hybridllm.placement import Placement
from hybridllm.engine.adaptive import AdaptivePolicy
from hybridllm.placement.apply import module_copy_on, tier_of_parameter
from test_cli import assert_one_line_error, run_cli

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = "The history of the city of Paris begins"


@pytest.fixture(scope="module")
def reference(default_llm):
    return default_llm.generate(PROMPT, GREEDY)


@pytest.mark.parametrize("options", [
    {"n_gpu_layers": 0},
    {"n_gpu_layers": 1},
    {"n_gpu_layers": 17},
    {"n_gpu_layers": 30},
    {"decode_on": "host"},
    {"n_gpu_layers": 12, "kv_cache": "tiered", "kv_hot_window": 4, "kv_page_size": 4},
    {"n_gpu_layers": 12, "decode_on": "host", "kv_cache": "tiered", "kv_hot_window": 4, "kv_page_size": 4},
    {"n_gpu_layers": 20, "kv_cache": "offloaded"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.slow
def test_every_placement_gives_the_all_on_device_tokens(options, reference, default_llm):
    llm = LLM(weights="float", **options)
    out = llm.generate(PROMPT, GREEDY)
    assert out.token_ids == reference.token_ids
    m = out.metrics
    n_layers = llm.config.n_layers
    ngl = options.get("n_gpu_layers", n_layers)
    total = sum(default_llm.weight_bytes.values())
    if options.get("decode_on") == "host":  # the host holds a copy of every weight for decoding
        assert m["weight_bytes"]["host"] == total
    else:
        assert m["weight_bytes"]["device"] + m["weight_bytes"]["host"] == total
        assert (m["weight_bytes"]["host"] > 0) == (ngl < n_layers)
    assert (m["bus_bytes_detail"]["hidden_states"] > 0) == (0 < ngl < n_layers)
    if ngl == 0:
        assert m["kv_peak_bytes"]["device"] == 0 and m["kv_peak_bytes"]["host"] > 0
    if options.get("decode_on") == "host":
        assert m["decode_on"] == "host" and m["migration_bytes"] > 0
    else:
        assert m["decode_on"] == "device" and m["migration_bytes"] == 0
    assert m["adaptive_actions"] == []


@pytest.mark.slow
def test_split_kv_lives_with_its_layer(default_llm):
    llm = LLM(weights="float", n_gpu_layers=10)
    cache = llm.new_cache()
    assert isinstance(cache, SplitCache)
    cache.reserve(64)
    tensors = cache.storage_tensors()
    assert cache.ledger.current("device") == tensor_bytes(*tensors["device"]) > 0
    assert cache.ledger.current("host") == tensor_bytes(*tensors["host"]) > 0
    assert cache.ledger.current("host") == 2 * cache.ledger.current("device")  # 20 host layers, 10 device ones
    cache.reset()
    assert cache.bytes_per_tier() == {"device": 0, "host": 0}


def test_tied_head_gets_its_own_copy_when_tiers_differ(tiny_models, tmp_path):
    from tiny_models import build_hf_model

    folder = tmp_path / "tied"
    build_hf_model(folder, "llama", tie_word_embeddings=True)
    reference = LLM(model=folder)
    placement = Placement(layer_tiers=["device", "device"], embed_tier="host", head_tier="device", weights="float")
    llm = LLM(model=folder, placement=placement)
    assert llm.model.lm_head.weight is not llm.model.model.embed_tokens.weight
    assert torch.equal(llm.model.lm_head.weight, llm.model.model.embed_tokens.weight)
    embed_bytes = llm.model.model.embed_tokens.weight.numel() * 4
    assert llm.weight_bytes["host"] == embed_bytes
    assert llm.weight_bytes["device"] == sum(reference.weight_bytes.values())  # head copy + layers + norm
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.generate("hello world", params).token_ids == reference.generate("hello world", params).token_ids


def test_quantized_weights_split_and_decode_on_host(tiny_models):
    gguf = tiny_models["llama"][1]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = LLM(model=gguf, weights="int8").generate("hello world", params)
    out = LLM(model=gguf, weights="int8", n_gpu_layers=1, decode_on="host").generate("hello world", params)
    assert out.token_ids == reference.token_ids
    assert out.metrics["weights_format"] == reference.metrics["weights_format"]


def test_placement_file_round_trip_and_overrides(tmp_path, tiny_models):
    folder = tiny_models["llama"][0]
    path = tmp_path / "placement.json"
    Placement.from_n_gpu_layers(2, 1, kv=KVConfig(kv_cache="tiered", kv_page_size=8), weights="float").save(path)
    llm = LLM(model=folder, placement=path, kv_hot_window=16, decode_on="host")
    assert llm.placement.layer_tiers == ["device", "host"]
    assert llm.kv_config.kv_cache == "tiered" and llm.kv_config.kv_page_size == 8 and llm.kv_config.kv_hot_window == 16
    assert llm.placement.decode_on == "host"
    with pytest.raises(ConfigError, match="not both"):
        LLM(model=folder, placement=path, n_gpu_layers=1)


def test_ngl_above_the_layer_count_is_clamped_with_a_warning(tiny_models):
    with pytest.warns(UserWarning, match="using 2"):
        llm = LLM(model=tiny_models["llama"][0], n_gpu_layers=99)
    assert llm.placement.layer_tiers == ["device", "device"]


def test_bad_placement_inputs(tiny_models, tmp_path):
    folder = tiny_models["llama"][0]
    with pytest.raises(ConfigError, match="--decode-on"):
        LLM(model=folder, decode_on="gpu")
    with pytest.raises(ConfigError, match="--n-gpu-layers"):
        LLM(model=folder, n_gpu_layers=-1)
    wrong_count = tmp_path / "three.json"
    Placement(layer_tiers=["device"] * 3).save(wrong_count)
    with pytest.raises(ConfigError, match="3 layer tiers for a model of 2 layers"):
        LLM(model=folder, placement=wrong_count)


@pytest.mark.slow
def test_cli_invalid_placement_file_is_one_line(tmp_path, tiny_models):
    folder = str(tiny_models["llama"][0])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(run_cli("generate", "hi", "--model", folder, "--placement", str(broken)), "not valid JSON")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"layer_tiers": ["device", "gpu"]}))
    assert_one_line_error(run_cli("generate", "hi", "--model", folder, "--placement", str(unknown)), "unknown tier")
    assert_one_line_error(run_cli("generate", "hi", "--model", folder, "--placement", str(tmp_path / "missing.json")),
                          "not found")


@pytest.mark.slow
def test_cli_ngl_and_decode_on_host(tiny_models):
    folder = str(tiny_models["llama"][0])
    args = ("generate", "hello", "--model", folder, "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json")
    base = json.loads(run_cli(*args).stdout)
    proc = run_cli(*args, "-ngl", "1", "--decode-on", "host")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == base["token_ids"]
    assert out["metrics"]["decode_on"] == "host" and out["metrics"]["weight_bytes"]["host"] > 0
    clamped = run_cli(*args, "--n-gpu-layers", "9")
    assert clamped.returncode == 0 and "using 2" in clamped.stderr


def test_module_copy_shares_what_is_already_there_and_leaves_the_original():
    layer = torch.nn.Linear(4, 3)
    clone = module_copy_on(layer, torch.device("cpu"))
    assert clone is not layer and clone.weight is not layer.weight
    assert clone.weight.data_ptr() == layer.weight.data_ptr()  # same device: shared, not copied
    clone.to(torch.float64)
    assert layer.weight.dtype == torch.float32  # moving the copy does not reach the original


def test_tier_of_parameter():
    placement = Placement(layer_tiers=["device", "host"], embed_tier="host", head_tier="device")
    assert tier_of_parameter("model.layers.1.mlp.up_proj.weight", placement) == "host"
    assert tier_of_parameter("model.layers.0.self_attn.q_proj.weight", placement) == "device"
    assert tier_of_parameter("model.embed_tokens.weight", placement) == "host"
    assert tier_of_parameter("lm_head.weight", placement) == "device"
    assert tier_of_parameter("model.norm.weight", placement) == "device"


# ---- adaptive re-planning ------------------------------------------------------------------
@pytest.mark.slow
def test_dynamic_cache_over_budget_moves_decoding_to_the_host(default_llm, reference, caplog):
    llm = LLM(weights="float", vram_budget=default_llm.weight_bytes["device"] + 100_000)  # far less than 24+8 tokens of KV
    with caplog.at_level(logging.WARNING, logger="hybridllm.engine.adaptive"):
        out = llm.generate(PROMPT, GREEDY)
    assert out.token_ids == reference.token_ids
    assert out.metrics["decode_on"] == "host"
    assert any("decoding moved to the host" in a for a in out.metrics["adaptive_actions"])
    assert "adaptive: device KV over its threshold" in caplog.text
    assert out.metrics["kv_bytes"]["device"] == 0 and out.metrics["kv_bytes"]["host"] > 0  # the KV now lives on the host


@pytest.mark.slow
def test_tiered_budget_below_one_step_reruns_the_step_on_the_host(default_llm, reference):
    llm = LLM(weights="float", vram_budget=default_llm.weight_bytes["device"] + 300_000, kv_cache="tiered",
              kv_hot_window=16, kv_page_size=4)
    out = llm.generate(PROMPT, GREEDY)
    assert out.token_ids == reference.token_ids
    assert out.metrics["adaptive_actions"] and "mid-step" in out.metrics["adaptive_actions"][0]


@pytest.mark.slow
def test_without_adaptive_the_budget_error_is_raised(default_llm):
    from hybridllm.kvcache.base import KVBudgetError

    llm = LLM(weights="float", vram_budget=default_llm.weight_bytes["device"] + 300_000, kv_cache="tiered",
              kv_hot_window=16, kv_page_size=4, kv_adaptive=False)
    with pytest.raises(KVBudgetError):
        llm.generate(PROMPT, GREEDY)


SPEC = KVSpec(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))


def _fill(cache, n_tokens: int) -> None:
    for layer in range(SPEC.n_layers):
        kv = torch.randn(1, 2, n_tokens, 8)
        cache.attend(layer, torch.randn(1, 4, n_tokens, 8), kv, kv)


def test_adaptive_halves_a_tiered_hot_window_when_the_device_tier_is_over():
    ledger = MemoryLedger({"device": 10_000})
    cache = TieredCache(SPEC, ledger, page_size=4, hot_window=64)
    _fill(cache, 20)
    ledger.allocate("device", 20_000)  # another tenant of the shared ledger filled the device
    policy = AdaptivePolicy(migration=lambda: pytest.fail("must not migrate while the window can shrink"))
    actions: list[str] = []
    same, _ = policy.relieve(cache, None, 64, actions)
    assert same is cache and cache.hot_window == 32 and "hot window 64 -> 32" in actions[0]


def test_adaptive_quantizes_cold_pages_when_the_host_tier_is_over():
    ledger = MemoryLedger({"host": 1})
    cache = TieredCache(SPEC, ledger, page_size=4, hot_window=4)
    _fill(cache, 20)
    before = [cache.read_layer(layer) for layer in range(2)]
    host_before = ledger.current("host")
    actions: list[str] = []
    AdaptivePolicy(migration=lambda: pytest.fail("no device pressure")).relieve(cache, None, 64, actions)
    assert cache.cold_bits == 8 and "quantized to 8 bits" in actions[0]
    assert ledger.current("host") < host_before
    assert ledger.current("host") == tensor_bytes(*cache.storage_tensors()["host"])
    for layer, (keys, values) in enumerate(before):
        new_keys, new_values = cache.read_layer(layer)
        assert torch.allclose(new_keys, keys, atol=0.05) and torch.allclose(new_values, values, atol=0.05)


@pytest.mark.parametrize("strategy", ["dynamic", "offloaded", "host", "quantized", "tiered"])
def test_read_layer_returns_every_token_in_order(strategy):
    config = KVConfig(kv_cache=strategy, kv_page_size=4, kv_hot_window=4, kv_sink_tokens=2, kv_residual=4,
                      kv_group_size=4)
    cache = create_cache(config, SPEC)
    keys = torch.randn(1, 2, 19, 8)
    for layer in range(SPEC.n_layers):
        for start in range(0, 19, 5):
            chunk = keys[:, :, start:start + 5]
            cache.attend(layer, torch.randn(1, 4, chunk.shape[2], 8), chunk, chunk)
    for layer in range(SPEC.n_layers):
        got_k, got_v = cache.read_layer(layer)
        tolerance = 0.1 if strategy == "quantized" else 0
        assert got_k.shape == keys.shape
        assert torch.allclose(got_k.cpu(), keys, atol=tolerance) and torch.allclose(got_v.cpu(), keys, atol=tolerance)


def test_placement_describes_the_cpu_as_the_cpu():
    """What serve prints: on a CPU-only machine both tiers are the CPU ("30 layers on the CPU"); on a
    GPU the split and the decode tier by device name."""
    placement = Placement.from_n_gpu_layers(30, 30)
    assert placement.describe("cpu") == "30 layers on the CPU"
    assert placement.describe("cuda:0") == "30/30 layers on cuda:0, decode on cuda:0"
    split = Placement.from_n_gpu_layers(30, 20, decode_on="host")
    assert split.describe("cpu") == "30 layers on the CPU"
    assert split.describe("cuda") == "20/30 layers on cuda, 10 on the CPU, decode on the CPU"
