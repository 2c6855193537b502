"""Sampling fields of the OpenAI API, end to end with the official ``openai`` client against an
in-process server: log-probabilities (chat and the legacy completions shape, echo included),
``n`` choices, penalties, ``logit_bias``, ``repeat_penalty``; and the engine behind them
(``LLM.generate_all``, prompt log-probabilities across prefill chunks, forks of any KV cache).

Every log-probability must equal the engine's own float32 log-softmax of the logits at the
position that chose the token, computed here with ``llm.runner(..., all_logits=True)``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import OPENAI_MISSING, import_extra
import torch
from test_server import InProcessServer

from hybridllm import LLM, SamplingParams
from hybridllm.server.app import create_app

openai = import_extra("openai", OPENAI_MISSING)

TOL = 1e-4  # batched decode rows and a one-shot forward differ by float32 rounding only


@pytest.fixture(scope="module")
def tiny_llm(tiny_models) -> LLM:
    return LLM(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def served(tiny_llm):
    """(the LLM, an openai client, the model id) of an in-process server on the tiny model."""
    with InProcessServer(create_app(tiny_llm)) as srv:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield tiny_llm, client, client.models.list().data[0].id, srv.base


def reference_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log-softmax of the logits at every position of ``ids`` (row i predicts ids[i + 1])."""
    with torch.inference_mode():
        logits = llm.runner(torch.tensor([ids]), llm.new_cache(), start_pos=0, all_logits=True)[0]  # (T, vocab)
    return torch.log_softmax(logits.float(), dim=-1)


def token_text(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


def token_bytes(llm: LLM, token_id: int) -> list[int]:
    """OpenAI's ``bytes`` of a token: its text's UTF-8, or its raw bytes when it is not whole UTF-8 alone."""
    text = token_text(llm, token_id)
    if "\ufffd" not in text:
        return list(text.encode())
    return list(llm.engine.scheduler.grammars.ll_tokenizer().decode_bytes([token_id]))


def eos_id(llm: LLM) -> int:
    return min(llm.tokenizer.eos_token_ids)


# ---- chat ----------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_engine_log_softmax(served):
    llm, client, model, _ = served
    messages = [{"role": "user", "content": "The quick brown fox"}]
    prompt = llm.encode_prompt(messages)
    generated = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids
    reference = reference_logprobs(llm, prompt + generated)[len(prompt) - 1:]  # rows choosing each generated token
    kw = dict(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kw)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(generated)
    for position, (entry, token_id) in enumerate(zip(content, generated)):
        assert entry.token == token_text(llm, token_id)
        assert entry.bytes == token_bytes(llm, token_id)
        assert entry.logprob == pytest.approx(float(reference[position, token_id]), abs=TOL)
        top_values, top_ids = torch.topk(reference[position], 3)
        assert [t.token for t in entry.top_logprobs] == [token_text(llm, int(t)) for t in top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the chosen is the top
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    without = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert without.choices[0].logprobs is None


# ---- legacy completions: echo and log-probabilities ------------------------------------------------
@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_of_a_token_id_prompt_ending_in_eos(served, max_tokens, stream):
    llm, client, model, _ = served
    prompt = [5, 40, 77, 130, 9]
    eos = eos_id(llm)
    reference = reference_logprobs(llm, prompt + [eos])
    # logit_bias forces the end-of-sequence token; log-probabilities are taken before the bias
    kw = dict(model=model, prompt=[prompt], max_tokens=max_tokens, echo=True, logprobs=2, temperature=0,
              logit_bias={str(eos): 100})
    if stream:
        text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(**kw, stream=True):
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                for key in logprobs:
                    logprobs[key] += getattr(choice.logprobs, key)
            finish = choice.finish_reason or None
    else:
        reply = client.completions.create(**kw)
        choice = reply.choices[0]
        text, logprobs, finish = choice.text, choice.logprobs.model_dump(), choice.finish_reason
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == max_tokens
    positions = prompt + [eos] * max_tokens
    assert len(logprobs["tokens"]) == len(prompt) + max_tokens  # prompt length + 1 with a generated token
    assert logprobs["tokens"] == [token_text(llm, t) for t in positions]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing prepended
    for i in range(1, len(positions)):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(reference[i - 1, positions[i]]), abs=TOL)
        top = logprobs["top_logprobs"][i]
        best = max(top, key=top.get)
        assert best == token_text(llm, int(reference[i - 1].argmax()))
    assert text == llm.tokenizer.decode(prompt)  # the end-of-sequence token adds no text
    assert logprobs["text_offset"][0] == 0
    assert finish == ("stop" if max_tokens else "length")


def test_logprobs_without_echo_cover_the_completion_only(served):
    llm, client, model, _ = served
    prompt_text = "Paris is the capital of"
    prompt = llm.tokenizer.encode(prompt_text, add_special_tokens=True)  # the model's own BOS rule
    reply = client.completions.create(model=model, prompt=prompt_text, max_tokens=4, logprobs=0, temperature=0,
                                      extra_body={"ignore_eos": True})
    generated = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).token_ids
    reference = reference_logprobs(llm, prompt + generated)[len(prompt) - 1:]
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [token_text(llm, t) for t in generated]
    assert logprobs.token_logprobs == pytest.approx([float(reference[i, t]) for i, t in enumerate(generated)], abs=TOL)
    assert logprobs.top_logprobs == [{}] * 4  # logprobs=0: no alternatives
    assert logprobs.text_offset[0] == 0
    echoed = client.completions.create(model=model, prompt=prompt_text, max_tokens=4, echo=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt_text + reply.choices[0].text
    assert echoed.choices[0].logprobs is None


# ---- n choices -------------------------------------------------------------------------------------
def test_n_choices_use_distinct_seeds_and_count_the_prompt_once(served):
    llm, client, model, _ = served
    kw = dict(model=model, prompt="The quick brown", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    reply = client.completions.create(**kw, n=3, seed=11)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1
    for i, text in enumerate(texts):  # choice i is the single request with seed + i
        assert client.completions.create(**kw, seed=11 + i).choices[0].text == text
    prompt_tokens = len(llm.tokenizer.encode("The quick brown"))
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 3 * 8
    streamed = {i: "" for i in range(3)}
    usage = None
    for chunk in client.completions.create(**kw, n=3, seed=11, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts
    assert usage.completion_tokens == 24 and usage.prompt_tokens == prompt_tokens
    greedy = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3,
                                            max_tokens=8, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 3


@pytest.mark.parametrize("kv_cache", ["dynamic", "quantized", "tiered"])
def test_forked_sequences_continue_on_copies_of_the_prompt_kv(tiny_models, kv_cache):
    llm = LLM(tiny_models["llama"][0], kv_cache=kv_cache, kv_hot_window=8, kv_page_size=4, prefill_chunk=4)
    prompt = llm.encode_prompt("The quick brown fox jumps over")
    single = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    results = llm.generate_all(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3))
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.token_ids == single.token_ids for r in results)
    assert llm.engine.scheduler.ledger.current("device") == 0 and llm.engine.scheduler.reserved_bytes == 0


def test_prompt_logprobs_span_prefill_chunks(tiny_models):
    llm = LLM(tiny_models["llama"][0], prefill_chunk=3)
    prompt = llm.encode_prompt("Hybrid inference splits layers between the CPU")
    assert len(prompt) > 6
    result = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, logprobs=1,
                                                 ignore_eos=True))
    reference = reference_logprobs(llm, prompt + result.token_ids)
    ids = prompt + result.token_ids
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    got = [e.logprob for e in result.prompt_logprobs[1:]] + [e.logprob for e in result.logprobs]
    assert got == pytest.approx([float(reference[i - 1, ids[i]]) for i in range(1, len(ids))], abs=TOL)


# ---- penalties and bias ---------------------------------------------------------------------------
def test_penalties_through_the_server_equal_the_engine(served):
    llm, client, model, _ = served
    prompt_text = "The quick brown fox jumps over the lazy dog. The quick"
    prompt = llm.tokenizer.encode(prompt_text)
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt, base).token_ids
    for fields, params in [
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
        ({"extra_body": {"repeat_penalty": 1.5, "ignore_eos": True}}, {"repetition_penalty": 1.5}),
    ]:
        extra = fields.pop("extra_body", {"ignore_eos": True})
        reply = client.completions.create(model=model, prompt=prompt_text, max_tokens=24, temperature=0,
                                          extra_body=extra, **fields)
        expected = llm.generate(prompt, SamplingParams(**{**vars(base), **params}))
        assert reply.choices[0].text == expected.text
        if len(set(plain)) < len(plain):  # the plain output repeats a token: a penalty changes it
            assert expected.token_ids != plain
    biased = client.completions.create(model=model, prompt=prompt_text, max_tokens=5, temperature=0,
                                       logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == token_text(llm, 65) * 5


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"3": 150}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1000000": 1}}, "logit_bias"),
    ("/v1/completions", {"repeat_penalty": 1.1, "repetition_penalty": 1.3}, "repeat_penalty"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 1000}, "n"),  # more than the batch
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_sampling_fields_are_refused_naming_the_field(served, path, body, param):
    _, _, model, base = served
    request = {"model": model, "max_tokens": 2, **body}
    request.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    reply = httpx.post(f"{base}{path}", json=request, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_repeat_penalty_equal_to_repetition_penalty_is_accepted(served):
    _, _, model, base = served
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "repeat_penalty": 1.2, "repetition_penalty": 1.2}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200


# ---- the default model -----------------------------------------------------------------------------
@pytest.mark.slow
def test_lm_eval_style_request_on_the_default_model(default_llm):
    """lm-eval's local-completions request: ``[[ids]]``, echo, logprobs 1, max_tokens 1."""
    prompt = default_llm.encode_prompt("The capital of France is Paris")
    with InProcessServer(create_app(default_llm)) as srv:
        body = {"model": "x", "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        body["model"] = httpx.get(f"{srv.base}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
    reference = reference_logprobs(default_llm, prompt)
    got = logprobs["token_logprobs"][1:len(prompt)]
    assert got == pytest.approx([float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-3)
    assert json.loads(json.dumps(logprobs)) == logprobs  # plain JSON numbers (no inf / nan)
