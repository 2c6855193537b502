"""Prompts on which a tiny random model's greedy continuation repeats earlier n-grams, so that
``--spec ngram`` proposals get accepted (a random model has no copying behaviour to rely on:
among a few candidate prompts, the one whose continuation accepts the most is taken; the model
and the candidates are fixed, so the choice is too)."""

from __future__ import annotations

from hybridllm import SamplingParams

CANDIDATES = 12


def repetitive_prompt(llm, length: int = 60, probe_tokens: int = 32) -> list[int]:
    """The candidate prompt (a seed of 5 ids and the model's greedy continuation of it, ``length``
    tokens) whose next ``probe_tokens`` greedy tokens accept the most n-gram proposals of ``llm``
    (an ``LLM`` built with ``spec="ngram"``)."""
    best, best_accepted = None, -1
    for start in range(CANDIDATES):
        seed = [11 + 7 * start + i for i in range(5)]
        greedy = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True, speculative=False)
        prompt = seed + llm.generate(seed, greedy).token_ids
        probe = llm.generate(prompt, SamplingParams(max_tokens=probe_tokens, temperature=0, ignore_eos=True))
        accepted = probe.metrics["spec_accepted_tokens"]
        if accepted > best_accepted:
            best, best_accepted = prompt, accepted
    return best


TIERED_KNOBS = {"kv_hot_window": 32, "kv_page_size": 16}  # a small hot window: pages go cold mid-answer


def every_kv_strategy_and_host_decode() -> dict[str, dict]:
    """``LLM`` options per configuration of the exactness tests: every registered KV strategy
    (tiered with a small hot window) and decode on the host."""
    from hybridllm.kvcache.registry import strategy_names

    configs = {name: {"kv_cache": name, **(TIERED_KNOBS if name == "tiered" else {})} for name in strategy_names()}
    configs["decode on host"] = {"decode_on": "host"}
    return configs
