"""The prefix cache (issue 16): content-addressed KV pages reused across requests, in host RAM
and on disk. Reuse must not change answers (greedy ids equal a cold run, for every KV strategy
and for pages read back from disk); a bad disk tier (corrupt, truncated or foreign files, a full
budget, an unwritable directory) gives a warning and a correct answer."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from conftest import OPENAI_MISSING, import_extra
import torch
from test_server import InProcessServer, serve_process

from hybridllm import LLM, SamplingParams
from hybridllm.config import PrefixCacheConfig
from hybridllm.engine.scheduler import Scheduler
from hybridllm.errors import ConfigError
from hybridllm.kvcache.prefix_cache import PrefixCache
from hybridllm.kvcache.prefix_disk import DiskTier
from hybridllm.kvcache.prefix_hash import PAGE_TOKENS, page_hashes, salt
from hybridllm.kvcache.prefix_page import KVPage
from hybridllm.server.app import create_app

openai = import_extra("openai", OPENAI_MISSING)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 5 for i in range(150)]  # 4 whole pages and a partial one
# KV strategies, with knobs under which each stores the prompt its own way (quantized groups,
# cold 4-bit pages on the host) rather than in its full-precision window
STRATEGIES = {
    "dynamic": {},
    "host": {},
    "offloaded": {},
    "quantized": dict(kv_cache="quantized", kv_bits=4, kv_residual=0, prefill_chunk=16),
    "tiered": dict(kv_cache="tiered", kv_hot_window=16, kv_cold_bits=4, kv_page_size=16, prefill_chunk=16),
}


def options(strategy: str) -> dict:
    return {"kv_cache": strategy, **STRATEGIES[strategy]}


def page(value: float, layers: int = 2, tokens: int = PAGE_TOKENS) -> KVPage:
    shape = (layers, 1, 2, tokens, 4)  # (n_layers, B, Hkv, P, D)
    return KVPage(torch.full(shape, value), torch.full(shape, -value))


# ---- addresses -----------------------------------------------------------------------------------
def test_page_hashes_chain_over_whole_pages():
    root = salt("model", "format")
    ids = list(range(3 * PAGE_TOKENS + 5))
    hashes = page_hashes(ids, root)
    assert len(hashes) == 3  # the partial last page has no address
    changed = ids.copy()
    changed[PAGE_TOKENS + 1] += 1  # a token of page 1: pages 1 and 2 change, page 0 does not
    other = page_hashes(changed, root)
    assert other[0] == hashes[0] and other[1] != hashes[1] and other[2] != hashes[2]
    assert page_hashes(ids, salt("model", "another format"))[0] != hashes[0]
    assert page_hashes(ids[:PAGE_TOKENS], root) == hashes[:1]


# ---- tiers -------------------------------------------------------------------------------------------
def test_ram_lru_keeps_pages_on_disk_and_promotes_them_back(tmp_path):
    one = page(1.0).nbytes
    cache = PrefixCache(salt("m"), ram_budget=2 * one, disk_dir=tmp_path, disk_budget=10 * one)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for address, value in ((a, 1.0), (b, 2.0), (c, 3.0)):
        cache.insert(address, page(value))
    assert cache.bytes_per_tier()["host"] == 2 * one  # a, the least recently used, left RAM
    assert sorted(p.stem for p in tmp_path.glob("*.kvpage")) == sorted(x.hex() for x in (a, b, c))  # written through
    (tmp_path / f"{b.hex()}.kvpage").unlink()  # b is now in RAM only
    found = cache.lookup([a])  # read back from disk into RAM, pushing b (now the oldest) out
    assert len(found) == 1 and torch.equal(found[0].keys, page(1.0).keys)
    assert a in cache and c in cache
    assert len(cache.lookup([c, a])) == 2 and cache.lookup([b]) == []  # b was dropped from RAM and is gone


def test_ram_only_drops_the_least_recently_used():
    one = page(1.0).nbytes
    cache = PrefixCache(salt("m"), ram_budget=2 * one)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    cache.insert(a, page(1.0))
    cache.insert(b, page(2.0))
    cache.lookup([a])  # a is now the most recently used
    cache.insert(c, page(3.0))
    assert a in cache and c in cache and b not in cache
    assert cache.lookup([a, b, c]) and len(cache.lookup([a, b, c])) == 1  # the run stops at the missing page


def test_disk_survives_a_restart_and_checks_every_file(tmp_path, caplog):
    root = salt("model")
    disk = DiskTier(tmp_path, budget=1 << 20, root=root)
    addresses = [bytes([i]) * 16 for i in range(4)]
    for i, address in enumerate(addresses):
        assert disk.put(address, page(float(i)))
    path = {a: tmp_path / f"{a.hex()}.kvpage" for a in addresses}
    # corrupt one payload byte, truncate another, and overwrite a third with another model's page
    data = bytearray(path[addresses[0]].read_bytes())
    data[-3] ^= 0xFF
    path[addresses[0]].write_bytes(bytes(data))
    path[addresses[1]].write_bytes(path[addresses[1]].read_bytes()[:-10])
    DiskTier(tmp_path / "foreign", 1 << 20, salt("another model")).put(addresses[2], page(9.0))
    path[addresses[2]].write_bytes((tmp_path / "foreign" / path[addresses[2]].name).read_bytes())
    restarted = DiskTier(tmp_path, budget=1 << 20, root=root)
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        assert [restarted.get(a) for a in addresses[:3]] == [None, None, None]
        good = restarted.get(addresses[3])
    assert good is not None and torch.equal(good.values, page(3.0).values)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum mismatch" in messages and "truncated" in messages and "another model" in messages
    assert not any(path[a].exists() for a in addresses[:3])  # bad files are removed, never loaded


def test_disk_budget_keeps_the_newest_files_and_warns_once(tmp_path, caplog):
    blob = len(page(1.0).payload()) + 400  # a page file: payload and header
    disk = DiskTier(tmp_path, budget=2 * blob, root=salt("m"))
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        for i in range(3):
            assert disk.put(bytes([i]) * 16, page(float(i)))
        assert disk.nbytes <= 2 * blob and bytes([0]) * 16 not in disk and bytes([2]) * 16 in disk
        tiny = DiskTier(tmp_path / "tiny", budget=100, root=salt("m"))
        assert not tiny.put(b"x" * 16, page(1.0)) and not tiny.put(b"y" * 16, page(2.0))
    assert sum("larger than the disk budget" in r.getMessage() for r in caplog.records) == 1


def test_unwritable_directory_turns_the_disk_tier_off(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        disk = DiskTier(blocker / "pages", budget=1 << 20, root=salt("m"))
    assert not disk.enabled and "not writable" in caplog.text
    assert not disk.put(b"a" * 16, page(1.0)) and disk.get(b"a" * 16) is None


def test_config_parses_sizes_and_refuses_a_disk_size_alone():
    assert PrefixCacheConfig.parse("1MiB").ram == 1 << 20
    assert PrefixCacheConfig.parse("auto", total_ram=10 << 30).ram == 1 << 30
    assert not PrefixCacheConfig.parse("0").enabled and PrefixCacheConfig.parse("0", "/tmp/x").enabled
    with pytest.raises(ConfigError, match="needs --prefix-cache-disk"):
        PrefixCacheConfig.parse("0", None, "1GiB")
    with pytest.raises(ConfigError):
        PrefixCacheConfig.parse("lots")


# ---- reuse through the engine --------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_reused_prefix_gives_the_cold_answer(tiny_models, strategy):
    folder = tiny_models["llama"][0]
    cold = LLM(folder, **options(strategy)).generate(PROMPT, GREEDY)
    warm_llm = LLM(folder, prefix_cache_ram="64MiB", **options(strategy))
    first = warm_llm.generate(PROMPT[:100] + [9, 9, 9], GREEDY)  # shares 3 whole pages with PROMPT
    again = warm_llm.generate(PROMPT, GREEDY)
    assert first.metrics["cached_tokens"] == 0
    assert again.metrics["cached_tokens"] == 3 * PAGE_TOKENS
    assert again.token_ids == cold.token_ids
    repeat = warm_llm.generate(PROMPT, GREEDY)  # now every whole page of PROMPT is held
    assert repeat.metrics["cached_tokens"] == len(PROMPT) // PAGE_TOKENS * PAGE_TOKENS
    assert repeat.token_ids == cold.token_ids


def test_a_turn_reuses_the_previous_turns_reply(tiny_models):
    """A chat's next prompt resends the last reply: its pages were kept when the turn finished."""
    llm = LLM(tiny_models["llama"][0], prefix_cache_ram="64MiB")
    turn = llm.generate(PROMPT[:90], GREEDY)
    follow_up = PROMPT[:90] + turn.token_ids + [11, 12, 13]
    reused = llm.generate(follow_up, GREEDY)
    assert reused.metrics["cached_tokens"] == (90 + len(turn.token_ids) - 1) // PAGE_TOKENS * PAGE_TOKENS
    assert reused.token_ids == LLM(tiny_models["llama"][0]).generate(follow_up, GREEDY).token_ids


def test_prefix_restored_from_disk_by_a_new_engine(tiny_models, tmp_path, caplog):
    folder = tiny_models["llama"][0]
    cold = LLM(folder).generate(PROMPT, GREEDY)
    LLM(folder, prefix_cache_ram=0, prefix_cache_disk=tmp_path).generate(PROMPT, GREEDY)
    files = sorted(tmp_path.glob("*.kvpage"))
    assert len(files) == (len(PROMPT) + GREEDY.max_tokens - 1) // PAGE_TOKENS  # prompt and reply, kept at the end
    restarted = LLM(folder, prefix_cache_ram="64MiB", prefix_cache_disk=tmp_path)
    again = restarted.generate(PROMPT, GREEDY)
    assert again.metrics["cached_tokens"] == len(PROMPT) // PAGE_TOKENS * PAGE_TOKENS
    assert again.token_ids == cold.token_ids
    # a damaged second page: the first one is reused, the rest prefilled, the answer unchanged
    order = LLM(folder, prefix_cache_ram=0, prefix_cache_disk=tmp_path)
    second = tmp_path / f"{order.prefix_cache.addresses(PROMPT)[1].hex()}.kvpage"
    second.write_bytes(second.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        damaged = order.generate(PROMPT, GREEDY)
    assert "truncated" in caplog.text
    assert damaged.metrics["cached_tokens"] == PAGE_TOKENS and damaged.token_ids == cold.token_ids


def test_another_model_never_reuses_the_pages(tiny_models, tmp_path):
    LLM(tiny_models["llama"][0], prefix_cache_ram=0, prefix_cache_disk=tmp_path).generate(PROMPT, GREEDY)
    other = LLM(tiny_models["qwen2"][0], prefix_cache_ram=0, prefix_cache_disk=tmp_path)
    assert other.generate(PROMPT, GREEDY).metrics["cached_tokens"] == 0
    quantized = LLM(tiny_models["llama"][0], prefix_cache_ram=0, prefix_cache_disk=tmp_path, **options("quantized"))
    assert quantized.generate(PROMPT, GREEDY).metrics["cached_tokens"] == 0  # another KV format


def test_server_reports_cached_tokens_and_counts_hits(tiny_models):
    llm = LLM(tiny_models["llama"][0], prefix_cache_ram="64MiB")
    scheduler = Scheduler(llm.runtime, prefix_cache=llm.prefix_cache)
    with InProcessServer(create_app(llm, scheduler)) as srv:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        kw = dict(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        first = client.completions.create(**kw)
        second = client.completions.create(**kw)
        streamed = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        chat = dict(model=model, messages=[{"role": "user", "content": "hello " * 60}], max_tokens=4, temperature=0)
        client.chat.completions.create(**chat)
        chat_again = client.chat.completions.create(**chat)
        text = httpx.get(f"{srv.base}/metrics").text
    whole = len(PROMPT) // PAGE_TOKENS * PAGE_TOKENS
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == whole
    assert second.choices[0].text == first.choices[0].text
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == whole
    assert chat_again.usage.prompt_tokens_details.cached_tokens > 0

    def sample(name: str) -> float:
        return float(re.search(rf"^hybridllm:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))

    assert sample("prefix_cache_hits_total") == 2 * whole + chat_again.usage.prompt_tokens_details.cached_tokens
    assert sample("prefix_cache_queries_total") >= 3 * len(PROMPT)
    assert re.search(r'^hybridllm:prefix_cache_bytes\{[^}]*tier="host"[^}]*\} [1-9]', text, re.M)


def test_copy_cache_fills_every_strategy_in_its_own_format(tiny_models):
    """n > 1 choices copy the prompt's KV into each choice's cache (through extend)."""
    for strategy in STRATEGIES:
        llm = LLM(tiny_models["llama"][0], **options(strategy))
        results = llm.generate_all(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2))
        assert results[0].token_ids == results[1].token_ids, strategy


def test_multi_turn_preset_reports_reuse_per_turn(tiny_models, capsys):
    from hybridllm.bench.multi_turn import measure, print_document

    document = measure({"model": tiny_models["llama"][0]}, context=200, turns=3, new_tokens=4)
    assert [row["cached_tokens"] for row in document["cold"]] == [0, 0, 0]
    warm = document["prefix_cache"]
    assert warm[0]["cached_tokens"] == 0 and all(row["cached_tokens"] >= PAGE_TOKENS for row in warm[1:])
    assert all(row["cached_tokens"] < row["prompt_tokens"] for row in warm)
    assert document["restart"]["cached_tokens"] == (warm[0]["prompt_tokens"] - 1) // PAGE_TOKENS * PAGE_TOKENS
    print_document(document)
    assert "restart from disk" in capsys.readouterr().out


@pytest.mark.slow
def test_a_restarted_server_answers_from_its_disk_tier(tiny_models, tmp_path):
    """``serve --prefix-cache-disk DIR``: after a restart, a repeated prompt is answered from the
    pages the first server wrote, with the same text."""
    args = ("--model", str(tiny_models["llama"][0]), "--prefix-cache-disk", str(tmp_path))
    body = dict(prompt=PROMPT, max_tokens=6, temperature=0)
    answers = []
    for _ in range(2):
        with serve_process(*args) as (base, _proc):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            answers.append(client.completions.create(model=client.models.list().data[0].id, **body))
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens == len(PROMPT) // PAGE_TOKENS * PAGE_TOKENS
    assert answers[1].choices[0].text == answers[0].choices[0].text


def test_device_tier_demotes_to_ram_then_drops(tmp_path):
    one = page(1.0).nbytes
    cache = PrefixCache(salt("m"), ram_budget=one, device_budget=one, device="cpu")
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    cache.insert(a, page(1.0))
    assert cache.bytes_per_tier() == {"device": one, "host": 0, "disk": 0}
    cache.insert(b, page(2.0))  # a moves down to RAM
    assert cache.bytes_per_tier() == {"device": one, "host": one, "disk": 0}
    cache.insert(c, page(3.0))  # b moves down, a is dropped
    assert a not in cache and b in cache and c in cache
    assert torch.equal(cache.lookup([b])[0].keys, page(2.0).keys)  # b moves back up, c down
    assert cache.bytes_per_tier() == {"device": one, "host": one, "disk": 0}
    assert PrefixCacheConfig.parse("0", vram="1MiB").enabled


@pytest.mark.parametrize("placed", [dict(n_gpu_layers=1), dict(decode_on="host"), dict(decode_backend="cuda-graph")])
def test_reuse_across_placements_and_backends(tiny_models, placed):
    """A layer split (-ngl: one cache per tier), phase migration, and the static rows of the
    cuda-graph backend (its eager CPU form) all take reused pages and keep the cold answer."""
    folder = tiny_models["llama"][0]
    cold = LLM(folder, **placed).generate(PROMPT, GREEDY)
    llm = LLM(folder, prefix_cache_ram="64MiB", **placed)
    llm.generate(PROMPT, GREEDY)
    again = llm.generate(PROMPT, GREEDY)
    assert again.metrics["cached_tokens"] == len(PROMPT) // PAGE_TOKENS * PAGE_TOKENS
    assert again.token_ids == cold.token_ids


def _burst(llm: LLM, prompts: list[list[int]], max_batch: int) -> tuple[list, Scheduler]:
    """Every prompt submitted at once (max_batch 1: one at a time, in order); each request's last event."""
    scheduler = Scheduler(llm.runtime, max_batch=max_batch, prefix_cache=llm.prefix_cache)
    last: dict[int, object] = {}
    for i, prompt in enumerate(prompts):
        scheduler.submit(f"r{i}", prompt, GREEDY, lambda event, i=i: last.__setitem__(i, event))
    scheduler.run_until_idle()
    return [last[i] for i in range(len(prompts))], scheduler


def test_a_burst_reuses_the_pages_its_first_prompts_prefill(tiny_models, monkeypatch):
    """Requests admitted together look the prefix cache up right before their first chunk, and a
    prompt whose first page another one of the step is prefilling waits a step: the burst prefills
    each shared page once, the rest of the prompts' chunks go in one native call, and every
    request gets the tokens it gets alone."""
    from hybridllm.kernels import native

    calls = []
    original = native.NativeModel.prefill_chunks

    def counting(self, x, cos, sin, caches, lengths, all_logits=False):
        calls.append(list(lengths))
        return original(self, x, cos, sin, caches, lengths, all_logits)

    monkeypatch.setattr(native.NativeModel, "prefill_chunks", counting)
    system = PROMPT[:PAGE_TOKENS + 5]  # a shared first page, and more
    prompts = [system + [20 + i, 30 + i, 40 + i] for i in range(3)] * 2 + [PROMPT[40:80], PROMPT[40:80] + [7]]
    alone = LLM(tiny_models["llama"][0])
    expected = [alone.generate(prompt, GREEDY).token_ids for prompt in prompts]
    llm = LLM(tiny_models["llama"][0], prefix_cache_ram="64MiB")
    events, scheduler = _burst(llm, prompts, max_batch=len(prompts))
    assert [event.token_ids for event in events] == expected
    cached = [event.metrics["cached_tokens"] for event in events]
    assert cached[0] == 0 and cached[6] == 0  # the first of each shared prefix prefilled it...
    assert all(c == PAGE_TOKENS for i, c in enumerate(cached) if i not in (0, 6))  # ...the others reused it
    assert calls and max(len(lengths) for lengths in calls) > 1  # chunks of several prompts in one call
    assert scheduler.prefix_cache.stats.hits == sum(cached)


def test_the_activations_mode_keys_the_prefix_cache_and_the_fingerprint(shared_llm):
    """Pages computed with one activation digit are never restored into an exact engine (nor the
    other way round), and the server's system_fingerprint tells the two apart."""
    from hybridllm.engine.prefix import kv_format
    from hybridllm.server.fingerprint import system_fingerprint

    exact, one_digit = shared_llm(), shared_llm(activations="int8")
    assert exact.runtime.activations == "exact" and one_digit.runtime.activations == "int8"
    assert "activations=exact" in kv_format(exact.runtime) and "activations=int8" in kv_format(one_digit.runtime)
    assert system_fingerprint(exact.runtime) != system_fingerprint(one_digit.runtime)
