"""Phi-3 128K's longrope: short factors while a sequence fits the original window, long factors
(and the attention factor on cos/sin) past it, as transformers computes them; the GGUF file keeps
them as llama.cpp's converter writes them (``rope_factors_long/short.weight``, the attention
factor key) and reads back to the same logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy_ids

ORIGINAL = 16  # the tiny model's original window: prompts cross it


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    from tiny_models import build_hf_model, save_as_gguf

    folder = tmp_path_factory.mktemp("phi3-longrope")
    half = 8  # rotary_dim / 2 of the tiny phi3 (head_dim 16)
    rng = np.random.default_rng(0)
    scaling = {"type": "longrope", "short_factor": (1 + rng.random(half)).tolist(),
               "long_factor": (2 + 6 * rng.random(half)).tolist()}
    model = build_hf_model(folder / "hf", "phi3", rope_scaling=scaling, max_position_embeddings=64,
                           original_max_position_embeddings=ORIGINAL)
    return folder / "hf", save_as_gguf(folder / "hf", folder / "longrope.gguf", "F32"), model


def _logits(llm, ids):
    with torch.inference_mode():
        return llm.model(torch.tensor([ids]), llm.new_cache(), start_pos=0, all_logits=True)[0]


def test_config_reads_longrope(longrope):
    from hybridllm.loading.registry import open_checkpoint

    for path in longrope[:2]:
        scaling = open_checkpoint(path).config.rope_scaling
        assert scaling.kind == "longrope" and scaling.original_max_position_embeddings == ORIGINAL
        assert scaling.attention_factor == pytest.approx((1 + np.log(64 / ORIGINAL) / np.log(ORIGINAL)) ** 0.5)
        assert len(scaling.long_factor) == 8


@pytest.mark.parametrize("length", [12, 30])  # within the original window, and past it
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_prefill_logits_match_transformers(longrope, length, source):
    from hybridllm import LLM

    folder, gguf_path, hf_model = longrope
    ids = list(range(5, 5 + length))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ours = _logits(LLM(folder if source == "folder" else gguf_path, weights="float"), ids)
    assert (ours - expected).abs().max() < 1e-4


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_greedy_decode_across_the_original_window_matches_transformers(longrope, backend):
    """Decoding from a 10-token prompt to 30 tokens switches to the long factors at token 17,
    as transformers' generate does (the cached keys keep the short ones)."""
    from hybridllm import LLM, SamplingParams

    folder, _, hf_model = longrope
    prompt = list(range(5, 15))
    llm = LLM(folder, weights="float", decode_backend=backend)
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    expected = hf_greedy_ids(hf_model, prompt, 20)
    assert out.token_ids == expected


def test_chunked_prefill_across_the_original_window_matches_transformers(longrope):
    """A prompt past the original window prefilled in chunks of 8: the chunk that crosses it
    re-encodes the chunks before it, so every key rotates with the long factors."""
    from hybridllm import LLM, SamplingParams

    folder, _, hf_model = longrope
    prompt = list(range(5, 5 + 2 * ORIGINAL - 3))
    out = LLM(folder, weights="float", prefill_chunk=8).generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    expected = hf_greedy_ids(hf_model, prompt, 8)
    assert out.token_ids == expected


def test_gguf_keeps_llama_cpp_names_and_llama_cpp_reads_it(longrope):
    from hybridllm import LLM
    from hybridllm.loading.gguf import GGUFFile

    _, gguf_path, _ = longrope
    file = GGUFFile(gguf_path)
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(file.tensors)
    assert file.metadata["phi3.rope.scaling.original_context_length"] == ORIGINAL
    llama_cpp = pytest.importorskip("llama_cpp")
    # llama.cpp picks the factor set by its context size (long past the original window), we by the
    # sequence's length: a prompt past the original window rotates with the long set in both
    ids = list(range(5, 5 + 2 * ORIGINAL))
    theirs = llama_cpp.Llama(str(gguf_path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    theirs.eval(ids)
    their_logits = np.array(theirs.scores[: len(ids)])
    ours = _logits(LLM(gguf_path, weights="float"), ids).numpy()
    assert np.corrcoef(their_logits.ravel(), ours.ravel())[0, 1] > 0.999
    assert (their_logits.argmax(-1) == ours.argmax(-1)).mean() >= 0.9
