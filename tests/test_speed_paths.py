"""The speed paths give the same results as the plain ones.

- fused q/k/v and gate/up projections (float, int4, int8) vs the separate projections;
- the compiled decode step vs eager;
- attention over quantized KV read from its codes vs the old dequantize-everything path;
- parity with transformers with every speed path on.
No wall-time assertions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.quantized import QuantizedCache
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.fuse import ConcatLinear, stack_projections
from hybridllm.models.quantized import Int4Linear, Int8Linear, quantize_model
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import ARCHS

CPU = torch.device("cpu")


def _load(tiny_models, arch: str, fuse: bool = True):
    folder, _, hf_model = tiny_models[arch]
    return load_model(open_checkpoint(folder), torch.float32, lambda n: CPU, fuse=fuse), hf_model


def _runner(model, backend: str):
    return build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)


def _cache(model) -> DynamicCache:
    c = model.config
    return DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU,
                               max_tokens=c.max_position_embeddings), page_size=16)


def _prompt(model, n: int = 24) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))


def _prefill_and_greedy(model, ids: torch.Tensor, steps: int = 12) -> tuple[torch.Tensor, list[int]]:
    """All prefill logits and ``steps`` greedy tokens, prefill in two chunks, then one token per step."""
    cache = _cache(model)
    with torch.inference_mode():
        cut = ids.shape[1] // 2
        logits = torch.cat([model(ids[:, :cut], cache, 0, all_logits=True),
                            model(ids[:, cut:], cache, cut, all_logits=True)], dim=1)
        tokens, last = [], logits[:, -1:]
        for _ in range(steps):
            token = int(last[0, -1].argmax())
            tokens.append(token)
            last = model(torch.tensor([[token]]), cache, cache.seq_length)
            logits = torch.cat([logits, last], dim=1)
    return logits, tokens


# ---- fusion -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_float_projections_equal_separate_ones(tiny_models, arch):
    separate, _ = _load(tiny_models, arch, fuse=False)
    attn, mlp = separate.model.layers[0].self_attn, separate.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, ConcatLinear) and len(attn.qkv_proj.parts) == 3
    assert isinstance(mlp.gate_up_proj, ConcatLinear) and len(mlp.gate_up_proj.parts) == 2
    ids = _prompt(separate)
    ref_logits, ref_tokens = _prefill_and_greedy(separate, ids)
    model, _ = _load(tiny_models, arch)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.qkv_proj) is nn.Linear and type(mlp.gate_up_proj) is nn.Linear
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")  # Qwen2's q/k/v biases are stacked too
    logits, tokens = _prefill_and_greedy(model, ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.parametrize("fmt, kind", [("int4", Int4Linear), ("int8", Int8Linear)])
def test_fused_quantized_projections_equal_separate_ones(tiny_models, fmt, kind):
    separate, _ = _load(tiny_models, "llama", fuse=False)
    quantize_model(separate, fmt)  # each part quantized on its own
    assert all(isinstance(p, kind) for p in separate.model.layers[0].self_attn.qkv_proj.parts)
    ids = _prompt(separate)
    ref_logits, ref_tokens = _prefill_and_greedy(separate, ids)
    model, _ = _load(tiny_models, "llama")
    quantize_model(model, fmt)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, kind) and isinstance(layer.mlp.gate_up_proj, kind)
    logits, tokens = _prefill_and_greedy(model, ids)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=2e-3)  # the kernels' summation order


def test_fused_int4_keeps_the_exact_codes_and_scales(tiny_models):
    model, _ = _load(tiny_models, "llama", fuse=False)
    quantize_model(model, "int4")
    parts = list(model.model.layers[0].self_attn.qkv_proj.parts)
    stacked = stack_projections(parts)
    assert isinstance(stacked, Int4Linear)
    assert torch.equal(stacked.unpack_codes(), torch.cat([p.unpack_codes() for p in parts]))
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_parts_that_cannot_be_stacked_stay_side_by_side(tiny_models):
    model, _ = _load(tiny_models, "llama", fuse=False)
    q, k, v = model.model.layers[0].self_attn.qkv_proj.parts
    mixed = [q, Int8Linear.from_float(k.weight.data), v]  # mixed q/k/v formats (a Q4_K_M file's Q6_K v)
    concat = stack_projections(mixed)
    assert isinstance(concat, ConcatLinear) and list(concat.parts) == mixed
    assert (concat.in_features, concat.out_features) == (q.in_features, sum(p.out_features for p in mixed))
    x = torch.randn(2, 3, q.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(concat(x), torch.cat([p(x) for p in mixed], dim=-1), atol=0, rtol=0)
    assert isinstance(stack_projections([q, k, v]), nn.Linear)
    assert isinstance(stack_projections([q, k, v], fuse=False), ConcatLinear)  # fuse=False: same layout


def test_stacked_projection_keeps_its_parts_device_and_dtype(tiny_models):
    model, _ = _load(tiny_models, "llama", fuse=False)
    parts = [p.to(torch.float64) for p in model.model.layers[1].self_attn.qkv_proj.parts]
    stacked = stack_projections(parts)
    assert stacked.weight.dtype == torch.float64 and stacked.weight.device == parts[0].weight.device


# ---- every backend, parity with transformers ------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_runner_keeps_parity_with_transformers(tiny_models, arch):
    model, hf_model = _load(tiny_models, arch)
    runner = _runner(model, "auto")
    ids = _prompt(model, 40)
    with torch.inference_mode():
        expected = hf_model(ids).logits
    logits, _ = _prefill_and_greedy(runner, ids, steps=0)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(tiny_models):
    model, _ = _load(tiny_models, "qwen2")
    eager, compiled = _runner(model, "eager"), _runner(model, "compiled")
    assert compiled.report.backend == "compiled"
    ids = _prompt(model)
    ref_logits, ref_tokens = _prefill_and_greedy(eager, ids, steps=6)
    logits, tokens = _prefill_and_greedy(compiled, ids, steps=6)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


# ---- attention over quantized KV ----------------------------------------------------------------
def _dequantize_all_reference(cache: QuantizedCache, q: torch.Tensor, k_new: torch.Tensor,
                              v_new: torch.Tensor) -> torch.Tensor:
    """The old path: dequantize every packed token, append residual + new, causal attention."""
    packed, recent = cache._packed[0], cache._recent[0]
    old_k, old_v = packed.read()
    recent_k, recent_v = recent.read()
    keys = torch.cat([old_k, recent_k, k_new], dim=2)  # (B, Hkv, past+T, D)
    values = torch.cat([old_v, recent_v, v_new], dim=2)
    return causal_attention(q, keys, values, query_start=cache.seq_length)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [16, 32])  # 32 splits head_dim 64 into two value groups
@pytest.mark.parametrize("n_new", [1, 5])
def test_quantized_kv_attention_from_codes_matches_dequantize_all(bits, group_size, n_new):
    gen = torch.Generator().manual_seed(bits * 100 + group_size + n_new)
    spec = KVSpec(n_layers=1, n_kv_heads=2, head_dim=64, dtype=torch.float32, device=CPU, max_tokens=1024)
    cache = QuantizedCache(spec, bits=bits, group_size=group_size, residual=24, chunk_tokens=64)
    for n in (150, 70):  # two prefill chunks: several packed chunks of 64 tokens, a residual window
        cache.attend(0, torch.randn(1, 4, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen),
                     torch.randn(1, 2, n, 64, generator=gen))
    assert cache._packed[0].length > 2 * cache.chunk_tokens
    q = torch.randn(1, 4, n_new, 64, generator=gen)
    k_new, v_new = torch.randn(1, 2, n_new, 64, generator=gen), torch.randn(1, 2, n_new, 64, generator=gen)
    expected = _dequantize_all_reference(cache, q, k_new, v_new)
    out = cache.attend(0, q, k_new, v_new)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_default_model_fused_int4_generates_the_same_tokens():
    from hybridllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    separate = LLM(weights="auto", threads=2, fuse=False, native_decode=False).generate(prompt, params).token_ids
    assert LLM(weights="auto", threads=2, native_decode=False).generate(prompt, params).token_ids == separate
