"""Float16 KV for host attention: ``DynamicCache(kv_dtype=torch.float16)`` keeps half the bytes,
and the native decode step reads the half-precision rows directly (float32 accumulation, no
float32 copy of the cache). Checked against PyTorch over the same rounded values (tight) and
against the float32 cache (within float16's rounding)."""

from __future__ import annotations

import pytest
import torch

from hybridllm.kernels import native
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import causal_attention
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import NEEDS_COMPILER

CPU = torch.device("cpu")

pytestmark = NEEDS_COMPILER


@pytest.mark.parametrize("build_name", ["native", "portable"])  # vector and plain float16 conversions
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, total", [(9, 3, 64, 1), (9, 3, 64, 700), (4, 2, 40, 50)])
def test_attention_reads_float16_kv_with_float32_accumulation(build_name, n_heads, n_kv_heads, head_dim, total, request):
    library = request.getfixturevalue("portable_library") if build_name == "portable" else None
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(n_heads, head_dim, generator=gen)
    keys = (torch.randn(n_kv_heads, total + 5, head_dim, generator=gen) * 3).half()
    values = torch.randn(n_kv_heads, total + 5, head_dim, generator=gen).half()
    out = native.attention(q, keys, values, total, library=library)
    exact = causal_attention(q[None, :, None], keys[None, :, :total].float(), values[None, :, :total].float(),
                             total - 1)[0, :, 0]
    torch.testing.assert_close(out, exact, atol=2e-5, rtol=2e-5)  # the same rounded values, float32 sums


def _runner(tiny_models, backend: str):
    model = load_model(open_checkpoint(tiny_models["llama"][0]), torch.float32, lambda n: CPU)
    return build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)


def _cache(runner, kv_dtype: torch.dtype) -> DynamicCache:
    c = runner.config
    return DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU,
                               max_tokens=c.max_position_embeddings), page_size=16, kv_dtype=kv_dtype)


def _decode(runner, cache, steps: int = 10) -> torch.Tensor:
    """A seeded 30-token prompt, then ``steps`` greedy steps; their logits (steps, vocab)."""
    ids = torch.randint(0, runner.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    out = []
    with torch.inference_mode():
        last = runner(ids, cache, 0)
        for _ in range(steps):
            last = runner(last[:, -1:].argmax(-1), cache, cache.seq_length)
            out.append(last[0, -1])
    return torch.stack(out)


def test_native_decode_over_float16_kv_matches_pytorch_and_the_float32_cache(tiny_models, monkeypatch):
    native_runner, eager_runner = _runner(tiny_models, "native"), _runner(tiny_models, "eager")
    calls = []
    decode = native.NativeModel.decode
    monkeypatch.setattr(native.NativeModel, "decode", lambda self, *a: calls.append(1) or decode(self, *a))
    half_cache = _cache(native_runner, torch.float16)
    assert half_cache.supports_in_place(0)
    half_native = _decode(native_runner, half_cache)
    assert len(calls) == 10  # every step read the float16 cache natively
    half_eager = _decode(eager_runner, _cache(eager_runner, torch.float16))
    full = _decode(native_runner, _cache(native_runner, torch.float32))
    torch.testing.assert_close(half_native, half_eager, atol=1e-4, rtol=1e-4)  # same KV values, float32 math
    scale = full.abs().max().item()
    torch.testing.assert_close(half_native, full, atol=5e-3 * scale, rtol=5e-3)  # float16's rounding of k/v
    assert half_cache.storage_tensors()["device"][0].dtype == torch.float16


def test_float16_kv_holds_half_the_bytes():
    spec = KVSpec(2, 2, 16, torch.float32, CPU, max_tokens=256)
    full, half = DynamicCache(spec, page_size=16), DynamicCache(spec, page_size=16, kv_dtype=torch.float16)
    for cache in (full, half):
        cache.reserve(100)
    assert half.ledger.current("device") * 2 == full.ledger.current("device") > 0
    k = torch.randn(1, 2, 5, 16)
    half.extend(0, k, k)
    keys, _ = half.read_layer(0)
    assert keys.dtype == torch.float32 and torch.equal(keys, k.half().float())  # read back in the compute dtype


def test_kv_dtype_selects_the_stored_dtype_end_to_end(tiny_models):
    from hybridllm import LLM, SamplingParams
    from hybridllm.config import KVConfig
    from hybridllm.errors import ConfigError

    gguf = str(tiny_models["llama"][1])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    half = LLM(gguf, threads=2, kv_dtype="float16")
    cache = half.new_cache()
    assert cache.kv_dtype == torch.float16 and cache.supports_in_place(0)
    full = LLM(gguf, threads=2)
    assert half.generate("The sky is", params).token_ids == full.generate("The sky is", params).token_ids
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVConfig(kv_dtype="int3")
    with pytest.raises(ConfigError, match="dynamic and quantized KV caches only"):
        KVConfig(kv_cache="tiered", kv_dtype="float16")
