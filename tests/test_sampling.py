"""Sampling filters and parameter validation."""

from __future__ import annotations

import pytest
import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.output import StopStringMatcher
from hybridllm.engine.logprobs import sequence_logprobs, token_logprob
from hybridllm.engine.sampling import (
    Sampler,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    greedy_token,
    min_p_filter,
    probabilities,
    process_logits,
    sample_rows,
    top_k_filter,
    top_p_filter,
)
from hybridllm.errors import ConfigError


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def test_greedy_token_breaks_ties_and_nans_as_torch_argmax():
    rows = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    rows[1, 5] = rows[1, 70] = 100.0  # a tie: the first index
    rows[2, 9] = float("nan")  # NaN counts as the largest, as in torch.argmax
    strided = torch.randn(49152, 2)[:, 1]  # a view with a stride (a row of a (B, vocab) batch is one too)
    for row in [*rows, strided]:
        assert greedy_token(row) == int(torch.argmax(row))


def test_top_k_keeps_k_largest():
    out = top_k_filter(torch.tensor([1.0, 5.0, 3.0, 4.0]), 2)
    assert torch.isfinite(out).tolist() == [False, True, False, True]


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(top_p_filter(logits, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [True, False, False, False]


def test_min_p_drops_relatively_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    assert torch.isfinite(min_p_filter(logits, 0.2)).tolist() == [True, True, False, False]


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.tensor([2.0, -2.0, 1.0])
    seen = torch.bincount(torch.tensor([0, 1, 1]), minlength=3)  # the counts of the ids seen
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_seeded_sampler_is_deterministic():
    logits = torch.randn(100)
    params = SamplingParams(temperature=1.0, seed=7)
    assert [Sampler(params)(logits) for _ in range(3)] == [Sampler(params)(logits) for _ in range(3)]


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.tensor([1.0, 0.9, 0.0, -1.0])
    generated = [0, 0, 0, 2]  # token 0 three times, token 2 once
    out = apply_presence_frequency_penalty(logits, torch.bincount(torch.tensor(generated), minlength=4),
                                           presence=0.5, frequency=0.25)
    # logit - frequency * count - presence * (count > 0)
    assert torch.allclose(out, torch.tensor([1.0 - 0.75 - 0.5, 0.9, 0.0 - 0.25 - 0.5, -1.0]))

    def sampler(params: SamplingParams, seen: list[int]) -> Sampler:
        chosen = Sampler(params)
        chosen.record(seen)  # what the sequence generated so far
        return chosen

    greedy = SamplingParams(temperature=0)
    assert sampler(greedy, generated)(logits) == 0  # no penalty: the argmax
    assert sampler(SamplingParams(temperature=0, frequency_penalty=0.1), generated)(logits) == 1
    assert sampler(SamplingParams(temperature=0, presence_penalty=0.2), generated)(logits) == 1
    assert sampler(SamplingParams(temperature=0, presence_penalty=0.05), generated)(logits) == 0
    # a negative penalty favours what was generated
    assert sampler(SamplingParams(temperature=0, presence_penalty=-2), [2])(torch.tensor([0.0, 1.0, 0.5])) == 2


def test_logit_bias_adds_to_the_logits():
    logits = torch.tensor([0.0, 0.0, 5.0])
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: 10.0}))(logits) == 0
    assert Sampler(SamplingParams(temperature=0, logit_bias={2: -100.0}))(logits) in (0, 1)
    seeded = SamplingParams(temperature=1.0, seed=3, logit_bias={1: 100.0})
    assert {Sampler(seeded)(torch.randn(50)) for _ in range(5)} == {1}


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-5, "repetition_penalty": 5e-324},  # a seen logit at float32's max, then over 1e-5: +inf
    {"temperature": 1e-5},  # logits of 1e4 over 1e-5 stay finite, those of 1e36 do not
    {"temperature": 1e300},  # cast to float32: inf; a masked -inf over it is NaN
    {"temperature": 0.5, "repetition_penalty": 1e-40, "top_p": 5e-324, "min_p": 5e-324},
    {"temperature": 2.0, "repetition_penalty": 1e300, "presence_penalty": -2.0, "frequency_penalty": -2.0},
], ids=["tiny-temperature-tiny-penalty", "tiny-temperature", "huge-temperature", "subnormal-filters",
        "huge-penalty"])
def test_sampling_at_float32s_edges_draws_a_token_never_a_masked_one(kwargs):
    """Parameters a request may send (the fuzz found them) that overflow float32 on the way to the
    probabilities: they stay finite, and every draw is a real token, never a masked one."""
    params = SamplingParams(seed=0, **kwargs)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [1e4], [1e36], [1.0]])
    logits[:, 7] = float("-inf")  # masked (a grammar's mask does this)
    sampler = Sampler(params, prompt_ids=list(range(0, 64, 3)))  # the repetition penalty sees a third of the vocab
    for row in logits:
        processed = row[None].clone()
        process_logits(processed, [sampler])
        probs = probabilities(processed, params)
        assert torch.isfinite(probs).all() and probs[0, 7] == 0 and probs.sum() == pytest.approx(1.0)
        assert sample_rows(row[None].clone(), [sampler]) != [7]


@pytest.mark.parametrize("penalty", [1.4e65, 5e-324])
def test_a_huge_or_tiny_repetition_penalty_never_masks_the_only_allowed_tokens(penalty):
    """A grammar allows three tokens, all seen, their logits <= 0: a penalty that float32 rounds to
    inf (or to 0) pushes them as far as floats go, never to -inf (the fuzz's 500: every allowed
    token masked, the softmax NaN)."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, [0, 3, 6]] = torch.tensor([-1.5, 0.0, -0.25])  # what the grammar allows
    for temperature in (0.0, 0.3, 1.0):
        params = SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=0)
        sampler = Sampler(params, prompt_ids=[0, 3, 6, 9])
        processed = logits.clone()
        process_logits(processed, [sampler])
        assert torch.isfinite(processed[0, [0, 3, 6]]).all() and torch.isneginf(processed[0, 1])
        if not params.greedy:
            assert torch.isfinite(probabilities(processed, params)).all()
        assert sample_rows(logits.clone(), [sampler])[0] in (0, 3, 6)


def test_logprobs_are_the_log_softmax_before_any_transform():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    reference = torch.log_softmax(logits, dim=-1)
    entry = token_logprob(logits, 2, top_k=2)
    assert entry.token_id == 2 and entry.logprob == pytest.approx(float(reference[2]))
    assert [t for t, _ in entry.top] == [0, 1] and entry.top[0][1] == pytest.approx(float(reference[0]))
    assert token_logprob(logits, 0, top_k=0).top == ()
    rows = torch.stack([logits, logits.flip(0)])  # (2, vocab)
    entries = sequence_logprobs(rows, [3, 3], top_k=1)
    assert [e.logprob for e in entries] == pytest.approx([float(reference[3]), float(reference[0])])


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1}, {"top_p": 2}, {"top_p": 0}, {"top_k": -1}, {"min_p": 1.5},
    {"max_tokens": 0}, {"repetition_penalty": 0}, {"stop": [""]},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}},
    {"n": 0}, {"logprobs": -1}, {"prompt_logprobs": -2},
])
def test_invalid_sampling_values_raise(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_stop_matcher_holds_back_partial_stop_and_cuts_at_match():
    m = StopStringMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dmore") == ("", True)
    assert m.text == "hello "


def test_stop_matcher_releases_held_text_when_no_match():
    m = StopStringMatcher(["END"])
    assert m.feed("abc EN") == ("abc ", False)
    assert m.feed("x") == ("ENx", False)
