"""Sampling filters and parameter validation."""

from __future__ import annotations

import pytest
import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.output import StopStringMatcher
from hybridllm.engine.sampling import Sampler, apply_repetition_penalty, min_p_filter, top_k_filter, top_p_filter
from hybridllm.errors import ConfigError


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


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
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_seeded_sampler_is_deterministic():
    logits = torch.randn(100)
    params = SamplingParams(temperature=1.0, seed=7)
    assert [Sampler(params)(logits) for _ in range(3)] == [Sampler(params)(logits) for _ in range(3)]


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1}, {"top_p": 2}, {"top_p": 0}, {"top_k": -1}, {"min_p": 1.5},
    {"max_tokens": 0}, {"repetition_penalty": 0}, {"stop": [""]},
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
