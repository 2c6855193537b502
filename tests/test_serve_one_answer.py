"""One answer per prompt through ``serve`` (issue 33): with the default settings (the prefix cache
on), 16 greedy chat prompts get the same text asked one at a time, asked all at once, and asked
again after a restart that finds their pages in ``--prefix-cache-disk``; and that text is the one
the engine gives each prompt alone with no prefix cache at all.

The prompts share a long system message, so after the first ask every prompt restores whole pages
from the prefix cache and prefills only its remainder (checked through /metrics: the cases really
differ)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_helpers import CHAT_PROMPTS
from test_server import metrics, openai, serve_process

from hybridllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # servers in their own processes

SYSTEM = ("You are a careful assistant for a public library. Answer in plain words, keep each answer "
          "short, say when you are not sure, never invent a source, and prefer facts a reader can "
          "check in a good encyclopedia. Use metric units and spell out abbreviations the first time.")
PROMPTS = CHAT_PROMPTS + [
    "Why is the sky blue?",
    "Give two uses of copper.",
    "What does a librarian do?",
    "How many legs does a spider have?",
    "Describe a rainy day in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a cat.",
    "What is a prime number?",
]
MAX_TOKENS = 24
HITS = "hybridllm:prefix_cache_hits_total"


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def _ask(client: openai.OpenAI, model_id: str, prompt: str) -> str:
    out = client.chat.completions.create(model=model_id, messages=_messages(prompt), temperature=0,
                                         max_tokens=MAX_TOKENS)
    return out.choices[0].message.content


def _ask_all_at_once(client: openai.OpenAI, model_id: str) -> list[str]:
    barrier = threading.Barrier(len(PROMPTS))

    def one(prompt: str) -> str:
        barrier.wait()
        return _ask(client, model_id, prompt)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _client(base: str) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id


def test_sixteen_prompts_alone_concurrently_and_after_a_restart_give_the_uncached_text(tmp_path):
    assert len(set(PROMPTS)) == 16
    llm = LLM(device="cpu")  # the served settings, no prefix cache: each prompt prefilled whole
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [llm.generate(_messages(prompt), params).text for prompt in PROMPTS]
    assert len(set(expected)) > 8  # the prompts really get different answers
    disk = tmp_path / "pages"
    with serve_process("--prefix-cache-disk", str(disk)) as (base, _):
        client, model_id = _client(base)
        alone = [_ask(client, model_id, prompt) for prompt in PROMPTS]
        hits_alone = metrics(base)[HITS]
        together = _ask_all_at_once(client, model_id)
        hits_together = metrics(base)[HITS] - hits_alone
    assert hits_alone > 0 and hits_together > 0  # the shared system message's pages were reused
    assert alone == expected
    assert together == expected
    assert any(disk.iterdir())
    with serve_process("--prefix-cache-disk", str(disk)) as (base, _):
        client, model_id = _client(base)
        restarted = _ask_all_at_once(client, model_id)
        hits_restarted = metrics(base)[HITS]
    assert hits_restarted > 0  # the pages came from the disk tier
    assert restarted == expected
