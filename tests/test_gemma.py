"""What Gemma 2 and Gemma 3 add, and that each piece matters: the sliding window and soft-capping
change the logits (transformers agrees with ours, full / uncapped attention does not), their GGUF
keys and tensor names (llama.cpp's), every KV strategy applying them (and the backend that refuses
them in one line), and llama.cpp reading our Gemma GGUF. Plain parity (logits, greedy ids) is in
test_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache import DynamicCache, KVSpec
from hybridllm.kvcache.attention import AttentionOptions, causal_attention, layer_attention
from hybridllm.kvcache.factory import create_cache
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.layers import GeGLU
from hybridllm.models.llama import GemmaDecoderLayer
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.runner import build_runner

from tiny_models import GEMMA_WINDOW, build_hf_model, hf_greedy_ids, save_as_gguf

CPU = torch.device("cpu")
GEMMAS = ("gemma2", "gemma3")


def _load(path):
    return load_model(open_checkpoint(path), torch.float32, lambda n: CPU)


def _logits(model, ids, attention):
    c = model.config
    cache = DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=128,
                                attention=attention), page_size=16)
    with torch.inference_mode():
        return model(ids, cache, 0, all_logits=True)


def _without(attention, **field):
    return tuple(dataclasses.replace(options, **field) for options in attention)


@pytest.mark.parametrize("arch", GEMMAS)
def test_sliding_window_matters(tiny_models, arch):
    """A prompt 4x the window: equal to transformers, far from the same model attending globally."""
    folder, _, hf_model = tiny_models[arch]
    model = _load(folder)
    attention = layer_attention(model.config)
    assert [o.window for o in attention] == [GEMMA_WINDOW if w else None for w in model.config.sliding_layers]
    ids = torch.arange(3, 3 + 4 * GEMMA_WINDOW).unsqueeze(0)  # (1, 32)
    with torch.inference_mode():
        expected = hf_model(ids).logits
    torch.testing.assert_close(_logits(model, ids, attention), expected, atol=1e-4, rtol=1e-4)
    full = _logits(model, ids, _without(attention, window=None))
    torch.testing.assert_close(full[:, :GEMMA_WINDOW], expected[:, :GEMMA_WINDOW], atol=1e-4, rtol=1e-4)
    assert (full[:, GEMMA_WINDOW:] - expected[:, GEMMA_WINDOW:]).abs().max() > 0.5


def test_soft_capping_matters(tiny_models):
    folder, _, hf_model = tiny_models["gemma2"]
    model = _load(folder)
    assert model.config.attn_logit_softcapping == 5.0 and model.config.final_logit_softcapping == 10.0
    ids = torch.arange(3, 23).unsqueeze(0)
    attention = layer_attention(model.config)
    with torch.inference_mode():
        expected = hf_model(ids).logits
    logits = _logits(model, ids, attention)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert logits.abs().max() < 10.0  # the final cap bounds them
    uncapped = _logits(model, ids, _without(attention, softcap=None))
    assert (uncapped - expected).abs().max() > 0.5


def test_windowed_attention_equals_a_masked_reference():
    """Decode and chunked prefill over more keys than the window: only the window's keys count."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    out = causal_attention(q, k, v, query_start=15, window=4, softcap=3.0, scale=0.3)
    keys = k.repeat_interleave(2, dim=1)  # (1, 4, 20, 8)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * 0.3 / 3.0) * 3.0  # (1, 4, 5, 20)
    pos = torch.arange(15, 20)[:, None]
    key_pos = torch.arange(20)[None, :]
    scores = scores.masked_fill(~((key_pos <= pos) & (key_pos > pos - 4)), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v.repeat_interleave(2, dim=1))
    plain = causal_attention(q, k, v, query_start=15)
    torch.testing.assert_close(causal_attention(q, k, v, 15, scale=None, softcap=None, window=None), plain)
    assert AttentionOptions().plain and not AttentionOptions(window=4).plain


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_model_pieces_and_norms_stored_as_one_plus_w(tiny_models, arch):
    folder, gguf_path, hf_model = tiny_models[arch]
    for path in (folder, gguf_path):
        model = _load(path)
        layer = model.model.layers[0]
        assert isinstance(layer, GemmaDecoderLayer) and isinstance(layer.mlp, GeGLU)
        hf_norm = hf_model.model.layers[0].pre_feedforward_layernorm.weight.detach()
        torch.testing.assert_close(layer.pre_feedforward_layernorm.weight, hf_norm + 1.0)
        assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
        assert model.config.attention_scale == pytest.approx(24 ** -0.5)
    if arch == "gemma3":  # q/k norms, and two rotary tables (the local base for sliding layers)
        attn = model.model.layers[0].self_attn
        assert not isinstance(attn.q_norm, torch.nn.Identity)
        assert [lay.self_attn.rope_table for lay in model.model.layers] == [1, 1, 1, 1, 1, 0]


def test_gguf_uses_llama_cpp_keys_and_names(tiny_models):
    gemma2 = GGUFFile(tiny_models["gemma2"][1])
    md = gemma2.metadata
    assert md["general.architecture"] == "gemma2"
    assert md["gemma2.attention.sliding_window"] == GEMMA_WINDOW
    assert md["gemma2.attn_logit_softcapping"] == 5.0 and md["gemma2.final_logit_softcapping"] == 10.0
    assert {"blk.0.attn_norm.weight", "blk.0.post_attention_norm.weight", "blk.0.ffn_norm.weight",
            "blk.0.post_ffw_norm.weight"} <= set(gemma2.tensors)
    assert "output.weight" not in gemma2.tensors
    gemma3 = GGUFFile(tiny_models["gemma3"][1])
    md = gemma3.metadata
    assert md["general.architecture"] == "gemma3" and md["gemma3.rope.freq_base_swa"] == 100.0
    assert md["gemma3.rope.scaling.type"] == "linear" and md["gemma3.rope.scaling.factor"] == 2.0
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(gemma3.tensors)
    assert gemma3.config.sliding_layers == (True,) * 5 + (False,)


# Every strategy, its tokens split as the knobs say (packed + residual, cold pages + hot window + sinks)
# so that the tiny Gemmas' window of 8 falls across its stores.
STRATEGY_KNOBS = {
    "offloaded": {"kv_cache": "offloaded"},
    "tiered": {"kv_cache": "tiered", "kv_page_size": 4, "kv_hot_window": 8, "kv_sink_tokens": 2},
    "quantized": {"kv_cache": "quantized", "kv_bits": 8, "kv_group_size": 8, "kv_residual": 4},
}


@pytest.mark.parametrize("strategy", list(STRATEGY_KNOBS))
@pytest.mark.parametrize("arch", GEMMAS)
def test_every_strategy_attends_as_the_gemmas_do(tiny_models, arch, strategy):
    """Windows, scale and soft-caps applied by every strategy, through PyTorch and the native steps:
    the lossless ones keep transformers' greedy ids; int8 groups stay within their rounding of the
    dynamic cache's logits, far closer than the same cache attending without the options."""
    folder, _, hf_model = tiny_models[arch]
    prompt = list(range(5, 5 + 3 * GEMMA_WINDOW))
    knobs = STRATEGY_KNOBS[strategy]
    if strategy != "quantized":
        expected = hf_greedy_ids(hf_model, prompt, 12)
        for backend in ("eager", "native"):
            llm = LLM(model=folder, prefill_chunk=5, decode_backend=backend, **knobs)
            out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            assert out.token_ids == expected, backend
        return
    model = _load(folder)
    attention = layer_attention(model.config)
    ids = torch.tensor([prompt])
    c = model.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=128, attention=attention)
    config = KVConfig(**knobs)
    exact = _logits(model, ids, attention)
    plain = _logits(model, ids, _without(_without(_without(attention, window=None), softcap=None), scale=None))
    with torch.inference_mode():
        ours = {}
        for backend in ("eager", "native"):
            runner = build_runner(model, Placement.all_on_device(c.n_layers), TierDevices(CPU), backend)
            cache = create_cache(config, spec)
            for start in range(0, ids.shape[1], 5):  # prefill chunks: the packed tokens grow between them
                logits = runner(ids[:, start:start + 5], cache, start)
            steps = [logits[0, -1]]
            for _ in range(6):
                steps.append(runner(torch.tensor([[int(steps[-1].argmax())]]), cache, cache.seq_length)[0, -1])
            ours[backend] = torch.stack(steps)  # (7, vocab)
            assert cache.seq_length == ids.shape[1] + 6
    error = ((ours["native"] - ours["eager"]).norm(dim=-1) / ours["eager"].norm(dim=-1)).max().item()
    assert error < 2e-3, error  # the kernels read the same codes the PyTorch path dequantizes
    last = exact[0, -1]
    quantized_error = ((ours["eager"][0] - last).norm() / last.norm()).item()
    options_matter = ((plain[0, -1] - last).norm() / last.norm()).item()
    assert quantized_error < options_matter / 5, (quantized_error, options_matter)


@pytest.mark.parametrize("strategy", ["tiered", "quantized"])
def test_batched_gemma_rows_of_every_strategy_are_their_rows_alone(tiny_models, strategy):
    """Rows at different positions (each past the window, each its own cache) decoded together in
    one native step: each row's logits are its logits alone, bit for bit."""
    from hybridllm.kvcache.batch import BatchedCaches

    model = _load(tiny_models["gemma3"][0])
    c = model.config
    runner = build_runner(model, Placement.all_on_device(c.n_layers), TierDevices(CPU), "native")
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=128,
                  attention=layer_attention(c))
    config = KVConfig(**STRATEGY_KNOBS[strategy])
    prompts = [torch.arange(n).unsqueeze(0) % c.vocab_size + offset for n, offset in ((21, 3), (13, 40), (30, 7))]
    alone, together = [], []
    with torch.inference_mode():
        for cache_set in (alone, together):
            for prompt in prompts:
                cache = create_cache(config, spec)
                runner(prompt, cache, 0)
                cache_set.append(cache)
        tokens = torch.tensor([[5], [9], [11]])
        expected = [runner(tokens[i:i + 1], cache, cache.seq_length)[0, -1] for i, cache in enumerate(alone)]
        batch = BatchedCaches(together)
        got = runner(tokens, batch, batch.start_positions())
    for i in range(3):
        assert torch.equal(got[i, -1], expected[i]), f"row {i}"


def test_tiered_pytorch_path_counts_the_cold_pages_it_moves(tiny_models):
    """Through PyTorch a Gemma layer of the tiered cache attends its cold pages on the device: a
    decode step's host-to-device bytes are those pages' (decoded) bytes, every layer."""
    model = _load(tiny_models["gemma3"][0])
    c = model.config
    runner = build_runner(model, Placement.all_on_device(c.n_layers), TierDevices(CPU), "eager")
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=128,
                  attention=layer_attention(c))
    cache = create_cache(KVConfig(**STRATEGY_KNOBS["tiered"]), spec)
    token_bytes = 2 * c.n_kv_heads * c.head_dim * 4  # a token's keys and values, float32
    with torch.inference_mode():
        runner(torch.arange(5, 5 + 3 * GEMMA_WINDOW).unsqueeze(0), cache, 0)
        cold_before = sum(cache.cold_tokens(i) for i in range(c.n_layers))
        moved_before = cache.bus_bytes["h2d"]
        runner(torch.tensor([[7]]), cache, cache.seq_length)
    cold_after = sum(cache.cold_tokens(i) for i in range(c.n_layers))
    moved = cache.bus_bytes["h2d"] - moved_before
    assert cold_before > 0 and cold_before * token_bytes <= moved <= cold_after * token_bytes


def test_a_strategy_without_the_options_refuses_in_one_line(tiny_models, monkeypatch):
    """The guard a future strategy relies on: one that does not declare ``attention_options``
    refuses such a model, naming the ones that apply them."""
    from hybridllm.kvcache import registry

    monkeypatch.setitem(registry.STRATEGIES, "quantized",
                        dataclasses.replace(registry.STRATEGIES["quantized"], attention_options=False))
    config = _load(tiny_models["gemma3"][0]).config
    spec = KVSpec(config.n_layers, config.n_kv_heads, config.head_dim, torch.float32, CPU,
                  attention=layer_attention(config))
    with pytest.raises(ConfigError, match="--kv-cache quantized has no sliding-window.*use --kv-cache dynamic, "
                                          "offloaded, tiered, host") as info:
        create_cache(KVConfig(kv_cache="quantized"), spec)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="has no sliding-window"):
        LLM(model=tiny_models["gemma3"][0], kv_cache="quantized")


def test_host_strategy_and_eager_backend_keep_parity(tiny_models):
    folder, _, hf_model = tiny_models["gemma2"]
    prompt = list(range(5, 5 + 2 * GEMMA_WINDOW))
    ref = hf_greedy_ids(hf_model, prompt, 12)
    for options in ({"kv_cache": "host"}, {"decode_backend": "eager"}):
        llm = LLM(model=folder, prefill_chunk=5, **options)
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert out.token_ids == ref, options


def test_native_backend_runs_gemma_and_cuda_graph_refuses(tiny_models):
    model = _load(tiny_models["gemma2"][0])
    runner = build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), "native")
    report = runner.report.build  # the Gemma block, soft-capped scores and logits: whole native steps
    assert report.kernel_layers == model.config.n_layers and report.head and report.whole_step
    assert report.skipped == []
    from hybridllm.runtime.backends.cuda_graph import CudaGraphBackend
    from hybridllm.runtime.placed_model import PlacedModel

    with pytest.raises(ConfigError, match="cuda-graph decode backend has no sliding-window.*eager or compiled"):
        CudaGraphBackend(PlacedModel(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU)))


@pytest.mark.parametrize("arch", GEMMAS)
def test_llama_cpp_reads_our_gemma_gguf(tmp_path, arch):
    """llama.cpp runs our GGUF (float32) to transformers' greedy ids, past the sliding window.

    llama.cpp fixes what our tiny test models vary (the score scale is head_dim's outside the 27B
    models, Gemma 3's local rotary base is 10000), so this model keeps those at Gemma's values.
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    hf_model = build_hf_model(tmp_path / arch, arch, query_pre_attn_scalar=16, rope_local_base_freq=10000.0)
    gguf_path = save_as_gguf(tmp_path / arch, tmp_path / f"{arch}.gguf")
    prompt = list(range(5, 5 + 2 * GEMMA_WINDOW))
    ref = hf_greedy_ids(hf_model, prompt, 8)
    peer = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=64, n_threads=1, verbose=False)
    out = []
    for token in peer.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == len(ref):
            break
    assert out == ref
    ours = LLM(model=gguf_path).generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ours.token_ids == ref


# Gemma 2's chat template as its tokenizer_config.json ships it (Gemma 3's adds system-prompt folding).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_gemma_chat_template_renders_and_refuses_what_it_refuses():
    from hybridllm.errors import HybridLLMError
    from hybridllm.loading.chat_template import ChatTemplate

    template = ChatTemplate(GEMMA_CHAT_TEMPLATE, {"bos_token": "<bos>"})
    messages = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Why?"}]
    assert template.render(messages, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(HybridLLMError, match="System role not supported"):
        template.render([{"role": "system", "content": "x"}, *messages])
