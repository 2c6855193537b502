"""Mistral and Phi-3 attend through their ``sliding_window`` on every layer, as transformers does:
prefill logits and greedy decoding (the native kernels' windowed attention included) against
transformers on tiny models whose window is shorter than the prompt; a window that holds the whole
context (``--ctx-size``) is dropped; a shorter one is applied by every KV strategy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy_ids


WINDOW = 8


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def windowed(request, tmp_path_factory):
    from tiny_models import build_hf_model

    folder = tmp_path_factory.mktemp(f"{request.param}-window")
    model = build_hf_model(folder, request.param, sliding_window=WINDOW)
    return folder, model


def test_config_windows_every_layer(windowed):
    from hybridllm.loading.registry import open_checkpoint

    config = open_checkpoint(windowed[0]).config
    assert config.sliding_window == WINDOW
    assert [config.layer_window(i) for i in range(config.n_layers)] == [WINDOW] * config.n_layers


def test_prefill_logits_match_transformers(windowed):
    from hybridllm import LLM

    folder, hf_model = windowed
    ids = torch.arange(5, 35).unsqueeze(0)  # (1, 30): longer than the window
    llm = LLM(folder, weights="float")
    with torch.inference_mode():
        expected = hf_model(ids).logits[0]
        ours = llm.model(ids, llm.new_cache(), start_pos=0, all_logits=True)[0]
        hf_model.config.sliding_window = None  # the same weights attending globally
        global_logits = hf_model(ids).logits[0]
        hf_model.config.sliding_window = WINDOW
    assert (ours - expected).abs().max() < 1e-4
    assert (global_logits - expected).abs().max() > 1e-2  # the window matters past WINDOW tokens


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_greedy_decode_matches_transformers(windowed, backend):
    from hybridllm import LLM, SamplingParams

    folder, hf_model = windowed
    prompt = list(range(5, 17))
    llm = LLM(folder, weights="float", decode_backend=backend)
    report = llm.runtime.runner.report.build
    if backend == "native":  # every layer's step runs in the kernels, windowed attention included
        assert report.kernel_layers == llm.config.n_layers
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    expected = hf_greedy_ids(hf_model, prompt, 16)
    assert out.token_ids == expected


def test_a_window_holding_the_context_is_dropped(windowed):
    from hybridllm import LLM

    folder, _ = windowed
    assert LLM(folder, ctx_size=WINDOW, kv_cache="offloaded").runtime.kv_spec().plain_attention
    assert not LLM(folder, ctx_size=4 * WINDOW, kv_cache="offloaded").runtime.kv_spec().plain_attention


@pytest.mark.parametrize("knobs", [{"kv_cache": "offloaded"},
                                   {"kv_cache": "tiered", "kv_page_size": 4, "kv_hot_window": 4, "kv_sink_tokens": 2}],
                         ids=["offloaded", "tiered"])
def test_every_strategy_decodes_through_the_window(windowed, knobs):
    """The window falls across the tiered cache's sinks, cold pages and hot tokens: its greedy ids
    (native steps) are transformers'."""
    from hybridllm import LLM, SamplingParams

    folder, hf_model = windowed
    prompt = list(range(5, 5 + 3 * WINDOW))
    llm = LLM(folder, weights="float", prefill_chunk=5, **knobs)
    assert not llm.runtime.kv_spec().plain_attention
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out.token_ids == hf_greedy_ids(hf_model, prompt, 12)
