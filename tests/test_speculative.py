"""Speculative decoding (issue 35): proposals from n-grams or a draft model, verified in one forward.

- the n-gram index (longest and latest match, kept incrementally, equal to a rescan) and the
  draft-length pacer;
- the verifier: greedy keeps the argmax; sampling keeps the target distribution exactly
  (chi-square tests of the accept/reject rule on crafted distributions, and end to end on a tiny
  random model with and without speculation);
- the request loop: rows of different lengths verified in one step, the rejected KV rolled back,
  penalties, grammars, stop strings, the budget and log-probabilities as plain decoding has them;
- a draft model: greedy text identical, its vocabulary checked in one line.

The default model's matrix (every KV strategy, ``--decode-on host``) is in
tests/test_speculative_default.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import every_kv_strategy_and_host_decode, repetitive_prompt
from tiny_models import build_hf_model

from hybridllm import LLM, SamplingParams
from hybridllm.config import SpeculativeConfig, StructuredOutput
from hybridllm.engine.drafting import FIRST_DRAFT, MAX_PAUSE, DraftPacer
from hybridllm.engine.ngram import NgramIndex
from hybridllm.engine.sampling import Sampler, probabilities
from hybridllm.engine.verification import verify_draft
from hybridllm.errors import ConfigError

from conftest import NEEDS_COMPILER

EVERY_KV_AND_HOST_DECODE = every_kv_strategy_and_host_decode()
SIGNIFICANCE = 0.001  # the chi-square tests' level: at their fixed seeds they pass or fail deterministically


# ---- chi-square ---------------------------------------------------------------------------------
def chi_square_p_value(counts_a: dict, counts_b: dict) -> tuple[float, int]:
    """The p-value of Pearson's two-sample test that ``counts_a`` and ``counts_b`` (category ->
    count) come from one distribution; categories with few draws are pooled into one. Returns
    (p-value, degrees of freedom)."""
    total_a, total_b = sum(counts_a.values()), sum(counts_b.values())
    categories = sorted(set(counts_a) | set(counts_b), key=repr)
    pooled_a = pooled_b = 0
    cells: list[tuple[int, int]] = []
    for category in categories:
        a, b = counts_a.get(category, 0), counts_b.get(category, 0)
        if min(a + b * total_a / total_b, b + a * total_b / total_a) / 2 < 5:  # expected count under 5
            pooled_a, pooled_b = pooled_a + a, pooled_b + b
        else:
            cells.append((a, b))
    if pooled_a + pooled_b:
        cells.append((pooled_a, pooled_b))
    statistic = 0.0
    for a, b in cells:
        row = a + b
        for observed, total in ((a, total_a), (b, total_b)):
            expected = row * total / (total_a + total_b)
            statistic += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return p_value, dof


def test_the_chi_square_test_tells_distributions_apart():
    rng = random.Random(0)
    same_a = {k: 0 for k in range(6)}
    same_b = dict(same_a)
    other = dict(same_a)
    for _ in range(3000):
        same_a[rng.randrange(6)] += 1
        same_b[rng.randrange(6)] += 1
        other[min(5, int(rng.random() * 6.6))] += 1  # the last category a little more likely
    assert chi_square_p_value(same_a, same_b)[0] > SIGNIFICANCE
    assert chi_square_p_value(same_a, other)[0] < SIGNIFICANCE


# ---- the n-gram index ---------------------------------------------------------------------------
def _rescan(tokens: list[int], n_min: int, n_max: int, length: int) -> list[int]:
    """The proposal by a full rescan: the latest earlier occurrence of the longest suffix."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                out: list[int] = []
                for position in range(end, end + length):
                    out.append(tokens[position] if position < len(tokens) else out[position - len(tokens)])
                return out
    return []


def test_ngram_proposals_prefer_the_longest_then_the_latest_match():
    index = NgramIndex(n_min=1, n_max=3)
    prompt = [1, 2, 3, 4, 9, 2, 3, 5, 7, 8, 3]
    index.extend(prompt, [])
    # suffix (8, 3) and (7, 8, 3) never occurred; 3 occurred last at position 6, followed by 5 7 8 3
    assert index.propose(4) == [5, 7, 8, 3]
    index.extend(prompt, [4, 9, 2])  # suffix (4, 9, 2) occurred at 3..5: what followed is 3 5 7 ...
    assert index.propose(3) == [3, 5, 7]
    index.extend(prompt, [4, 9, 2, 6])  # nothing ends in 6 before
    assert index.propose(3) == []


def test_ngram_continuation_of_a_recent_match_repeats_itself():
    index = NgramIndex(n_min=2, n_max=2)
    index.extend([5, 6, 5, 6], [])  # (5, 6) ended at 2: continuation 5 6 then the proposal itself
    assert index.propose(5) == [5, 6, 5, 6, 5]


def test_ngram_index_kept_incrementally_equals_a_rescan():
    rng = random.Random(1)
    for trial in range(20):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 40))]
        generated: list[int] = []
        index = NgramIndex(n_min, n_max)
        for _ in range(40):
            index.extend(prompt, generated)
            length = rng.randint(1, 8)
            assert index.propose(length) == _rescan(prompt + generated, n_min, n_max, length), trial
            generated += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


# ---- the draft length ---------------------------------------------------------------------------
def test_the_pacer_grows_on_acceptance_and_backs_off_on_rejection():
    pacer = DraftPacer(draft_max=16, draft_min=0)
    assert pacer.next_length(100) == FIRST_DRAFT
    assert pacer.next_length(2) == 2  # the budget left caps it
    pacer.update(drafted=FIRST_DRAFT, accepted=FIRST_DRAFT)
    assert pacer.next_length(100) == 2 * FIRST_DRAFT
    pacer.update(drafted=8, accepted=8)
    pacer.update(drafted=16, accepted=16)
    assert pacer.next_length(100) == 16  # draft_max
    pacer.update(drafted=16, accepted=5)
    assert pacer.next_length(100) == 6  # one more than the accepted part
    pauses = []
    for _ in range(7):  # rejected at the first token, again and again: pauses double up to MAX_PAUSE
        pacer.update(drafted=1, accepted=0)
        steps = 0
        while pacer.next_length(100) == 0:
            steps += 1
        pauses.append(steps)
    assert pauses == [1, 2, 4, 8, 16, 16, 16] and MAX_PAUSE == 16
    pacer.update(drafted=1, accepted=1)  # an acceptance ends the streak
    pacer.update(drafted=2, accepted=0)
    steps = 0
    while pacer.next_length(100) == 0:
        steps += 1
    assert steps == 1
    floor = DraftPacer(draft_max=8, draft_min=3)
    floor.update(drafted=4, accepted=1)
    assert floor.next_length(100) == 3 and floor.next_length(2) == 0  # shorter than --draft-min: none


def test_speculative_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="--spec must be one of"):
        SpeculativeConfig(spec="eagle")
    with pytest.raises(ConfigError, match="--spec draft needs --model-draft"):
        SpeculativeConfig(spec="draft")
    with pytest.raises(ConfigError, match="--spec-ngram-min"):
        SpeculativeConfig(spec="ngram", spec_ngram_min=4, spec_ngram_max=2)
    with pytest.raises(ConfigError, match="--draft-min"):
        SpeculativeConfig(spec="ngram", draft_max=4, draft_min=5)
    with pytest.raises(ConfigError, match="-ngld"):
        SpeculativeConfig(spec="ngram", n_gpu_layers_draft=2)
    assert SpeculativeConfig(model_draft="x.gguf").method == "draft"  # -md alone turns it on


# ---- the verifier ---------------------------------------------------------------------------------
def _logits(*rows: list[float], vocab: int = 8) -> torch.Tensor:
    """Rows of logits over ``vocab`` tokens: the given values, -inf beyond."""
    out = torch.full((len(rows), vocab), float("-inf"))
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row)
    return out


def test_greedy_verdict_keeps_the_argmax():
    logits = _logits([0, 5, 1], [3, 0, 1], [0, 0, 9], [2, 1, 0])
    sampler = Sampler(SamplingParams(temperature=0))
    assert verify_draft(logits, [1, 0, 2], sampler).tokens == [1, 0, 2, 0]  # all accepted, one more
    verdict = verify_draft(logits, [1, 2, 2], sampler)
    assert (verdict.tokens, verdict.accepted) == ([1, 0], 1)  # the second is replaced by the argmax
    assert verify_draft(logits, [2, 0, 2], sampler).tokens == [1]


def _distribution_of_verdicts(logits: torch.Tensor, draft: list[int], params: SamplingParams, draws: int,
                              seed: int, prompt: list[int] = ()) -> dict:
    counts: dict = {}
    for i in range(draws):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed + i}), prompt)
        tokens = tuple(verify_draft(logits, draft, sampler).tokens[:len(draft) + 1])
        counts[tokens[:2]] = counts.get(tokens[:2], 0) + 1
    return counts


def _reference_draws(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int,
                     prompt: list[int] = ()) -> dict:
    """The first two tokens drawn one at a time from the same rows, as plain decoding draws them
    when the first token is the draft's (row 1 only follows draft token 0; otherwise row 1's
    logits would differ, and the pair ends at the first token)."""
    counts: dict = {}
    for i in range(draws):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed + i}), prompt)
        first = sampler(logits[0])
        pair = (first,)
        if first == DRAFT[0]:
            sampler.record([first])
            pair = (first, sampler(logits[1]))
        counts[pair] = counts.get(pair, 0) + 1
    return counts


DRAFT = [2, 5]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3),  # position by position
], ids=["plain", "filters", "penalties"])
def test_accept_reject_keeps_the_target_distribution(params):
    """The first two tokens of a verdict (the drafted token accepted or replaced, then the next)
    have the distribution of drawing them one at a time: a chi-square test at a fixed seed."""
    logits = _logits([0.0, 0.4, 1.1, 0.2, -0.5, 0.9], [0.3, -1.0, 0.8, 0.0, 0.5, 1.2], [1, 1, 1, 1, 1, 1])
    # draft token 2 has probability ~0.3 at plain temperature: accepted and rejected both often
    draws = 4000
    got = _distribution_of_verdicts(logits, DRAFT, params, draws, seed=0, prompt=[5])
    expected = _reference_draws(logits, params, draws, seed=10**6, prompt=[5])
    accepted = sum(n for pair, n in got.items() if pair[0] == DRAFT[0])
    assert 0.1 * draws < accepted < 0.9 * draws  # both branches of the rule ran often
    p_value, dof = chi_square_p_value(got, expected)
    assert dof >= 5 and p_value > SIGNIFICANCE, (got, expected)


def test_the_accept_reject_test_would_see_a_biased_rule():
    """The same test catches a wrong rule: always accepting a drafted token with nonzero probability."""
    logits = _logits([0.0, 0.4, 1.1, 0.2, -0.5, 0.9], [0.3, -1.0, 0.8, 0.0, 0.5, 1.2])
    params = SamplingParams(temperature=1.0)
    biased = {(DRAFT[0], t): 0 for t in range(6)}
    generator = torch.Generator().manual_seed(0)
    probs = probabilities(logits[1:2], params)[0]
    for _ in range(4000):
        biased[(DRAFT[0], int(torch.multinomial(probs, 1, generator=generator)))] += 1
    expected = _reference_draws(logits, params, 4000, seed=10**6)
    assert chi_square_p_value(biased, expected)[0] < SIGNIFICANCE


def test_a_verdict_changes_no_state():
    """Penalty counts and the grammar advance over accepted drafted tokens while the later
    positions are processed, and are taken back: appending the verdict's tokens records them."""
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0)
    sampler = Sampler(params, [1])
    before = [t.clone() for t in sampler.token_counts(8)]
    logits = _logits([0, 1, 9, 0], [0, 0, 0, 9], [9, 0, 0, 0])
    verdict = verify_draft(logits, [2, 3], sampler)
    assert verdict.tokens == [2, 3, 0]
    assert all(torch.equal(a, b) for a, b in zip(before, sampler.token_counts(8)))


# ---- the request loop on a tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def spec_llm(tiny):
    return LLM(str(tiny[1]), spec="ngram", spec_ngram_min=1, spec_max_batch=0, threads=2, prefill_chunk=32)


@pytest.fixture(scope="module")
def looping(spec_llm) -> list[int]:
    """A prompt whose greedy continuation repeats earlier n-grams (proposals get accepted)."""
    return repetitive_prompt(spec_llm)


def _both(llm: LLM, prompt, params: SamplingParams):
    plain = llm.generate(prompt, SamplingParams(**{**params.__dict__, "speculative": False}))
    spec = llm.generate(prompt, params)
    return plain, spec


@NEEDS_COMPILER
def test_greedy_text_and_logprobs_equal_plain_decoding_and_drafts_are_accepted(spec_llm, looping):
    prompt = looping
    plain, spec = _both(spec_llm, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3))
    assert spec.token_ids == plain.token_ids
    assert spec.logprobs == plain.logprobs  # the accepted tokens' log-probabilities are plain decoding's, bitwise
    m = spec.metrics
    assert m["spec_method"] == "ngram" and m["spec_accepted_tokens"] > 0
    assert m["spec_draft_tokens"] >= m["spec_accepted_tokens"]
    assert m["spec_acceptance_rate"] == m["spec_accepted_tokens"] / m["spec_draft_tokens"]
    assert plain.metrics["spec_method"] == "none" and plain.metrics["spec_drafts"] == 0
    assert m["generated_tokens"] == 40


@NEEDS_COMPILER
def test_a_step_of_more_decoding_sequences_than_spec_max_batch_drafts_nothing(tiny, looping):
    """--spec-max-batch 2: three sequences decoding together (same length, EOS ignored) never
    draft; two do; the text is the same either way."""
    llm = LLM(str(tiny[1]), spec="ngram", spec_ngram_min=1, spec_max_batch=2, threads=2, prefill_chunk=32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    three = llm.engine.generate_batch([looping] * 3, [params] * 3)
    two = llm.engine.generate_batch([looping] * 2, [params] * 2)
    assert [out.metrics["spec_drafts"] for out in three] == [0, 0, 0]
    assert all(out.metrics["spec_drafts"] > 0 and out.metrics["spec_accepted_tokens"] > 0 for out in two)
    assert {tuple(out.token_ids) for out in three + two} == {tuple(three[0].token_ids)}
    with pytest.raises(ConfigError, match="--spec-max-batch"):
        SpeculativeConfig(spec="ngram", spec_max_batch=-1)


@NEEDS_COMPILER
def test_rows_of_different_lengths_are_verified_in_one_step(spec_llm, looping, tiny, monkeypatch):
    from hybridllm.engine.executor import Executor

    lengths_seen: list[list[int]] = []
    execute = Executor.execute

    def recording(self, plan):
        lengths_seen.append(sorted(len(row.token_ids) for row in plan.rows if not row.is_prompt))
        return execute(self, plan)

    monkeypatch.setattr(Executor, "execute", recording)
    base = looping
    prompts = [base[i:] for i in range(0, 16, 2)]  # eight sequences at different points of the loop
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(prompts)
    spec = spec_llm.engine.generate_batch(prompts, params)
    plain = spec_llm.engine.generate_batch(prompts, [SamplingParams(**{**p.__dict__, "speculative": False})
                                                     for p in params])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    mixed = [lengths for lengths in lengths_seen if len(set(lengths)) > 1 and max(lengths) > 1]
    assert mixed, "no step verified rows of different lengths together"


@NEEDS_COMPILER
def test_the_rejected_kv_is_rolled_back(spec_llm, looping):
    """After every step a sequence's cache holds exactly its tokens but the pending one."""
    from hybridllm.engine.scheduler import Scheduler

    scheduler = Scheduler(spec_llm.runtime)
    prompt = looping[:-3] + [7, 8, 9]  # the loop broken: some proposals rejected
    seq = scheduler.submit("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), lambda e: None)
    while seq.finish_reason is None:
        scheduler.step()
        if seq.finish_reason is None and seq.pending:
            assert seq.cache.seq_length == len(prompt) + len(seq.generated) - len(seq.pending)
    stats = seq.speculation.stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens  # some accepted, some rejected


@NEEDS_COMPILER
@pytest.mark.parametrize("case", ["budget", "stop string", "penalties", "bias"])
def test_stop_rules_penalties_and_bias_as_plain_decoding(spec_llm, looping, case):
    prompt = looping
    reference = spec_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                         speculative=False))
    text = reference.text
    cut = next(k for k in range(len(text) // 3, len(text) - 4)  # a stop string first seen in the middle
               if text[k:k + 4].strip() == text[k:k + 4] and text.find(text[k:k + 4]) == k)
    params = {
        "budget": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        "stop string": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[text[cut:cut + 4]]),
        "penalties": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                                    frequency_penalty=0.3),
        "bias": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                               logit_bias={reference.token_ids[5]: -3.0}),
    }[case]
    plain, spec = _both(spec_llm, prompt, params)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    assert len(spec.token_ids) <= params.max_tokens
    if case == "budget":
        assert len(spec.token_ids) == 7 and spec.finish_reason == "length"
    if case == "stop string":
        assert spec.finish_reason == "stop" and spec.text == text[:cut]
    assert spec.metrics["spec_drafts"] > 0


@NEEDS_COMPILER
def test_grammar_constrained_output_as_plain_decoding(spec_llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}
    prompt = spec_llm.tokenizer.encode('{"a": 1, "b": "xy"} {"a": 1, "b": "xy"} {"a": 1,', add_special_tokens=False)
    params = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput(schema))
    plain, spec = _both(spec_llm, prompt, params)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert spec.metrics["spec_drafts"] > 0
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=StructuredOutput(schema))
    import json

    for seed in range(4):  # sampled constrained text is still valid JSON of the schema
        out = spec_llm.generate(prompt, SamplingParams(**{**sampled.__dict__, "seed": seed}))
        if out.finish_reason == "stop":
            value = json.loads(out.text)
            assert set(value) == {"a", "b"}


def _sampled_runs(llm: LLM, prompt: list[int], draws: int, **params) -> tuple[dict[bool, dict], dict[str, int]]:
    """Counts of the generated token tuples without and with speculation (requests of n = 16
    sequences sharing the prompt, each its own seed), and the speculation figures."""
    counts: dict[bool, dict] = {False: {}, True: {}}
    stats = {"drafts": 0, "accepted": 0, "drafted": 0}
    for speculative in (False, True):
        for request in range(draws // 16):
            seed = 16 * request + (10**6 if speculative else 0)
            for result in llm.engine.generate_all(prompt, SamplingParams(n=16, seed=seed, speculative=speculative,
                                                                         ignore_eos=True, **params)):
                key = tuple(result.token_ids)
                counts[speculative][key] = counts[speculative].get(key, 0) + 1
                stats["drafts"] += result.metrics["spec_drafts"]
                stats["accepted"] += result.metrics["spec_accepted_tokens"]
                stats["drafted"] += result.metrics["spec_draft_tokens"]
    return counts, stats


@NEEDS_COMPILER
def test_sampled_tokens_keep_the_distribution_end_to_end(spec_llm, looping):
    """Four sampled tokens after a prompt that loops, many times with and without speculation:
    the joint distribution of the tokens is the same (chi-square at a fixed seed); proposals were
    accepted and rejected."""
    prompt = looping
    draws = 1280
    counts, stats = _sampled_runs(spec_llm, prompt, draws, max_tokens=4, temperature=0.8, top_k=3)
    assert stats["accepted"] > draws // 10 and stats["drafted"] - stats["accepted"] > draws // 20, stats
    p_value, dof = chi_square_p_value(counts[False], counts[True])
    assert dof >= 4 and p_value > SIGNIFICANCE


# ---- a draft model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory, tiny):
    """A draft for the tiny llama: the same weights with noise (same tokenizer), so that its
    proposals are accepted often but not always."""
    folder = tmp_path_factory.mktemp("draft") / "llama"
    model = build_hf_model(folder, "llama", seed=0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder, safe_serialization=True)
    return tiny[0], folder


@NEEDS_COMPILER
@pytest.mark.parametrize("config", list(EVERY_KV_AND_HOST_DECODE))
def test_a_draft_model_gives_the_plain_greedy_text(draft_pair, looping, config):
    """16 prompts decoded together with a random-weight draft of the same vocabulary, under every KV
    strategy and with decode on the host: the greedy texts are plain decoding's, and the rejected
    proposals' KV is rolled back in the target's cache and the draft's."""
    target, draft = draft_pair
    llm = LLM(str(target), model_draft=str(draft), draft_max=6, spec_max_batch=0, threads=2, **EVERY_KV_AND_HOST_DECODE[config])
    assert llm.speculative.method == "draft" and llm.runtime.draft is not None
    assert llm.cold_start.draft_s > 0
    prompts = [looping[i:] for i in range(0, 24, 3)] + [[11 + 7 * k + i for i in range(5)] for k in range(4)] + [
        list(range(30 + 5 * k, 60 + 5 * k)) for k in range(4)]
    assert len(prompts) == 16
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    spec = llm.engine.generate_batch(prompts, [params] * 16)
    plain = llm.engine.generate_batch(prompts, [SamplingParams(**{**params.__dict__, "speculative": False})] * 16)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    accepted = sum(r.metrics["spec_accepted_tokens"] for r in spec)
    drafted = sum(r.metrics["spec_draft_tokens"] for r in spec)
    assert 0 < accepted < drafted  # accepted often, rejected sometimes: both roll back the draft's KV
    assert all(r.metrics["spec_method"] == "draft" for r in spec)
    if config == "decode on host":
        assert all(r.metrics["decode_on"] == "host" for r in spec)


@NEEDS_COMPILER
def test_a_draft_model_keeps_the_sampled_distribution(tiny):
    """The target as its own draft: its argmax proposed, accepted with its probability."""
    llm = LLM(str(tiny[0]), model_draft=str(tiny[0]), draft_max=3, spec_max_batch=0, threads=2)
    draws = 640
    counts, stats = _sampled_runs(llm, [11, 12, 13, 14, 15], draws, max_tokens=4, temperature=1.0, top_k=3)
    assert stats["accepted"] > draws // 4 and stats["drafted"] - stats["accepted"] > draws // 10, stats
    p_value, dof = chi_square_p_value(counts[False], counts[True])
    assert dof >= 4 and p_value > SIGNIFICANCE


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(tmp_path, tiny):
    other = tmp_path / "other"
    build_hf_model(other, "llama", tokenizer_style="qwen2")
    with pytest.raises(ConfigError, match="same vocabulary") as caught:
        LLM(str(tiny[0]), model_draft=str(other), threads=1)
    assert "\n" not in str(caught.value)


@NEEDS_COMPILER
def test_decode_rows_join_a_verification_row_in_one_native_call(spec_llm, looping, monkeypatch):
    """A step with a verification row runs the other sequences' one-token rows in the same
    all-logits ``hl_prefill_model`` call (the weights read once), with the bits of a decode step."""
    from hybridllm.kernels.native import NativeModel
    from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow

    runner = spec_llm.runtime.runner
    calls: list[str] = []
    for name in ("decode", "prefill_chunks"):
        original = getattr(NativeModel, name)
        monkeypatch.setattr(NativeModel, name, lambda self, *a, _f=original, _n=name, **k: (calls.append(_n),
                                                                                            _f(self, *a, **k))[1])

    def filled(prompt: list[int]):
        cache = spec_llm.runtime.new_cache()
        runner.step(ForwardBatch([ForwardRow(cache, prompt, 0)]))
        return cache

    prompts = [looping[:20], looping[:33], looping[:41]]
    with torch.inference_mode():
        alone = [runner.step(ForwardBatch([ForwardRow(c, [7], c.seq_length)]))[0] for c in map(filled, prompts)]
        verify_alone = runner.step(ForwardBatch([ForwardRow(c, [7, 8, 9], c.seq_length, True)
                                                 for c in [filled(prompts[0])]]))[0]
        caches = [filled(p) for p in prompts]
        calls.clear()
        together = runner.step(ForwardBatch([ForwardRow(caches[0], [7, 8, 9], caches[0].seq_length, True),
                                             *[ForwardRow(c, [7], c.seq_length) for c in caches[1:]]]))
    assert calls == ["prefill_chunks"]  # one call for the verification row and the decode rows
    assert torch.equal(together[0], verify_alone)
    assert all(torch.equal(a, b) for a, b in zip(together[1:], alone[1:]))


@pytest.mark.parametrize("backend", ["eager", "cuda-graph"])
def test_pytorch_backends_verify_within_rounding_and_roll_back_their_caches(tiny, looping, backend):
    """On the PyTorch paths (the eager walk; the cuda-graph backend's static slot caches, run
    eagerly on the CPU) a verification forward is within float rounding of one-token steps: the
    greedy text is plain decoding's up to a near-tie, and the caches roll back (static rows too)."""
    llm = LLM(str(tiny[1]), spec="ngram", spec_ngram_min=1, spec_max_batch=0, threads=2, decode_backend=backend, device="cpu")
    prompt = looping
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    plain, spec = _both(llm, prompt, params)
    assert spec.metrics["spec_accepted_tokens"] > 0
    same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b), None)
    if same is not None:  # only where the two best tokens were tied to rounding
        first, second = plain.logprobs[same].top[:2]
        assert abs(first[1] - second[1]) < 1e-4, (same, plain.logprobs[same])
