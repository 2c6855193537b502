"""What the Qwen3 and Phi-3 families add to the Llama decoder: their pieces in the model, their
GGUF layout (as llama.cpp's converter writes it), the native backend's refusals, and the
one-line errors for what is not supported. Parity with transformers is in test_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hybridllm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from hybridllm.errors import UnsupportedModelError
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import layer_attention
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.layers import RMSNorm
from hybridllm.models.quantized import Int8Linear
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from conftest import ALL_ARCHS

CPU = torch.device("cpu")


def _load(path, weights: str = "float"):
    return load_model(open_checkpoint(path), torch.float32, lambda n: CPU, weights=weights)


def test_qwen3_has_qk_norm_and_its_own_head_dim(tiny_models):
    folder, gguf_path, _ = tiny_models["qwen3"]
    for path in (folder, gguf_path):
        model = _load(path)
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
        assert model.config.head_dim == 32 != model.config.hidden_size // model.config.n_heads
        assert model.config.tie_word_embeddings
    llama = _load(tiny_models["llama"][0]).model.layers[0].self_attn
    assert isinstance(llama.q_norm, nn.Identity) and isinstance(llama.k_norm, nn.Identity)


def test_gguf_files_use_llama_cpp_names_and_keys(tiny_models):
    qwen3 = GGUFFile(tiny_models["qwen3"][1])
    assert qwen3.metadata["general.architecture"] == "qwen3"
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(qwen3.tensors)
    assert "output.weight" not in qwen3.tensors  # tied
    assert qwen3.metadata["qwen3.attention.key_length"] == 32

    phi3 = GGUFFile(tiny_models["phi3"][1])
    assert phi3.metadata["general.architecture"] == "phi3"
    names = set(phi3.tensors)
    assert "blk.0.attn_qkv.weight" in names and not names & {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"}
    config = phi3.config
    assert phi3.tensors["blk.0.ffn_up.weight"].shape == (2 * config.intermediate_size, config.hidden_size)
    assert phi3.metadata["phi3.attention.sliding_window"] == 0 and config.sliding_window is None
    # Neither family's Q/K rows are permuted (llama.cpp runs them with NeoX rotary).
    hf = tiny_models["phi3"][2].model.layers[0].self_attn.qkv_proj.weight.detach()
    assert torch.equal(phi3.dequantize("blk.0.attn_qkv.weight"), hf)

    partial = GGUFFile(tiny_models["phi3_partial"][1])
    assert partial.metadata["phi3.rope.dimension_count"] == 8
    assert partial.config.rotary_dim == 8 and partial.config.head_dim == 16


def test_stacked_checkpoint_loads_as_it_is(tiny_models):
    """Phi-3's qkv_proj and gate_up_proj go into the model unchanged, float and quantized."""
    folder, _, hf_model = tiny_models["phi3"]
    model = _load(folder)
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, hf_model.model.layers[1].mlp.gate_up_proj.weight)
    quantized = _load(folder, weights="int8")
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, Int8Linear)
    c = quantized.config
    ids = torch.arange(3, 23).unsqueeze(0)  # (1, 20)
    with torch.inference_mode():
        expected = hf_model(ids).logits
        cache = DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=64))
        logits = quantized(ids, cache, 0, all_logits=True)
    assert logits.argmax(-1).eq(expected.argmax(-1)).float().mean() > 0.8  # int8 rounding, same model


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_native_backend_runs_every_architecture(tiny_models, arch):
    """q/k norms, partial rotary, QKV bias, GeGLU, the Gemma block's norms, embedding scaling, score
    scale and soft-cap, sliding-window layers with their own rotary base: every family's layers and
    head run natively in whole steps (prefill chunks and decode), as its PyTorch layers compute."""
    runs = {}
    for backend in ("eager", "native"):
        model = _load(tiny_models[arch][0])
        runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)
        c = model.config
        spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=c.max_position_embeddings,
                      attention=layer_attention(c))
        cache = DynamicCache(spec, page_size=16)
        ids = torch.randint(0, c.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            logits = [runner(ids[:, :25], cache, 0, all_logits=True), runner(ids[:, 25:33], cache, 25, all_logits=True)]
            logits += [runner(ids[:, t:t + 1], cache, t) for t in range(33, 40)]
        runs[backend] = torch.cat(logits, dim=1)
        if backend == "native":
            report = runner.report.build
            assert report.whole_step and report.skipped == [] and report.kernel_layers == c.n_layers
    torch.testing.assert_close(runs["native"], runs["eager"], atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="supported: llama.*qwen3.*phi3") as info:
        ModelConfig.from_hf_dict({"model_type": "falcon", "vocab_size": 10, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    assert "\n" not in str(info.value)
    assert {"qwen3", "phi3"} <= set(SUPPORTED_ARCHITECTURES)


def test_unknown_rope_scaling_is_refused_in_one_line(tiny_models):
    raw = json.loads((tiny_models["phi3"][0] / "config.json").read_text())
    raw["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="'dynamic'.*supported: llama3, linear, longrope") as info:
        ModelConfig.from_hf_dict(raw)
    assert "\n" not in str(info.value)


def test_gguf_of_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'falcon'.*supported: .*qwen3.*phi3.*gemma2.*gemma3"):
        GGUFFile(tmp_path / "g.gguf")


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "mistral", "qwen3", "phi3"])
def test_llama_cpp_reads_our_gguf_of_every_family(tiny_models, arch):
    """Our GGUF files (written as llama.cpp's converter does) run in llama.cpp with our logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    from hybridllm import LLM

    path = tiny_models[arch][1]
    ids = list(range(5, 37))
    theirs = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    theirs.eval(ids)
    their_logits = np.array(theirs.scores[: len(ids)])
    ours = LLM(path, weights="float")
    with torch.inference_mode():
        our_logits = ours.model(torch.tensor([ids]), ours.new_cache(), start_pos=0, all_logits=True)[0].numpy()
    assert np.corrcoef(their_logits.ravel(), our_logits.ravel())[0, 1] > 0.999
    assert (their_logits.argmax(-1) == our_logits.argmax(-1)).mean() >= 0.9
