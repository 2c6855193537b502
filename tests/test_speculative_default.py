"""Speculative decoding on the default model (issue 35): at temperature 0 the text is the text of
plain decoding, for 16 prompts decoded together, with n-gram proposals under every KV strategy and
with ``--decode-on host``, and with a draft model. The prompts repeat their input, so proposals
are accepted (each configuration asserts it: the test cannot pass without verifying anything).

Each row's logits in a verification forward are bitwise those of a one-token step on the native
kernels (issue 33), which is why the texts are equal, not just close.
"""

from __future__ import annotations

import pytest

from hybridllm import LLM, SamplingParams

from conftest import NEEDS_COMPILER
from spec_helpers import every_kv_strategy_and_host_decode

pytestmark = [pytest.mark.slow, NEEDS_COMPILER]

PROMPTS = [
    "Repeat exactly: The quick brown fox jumps over the lazy dog.",
    "Copy this list: apples, pears, plums, cherries, grapes, lemons.",
    "Say 'hello world' five times.",
    "Rewrite this code with x renamed to y:\n\ndef f(x):\n    return x * x + x\n",
    "Repeat the following line twice: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "Copy this sentence: Paris is the capital of France and Berlin is the capital of Germany.",
    "Echo back: The rain in Spain stays mainly in the plain.",
    "Fix the typo and return the text: The cat sat on teh mat and looked at the door.",
    "Repeat after me: To be or not to be, that is the question.",
    "Write the alphabet in capital letters separated by commas.",
    "Quote this: 'All that glitters is not gold.' Then quote it again.",
    "Rewrite in lower case: THE SUN RISES IN THE EAST AND SETS IN THE WEST.",
    "List the days of the week, then list them again in the same order.",
    "Translate this to English and repeat the original: Bonjour tout le monde.",
    "Count from one to twenty in words.",
    "Convert to a Python list: red, green, blue, yellow, black, white.",
]
NEW_TOKENS = 48

CONFIGS = every_kv_strategy_and_host_decode()  # every registered KV strategy, and decode on the host


def _greedy_both_ways(llm: LLM) -> tuple[list, list]:
    prompts = [llm.encode_prompt([{"role": "user", "content": prompt}]) for prompt in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    plain = llm.engine.generate_batch(prompts, [SamplingParams(**{**params.__dict__, "speculative": False})] * 16)
    spec = llm.engine.generate_batch(prompts, [params] * 16)
    return plain, spec


def _assert_same_text(plain: list, spec: list, label: str) -> None:
    differing = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a.token_ids != b.token_ids]
    assert differing == [], f"{label}: prompts {differing} differ"
    accepted = sum(r.metrics["spec_accepted_tokens"] for r in spec)
    assert accepted > 0, f"{label}: no proposal was accepted"
    assert all(r.metrics["spec_drafts"] == 0 for r in plain)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_ngram_speculation_gives_the_plain_greedy_text(config):
    llm = LLM(spec="ngram", spec_max_batch=0, threads=2, **CONFIGS[config])
    assert llm.runtime.kv_attention == "native"  # every strategy and placement attends natively on the CPU
    plain, spec = _greedy_both_ways(llm)
    _assert_same_text(plain, spec, config)
    if config == "tiered":
        assert sum(r.metrics["kv_pages_moved"] for r in spec) > 0  # pages did go cold while drafts came and went
    if config == "decode on host":
        assert all(r.metrics["decode_on"] == "host" for r in spec)


def test_draft_model_speculation_gives_the_plain_greedy_text(default_model_path):
    """The default model drafting for itself (the same vocabulary by construction): its argmax is
    the target's, so nearly every proposal is accepted; the texts are plain decoding's."""
    llm = LLM(model_draft=str(default_model_path), draft_max=8, spec_max_batch=0, threads=2)
    plain, spec = _greedy_both_ways(llm)
    _assert_same_text(plain, spec, "draft model")
    accepted = sum(r.metrics["spec_accepted_tokens"] for r in spec)
    drafted = sum(r.metrics["spec_draft_tokens"] for r in spec)
    assert accepted >= 0.9 * drafted
