"""Parity with Hugging Face transformers on tiny random Llama / Llama-3 / Qwen2 / Mistral / Qwen3 /
Phi-3 / Gemma 2 / Gemma 3 models, loaded both from safetensors folders and from GGUF files written like llama.cpp's
converter."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import layer_attention
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint

from conftest import ALL_ARCHS
from tiny_models import hf_greedy_ids

FORMATS = ("safetensors", "gguf")


def _path(tiny_models, arch, fmt):
    folder, gguf_path, _ = tiny_models[arch]
    return folder if fmt == "safetensors" else gguf_path


def _cache_for(model) -> DynamicCache:
    c = model.config
    return DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, torch.device("cpu"),
                               max_tokens=c.max_position_embeddings, attention=layer_attention(c)), page_size=16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_logits_match_transformers(tiny_models, arch, fmt):
    _, _, hf_model = tiny_models[arch]
    model = load_model(open_checkpoint(_path(tiny_models, arch, fmt)), torch.float32, lambda n: torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf_model(ids).logits
        whole = model(ids, _cache_for(model), start_pos=0, all_logits=True)
        # the same sequence in three chunks through the cache (chunked prefill + decode path)
        cache = _cache_for(model)
        parts = [model(ids[:, a:b], cache, start_pos=a, all_logits=True) for a, b in ((0, 17), (17, 39), (39, 40))]
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_continuation_matches_transformers(tiny_models, arch, fmt):
    _, _, hf_model = tiny_models[arch]
    llm = LLM(model=_path(tiny_models, arch, fmt), prefill_chunk=5)
    prompt = llm.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    ref = hf_greedy_ids(hf_model, prompt, 32)
    out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == ref
    assert len(out.token_ids) == 32


def test_gguf_qk_rows_are_permuted_on_disk(tiny_models):
    """The GGUF file stores llama.cpp's interleaved Q rows; loading restores the HF layout."""
    from hybridllm.loading.gguf import GGUFFile

    folder, gguf_path, hf_model = tiny_models["llama"]
    raw = GGUFFile(gguf_path).raw("blk.0.attn_q.weight").view("float32").reshape(64, 64)
    hf_q = hf_model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not (raw == hf_q).all()
    loaded = GGUFFile(gguf_path).dequantize("blk.0.attn_q.weight").numpy()
    assert (loaded == hf_q).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_run_close_to_float32(tiny_models, dtype, shared_llm):
    folder = tiny_models["llama"][0]
    ref = shared_llm(model=folder)
    low = LLM(model=folder, dtype=dtype)
    assert low.model.compute_dtype == getattr(torch, dtype)
    ids = list(range(5, 25))
    with torch.inference_mode():
        a = ref.model(torch.tensor([ids]), ref.new_cache(), 0, all_logits=True)
        b = low.model(torch.tensor([ids]), low.new_cache(), 0, all_logits=True)
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05, f"{dtype} logits differ from float32 by {rel:.3%}"
