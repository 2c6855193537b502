"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): golden greedy outputs equal
transformers' on the same file, the Python API, streaming, stop rules and metrics."""

from __future__ import annotations

import pytest
import torch

from hybridllm import SamplingParams

pytestmark = pytest.mark.slow  # the default model next to transformers

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
METRIC_KEYS = {"cold_start_s", "ttft_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s", "decode_tps", "prefill_tps",
               "prompt_tokens", "generated_tokens", "peak_host_bytes", "peak_device_bytes"}


@pytest.fixture(scope="module")
def hf_default(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_output_equals_transformers(default_llm, hf_default, prompt):
    ids = default_llm.encode_prompt([{"role": "user", "content": prompt}])
    with torch.inference_mode():
        ref = hf_default.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    out = default_llm.generate(ids, SamplingParams(max_tokens=24, temperature=0))
    assert out.token_ids == ref


def test_capital_of_france_is_paris(default_llm):
    out = default_llm.generate([{"role": "user", "content": "What is the capital of France?"}],
                               SamplingParams(max_tokens=20, temperature=0))
    assert "Paris" in out.text


def test_metrics_have_every_key_and_sane_values(default_llm):
    out = default_llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    m = out.metrics
    assert METRIC_KEYS <= set(m)
    assert m["generated_tokens"] == len(out.token_ids) == 8
    assert m["prompt_tokens"] == len(out.prompt_token_ids) > 0
    assert m["ttft_s"] > 0 and m["decode_tps"] > 0 and m["prefill_tps"] > 0
    assert m["tpot_p50_s"] <= m["tpot_p99_s"]
    assert m["peak_host_bytes"] > 100 * 2**20  # float32 weights alone are ~540 MB
    assert m["peak_device_bytes"] >= default_llm.weight_bytes["device"]
    assert m["cold_start_s"] > 0


def test_stream_concatenates_to_generate_text(default_llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = [{"role": "user", "content": "Name a fruit."}]
    pieces = list(default_llm.stream(prompt, params))
    assert len(pieces) > 1
    assert "".join(pieces) == default_llm.generate(prompt, params).text


def test_stop_string_cuts_text(default_llm):
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    full = default_llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0)).text
    assert "Paris" in full
    out = default_llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, stop=["Paris"]))
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index("Paris")]
    streamed = "".join(default_llm.stream(prompt, SamplingParams(max_tokens=20, temperature=0, stop=["Paris"])))
    assert streamed == out.text


def test_eos_and_max_tokens_finish_reasons(default_llm):
    prompt = [{"role": "user", "content": "Say hi."}]
    short = default_llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    full = default_llm.generate(prompt, SamplingParams(max_tokens=200, temperature=0))
    assert full.finish_reason == "stop"
    assert full.token_ids[-1] in default_llm.tokenizer.eos_token_ids


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(default_llm):
    prompt = "My favourite animal is"
    def run(seed):
        return default_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.95,
                                                           min_p=0.01, repetition_penalty=1.1, seed=seed,
                                                           ignore_eos=True)).token_ids
    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in (1, 2, 3)}) > 1


def test_prompt_longer_than_context_is_rejected(default_llm):
    from hybridllm.errors import ContextOverflowError

    with pytest.raises(ContextOverflowError, match="context window"):
        default_llm.generate([1] * (default_llm.config.max_position_embeddings + 1), SamplingParams(max_tokens=1))
