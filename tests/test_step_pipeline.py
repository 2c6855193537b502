"""The step as plan -> execute -> process: the scheduler's plan is data (rows of tokens per
sequence), the output processor appends several tokens at once under the stop rules, and the
sampling pipeline gives each row, in a batch of rows, the token it gets alone."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_hf_model

from hybridllm import LLM, SamplingParams
from hybridllm.engine.scheduler import Scheduler
from hybridllm.engine.sampling import Sampler, probabilities, sample_rows


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline") / "llama"
    build_hf_model(folder, "llama")
    return LLM(model=folder, prefill_chunk=16)


def _collect(events: dict, name: str):
    events[name] = []
    return events[name].append


def test_a_step_is_planned_as_rows_of_tokens(tiny_llm):
    sched = Scheduler(tiny_llm.runtime, max_batch=4)
    events: dict[str, list] = {}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    short = sched.submit("short", list(range(5, 15)), params, _collect(events, "short"))  # one chunk
    long = sched.submit("long", list(range(5, 45)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                    prompt_logprobs=1), _collect(events, "long"))
    sched.step()  # idle: both prompts' first chunks; the short one samples its first token
    assert short.pending == [short.generated[-1]] and long.prefilled == 16 and not long.pending
    plan = sched.schedule()
    decode, chunk = plan.rows
    assert decode.seq is short and decode.token_ids == short.pending and not decode.is_prompt
    assert chunk.seq is long and chunk.prompt_start == 16 and chunk.token_ids == list(range(21, 37))
    assert chunk.all_logits  # the prompt's log-probabilities need every position
    assert (plan.decode_rows, plan.prefill_tokens) == (1, 16)  # decoding: one chunk's worth of prompt
    sched.run_until_idle()
    for name, prompt in (("short", list(range(5, 15))), ("long", list(range(5, 45)))):
        assert events[name][-1].token_ids == tiny_llm.generate(prompt, params).token_ids
    assert len(events["long"][-1].prompt_logprobs) == 40


@pytest.mark.parametrize("case", ["eos", "budget", "stop string"])
def test_several_tokens_appended_at_once_stop_at_the_first_that_ends(tiny_llm, case):
    tokenizer = tiny_llm.tokenizer
    eos = sorted(tokenizer.eos_token_ids)[0]
    words = tokenizer.encode(" alpha beta gamma", add_special_tokens=False)
    stop = tokenizer.decode(words[1:3]).strip()  # spans two of the appended tokens
    params = {
        "eos": SamplingParams(max_tokens=20, temperature=0),
        "budget": SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        "stop string": SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True),
    }[case]
    sched = Scheduler(tiny_llm.runtime)
    events: dict[str, list] = {}
    seq = sched.submit("r", list(range(5, 15)), params, _collect(events, "r"))
    while not seq.generated:
        sched.step()
    first = seq.generated[0]
    if seq.finish_reason is not None:
        pytest.skip("the tiny model ended at its first token")
    appended = {"eos": [words[0], eos, words[1]], "budget": words, "stop string": words + [words[0]]}[case]
    if case == "stop string":  # the first of the appended tokens whose text completes the stop string
        expected_taken = next(j for j in range(1, len(appended) + 1)
                              if stop in tokenizer.decode([first, *appended[:j]]))
        assert stop not in tokenizer.decode([first]) and expected_taken > 1
    else:
        expected_taken = 2
    taken = sched.processor.append_tokens(seq, appended, torch.zeros(len(appended), tiny_llm.config.vocab_size))
    assert taken == expected_taken < len(appended)  # the token that ends the sequence is its last
    assert seq.generated == [first, *appended[:taken]]
    last = events["r"][-1]
    assert last.finish_reason == {"eos": "stop", "budget": "length", "stop string": "stop"}[case]
    assert last.token_ids == seq.generated
    if case == "stop string":
        assert stop not in last.full_text and "".join(e.text for e in events["r"]) == last.full_text
    assert sched.num_running == 0 and sched.ledger.current("device") == 0  # its KV freed
    assert len(seq.token_intervals) == taken  # the step's tokens share its interval
    assert sum(seq.token_intervals) > 0


def test_sampling_rows_together_gives_each_row_its_token_alone():
    """Rows with different parameters (greedy, filters, bias, penalties) sampled in one call draw
    what each draws alone from the same seed: no row's result depends on another."""
    vocab = 300
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, logit_bias={7: 5.0}),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=20, seed=4),  # the same filters as row 1: one group
    ]
    prompt = list(range(10, 40))

    def samplers():
        made = [Sampler(params, prompt) for params in rows]
        for sampler in made:
            sampler.record([11, 12, 12])
        return made

    for _ in range(3):
        together = sample_rows(logits.clone(), samplers())
        alone = [sample_rows(logits[i:i + 1].clone(), [sampler])[0] for i, sampler in enumerate(samplers())]
        assert together == alone
    assert together[0] == int(logits[0].argmax())


def test_penalty_counts_roll_back_with_the_tokens():
    params = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0)
    sampler = Sampler(params, [3, 4])
    before = [t.clone() for t in sampler.token_counts(10)]
    sampler.record([4, 5, 5])
    seen, generated = sampler.token_counts(10)
    assert seen.tolist() == [0, 0, 0, 1, 2, 2, 0, 0, 0, 0] and generated.tolist() == [0, 0, 0, 0, 1, 2, 0, 0, 0, 0]
    sampler.forget([5, 5])  # a rejected draft's tokens
    sampler.forget([4])
    assert all(torch.equal(a, b) for a, b in zip(before, sampler.token_counts(10)))


def test_probabilities_follow_the_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(probabilities(logits, SamplingParams(temperature=1.0)), logits.exp())


def test_the_scheduler_stays_bookkeeping():
    """The scheduler is plain bookkeeping (no torch, at most 300 lines); no engine module
    outgrows ~400 lines (a feature gets a module of its own)."""
    import ast
    from pathlib import Path

    import hybridllm.engine as engine

    folder = Path(engine.__file__).parent
    source = (folder / "scheduler.py").read_text()
    nodes = list(ast.walk(ast.parse(source)))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in imported
    assert len(source.splitlines()) <= 300
    sizes = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
