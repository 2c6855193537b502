"""Every KV strategy through the native steps: the kernels read and write each strategy's stores
where they are (dense rows in device or host tiers; int8/int4 groups with their scales and the
residual window; a tiered cache's sinks, cold pages and hot window), with one attention
arithmetic per row, so lossless strategies give the dynamic cache's logits bit for bit and every
strategy stays batch-invariant. No wall-time assertions."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridllm.config import KVConfig
from hybridllm.kernels import native
from hybridllm.kvcache import DynamicCache, KVSpec, create_cache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.kvcache.registry import STRATEGIES
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

CPU = torch.device("cpu")
# Lossless: the same values as the dynamic cache, held elsewhere or split in runs.
LOSSLESS = {
    "host": KVConfig(kv_cache="host"),
    "offloaded": KVConfig(kv_cache="offloaded"),
    "tiered": KVConfig(kv_cache="tiered", kv_hot_window=32, kv_page_size=16, kv_sink_tokens=4),
    "tiered-half": KVConfig(kv_cache="tiered", kv_hot_window=48, kv_page_size=16),
}
LOSSY = {
    "int8": KVConfig(kv_cache="quantized", kv_bits=8),
    "int4": KVConfig(kv_cache="quantized", kv_bits=4),
    "int8-residual": KVConfig(kv_cache="quantized", kv_bits=8, kv_residual=16),
    "int8-channel-keys": KVConfig(kv_cache="quantized", kv_bits=8, kv_key_quant="per-channel", kv_group_size=16,
                                  kv_residual=8),
    "tiered-cold8": KVConfig(kv_cache="tiered", kv_hot_window=32, kv_page_size=16, kv_cold_bits=8),
    "tiered-cold4": KVConfig(kv_cache="tiered", kv_hot_window=32, kv_page_size=16, kv_cold_bits=4),
}


@pytest.fixture(scope="module")
def runners(tiny_models):
    model = load_model(open_checkpoint(tiny_models["llama"][0]), torch.float32, lambda n: CPU)
    out = {}
    for backend in ("native", "eager"):
        runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)
        out[backend] = runner
    assert out["native"].report.build.whole_step
    return out


def _cache(runner, config: KVConfig):
    c = runner.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=c.max_position_embeddings)
    return create_cache(config, spec)


def _run(runner, cache, prompt: torch.Tensor, steps: int, chunk: int = 40) -> torch.Tensor:
    """Logits of the prompt's last position, then of ``steps`` greedy decode steps: (1 + steps, vocab)."""
    out = []
    with torch.inference_mode():
        for start in range(0, prompt.shape[1], chunk):
            logits = runner(prompt[:, start:start + chunk], cache, start)
        out.append(logits[0, -1])
        for _ in range(steps):
            token = torch.tensor([[int(out[-1].argmax())]])
            out.append(runner(token, cache, cache.seq_length)[0, -1])
    return torch.stack(out)


def _count_native(monkeypatch) -> dict[str, int]:
    counts = {"decode": 0, "prefill_chunks": 0}
    for method in counts:
        original = getattr(native.NativeModel, method)

        def counting(self, *args, _original=original, _name=method, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(native.NativeModel, method, counting)
    return counts


def _prompt(runner, n: int = 90, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, runner.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_strategies_give_the_dynamic_caches_logits_bitwise(runners, name, monkeypatch):
    runner = runners["native"]
    prompt = _prompt(runner)
    expected = _run(runner, DynamicCache(_cache(runner, KVConfig()).spec), prompt, steps=20)
    counts = _count_native(monkeypatch)
    cache = _cache(runner, LOSSLESS[name])
    got = _run(runner, cache, prompt, steps=20)
    assert counts["decode"] == 20 and counts["prefill_chunks"] == 3  # every step native (3 prefill chunks)
    assert torch.equal(got, expected)
    if name.startswith("tiered"):
        assert cache.cold_tokens(0) > 0  # the keys really were split into runs


@pytest.mark.parametrize("name", list(LOSSY))
def test_quantized_strategies_run_natively_as_their_pytorch_path(runners, name, monkeypatch):
    """The native steps quantize each new token as the PyTorch path does (the same codes from the
    same values) and attend the codes in place: the logits agree to the float32 products' rounding."""
    prompt = _prompt(runners["native"])
    expected = _run(runners["eager"], _cache(runners["eager"], LOSSY[name]), prompt, steps=16)
    counts = _count_native(monkeypatch)
    cache = _cache(runners["native"], LOSSY[name])
    got = _run(runners["native"], cache, prompt, steps=16)
    assert counts["decode"] == 16 and counts["prefill_chunks"] == 3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    error = ((got - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()
    assert error < 2e-3, error


@pytest.mark.parametrize("name", ["int8-residual", "int8-channel-keys"])
def test_the_residual_settles_as_the_pytorch_path_does(runners, name):
    """After native steps the quantized cache holds what the PyTorch path leaves: as many packed
    and residual tokens, and (read back) the same values to the codes' rounding."""
    caches = {}
    for backend in ("native", "eager"):
        caches[backend] = _cache(runners[backend], LOSSY[name])
        _run(runners[backend], caches[backend], _prompt(runners[backend], 37), steps=11, chunk=13)
    for layer in range(runners["native"].config.n_layers):
        native_cache, eager_cache = caches["native"], caches["eager"]
        assert native_cache._packed[layer].length == eager_cache._packed[layer].length > 0
        assert native_cache._recent[layer].length == eager_cache._recent[layer].length > 0
        for ours, theirs in zip(native_cache.read_layer(layer), eager_cache.read_layer(layer)):
            torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("name", ["dynamic", "tiered", "int8", "int4-residual"])
def test_batched_rows_of_every_strategy_are_their_rows_alone(runners, name):
    config = {"dynamic": KVConfig(), "tiered": LOSSLESS["tiered"], "int8": LOSSY["int8"],
              "int4-residual": KVConfig(kv_cache="quantized", kv_bits=4, kv_residual=8)}[name]
    runner = runners["native"]
    prompts = [_prompt(runner, n, seed) for n, seed in ((70, 1), (33, 2), (100, 3))]
    alone, together = [], []
    for cache_set in (alone, together):
        for prompt in prompts:
            cache = _cache(runner, config)
            with torch.inference_mode():
                runner(prompt, cache, 0)
            cache_set.append(cache)
    tokens = torch.tensor([[5], [9], [11]])
    with torch.inference_mode():
        expected = [runner(tokens[i:i + 1], cache, cache.seq_length)[0, -1] for i, cache in enumerate(alone)]
        batch = BatchedCaches(together)
        got = runner(tokens, batch, batch.start_positions())
    for i in range(3):
        assert torch.equal(got[i, -1], expected[i]), f"row {i}"


def test_every_registered_strategy_says_what_the_kernels_read():
    assert all(strategy.native for strategy in STRATEGIES.values())


def test_a_strategy_the_kernels_cannot_read_falls_back_visibly(tiny_models, monkeypatch, caplog):
    """A strategy declaring no native reading runs PyTorch's attention, said once at build and in
    the runtime's facts (what doctor and the bench name)."""
    import dataclasses

    from hybridllm import LLM, SamplingParams
    from hybridllm.kvcache import registry

    unread = dataclasses.replace(registry.STRATEGIES["quantized"], native="")
    monkeypatch.setitem(registry.STRATEGIES, "quantized", unread)
    monkeypatch.setattr(type(create_cache(KVConfig(kv_cache="quantized"), KVSpec(1, 1, 8, torch.float32, CPU))),
                        "supports_in_place", lambda self, layer_idx: False)
    with caplog.at_level(logging.WARNING, logger="hybridllm"):
        llm = LLM(str(tiny_models["llama"][1]), threads=2, kv_cache="quantized")
    notes = [r.getMessage() for r in caplog.records if "quantized" in r.getMessage() and "PyTorch" in r.getMessage()]
    assert len(notes) == 1 and not llm.runtime.native_kv and llm.runtime.kv_attention == "PyTorch"
    assert llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).token_ids
