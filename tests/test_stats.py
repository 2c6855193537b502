"""``GET /stats``: its schema, and that it tells the truth about the engine.

A tiny random model split across the tiers (layer 0 on the device, layer 1 on the host) with the
prefix cache in RAM and on disk, served in-process; the request loop is stepped by the test, so a
request can be looked at while it runs. The body must follow :class:`~hybridllm.server.stats.Stats`
exactly (no key missing, none extra, the right types), and its numbers must be the engine's:
weights per tier, KV per tier while a request runs and 0 after it, each running sequence's
tokens per layer and those on the host, prefix-cache pages in RAM and on disk and the hit rate,
the placement, and a history whose rates follow the counters.
"""

from __future__ import annotations

import queue
import typing
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from hybridllm import LLM, SamplingParams
from hybridllm.engine.scheduler import Scheduler
from hybridllm.server.app import create_app
from hybridllm.server.stats import SampleHistory, Stats


@pytest.fixture(scope="module")
def split_llm(tiny_models, tmp_path_factory):
    folder = tiny_models["llama"][0]
    return LLM(model=folder, device="cpu", threads=1, n_gpu_layers=1, prefix_cache_ram="64MiB",
               prefix_cache_disk=tmp_path_factory.mktemp("prefix"))


def exact_keys(body: Any, model: type) -> None:
    """``body`` has exactly the fields of the pydantic ``model``, recursively (through lists and
    optional fields)."""
    assert isinstance(body, dict) and set(body) == set(model.model_fields), (model.__name__, body)
    for name, info in model.model_fields.items():
        value, kind = body[name], info.annotation
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if isinstance(item, type) and issubclass(item, BaseModel):
                for entry in value:
                    exact_keys(entry, item)
            continue
        models = [t for t in typing.get_args(kind) or (kind,) if isinstance(t, type) and issubclass(t, BaseModel)]
        if models and value is not None:
            exact_keys(value, models[0])


def check_schema(body: dict[str, Any]) -> Stats:
    exact_keys(body, Stats)
    return Stats.model_validate(body, strict=True)


def test_stats_schema_and_numbers_follow_the_engine(split_llm):
    scheduler = Scheduler(split_llm.runtime, max_batch=2, prefix_cache=split_llm.prefix_cache)
    app = create_app(split_llm, scheduler, manage_scheduler=False)  # the test steps the loop itself
    runtime = split_llm.runtime
    with TestClient(app) as client:
        idle = client.get("/stats")
        assert idle.status_code == 200 and idle.headers["content-type"] == "application/json"
        stats = check_schema(idle.json())
        assert stats.model == app.state.model_name
        assert stats.requests.running == stats.requests.waiting == 0
        weights = runtime.weight_bytes
        assert weights["device"] > 0 and weights["host"] > 0
        assert (stats.memory.device.weights, stats.memory.host.weights) == (weights["device"], weights["host"])
        assert stats.memory.device.kv == stats.memory.host.kv == 0
        assert stats.memory.device_is_host is True
        assert stats.placement.layers == ["device", "host"] and stats.placement.max_batch == 2
        assert stats.kv.strategy == "dynamic" and stats.kv.page_size == runtime.kv_config.kv_page_size
        assert stats.memory.disk.budget > 0 and stats.prefix_cache.pages == {"device": 0, "host": 0, "disk": 0}
        assert stats.sequences == []

        # a request mid-way: its KV in both tiers, its tokens per layer, the host layer's all on the host
        prompt = split_llm.tokenizer.encode("one two three four five six seven eight nine ten " * 8)
        events: queue.Queue = queue.Queue()
        scheduler.submit("req-1", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), events.put)
        for _ in range(4):
            scheduler.step()
        running = check_schema(client.get("/stats").json())
        assert running.requests.running == 1
        assert running.memory.device.kv > 0 and running.memory.host.kv > 0
        assert running.kv.pages["device"] > 0 and running.kv.pages["host"] > 0
        (seq,) = running.sequences
        assert seq.id == "req-1" and seq.index == 0
        assert seq.tokens[0] == seq.tokens[1] >= len(prompt)
        assert seq.host_tokens == [0, seq.tokens[1]]  # layer 0's KV on the device, layer 1's on the host
        assert running.decode.generated_tokens >= 1 and running.decode.prompt_tokens == len(prompt)
        scheduler.run_until_idle()

        done = check_schema(client.get("/stats").json())
        assert done.memory.device.kv == done.memory.host.kv == 0 and done.sequences == []
        assert done.decode.generated_tokens == 12
        prefix = done.prefix_cache
        pages = (len(prompt) + 11) // 32  # whole pages of the prompt and the reply's first 11 tokens (cached)
        assert prefix.pages["host"] == prefix.pages["disk"] == pages > 0
        assert done.memory.host.prefix_cache == prefix.bytes["host"] > 0
        assert done.memory.disk.prefix_cache == prefix.bytes["disk"] > 0
        assert prefix.queries == len(prompt) and prefix.hits == 0 and prefix.hit_rate == 0.0

        # the same prompt again: its pages come from the cache
        scheduler.submit("req-2", prompt, SamplingParams(max_tokens=2, temperature=0), events.put)
        scheduler.run_until_idle()
        again = check_schema(client.get("/stats").json()).prefix_cache
        assert again.hits > 0 and again.hit_rate == pytest.approx(again.hits / again.queries)

        # history: one sample per reading (readings at least MIN_SAMPLE_INTERVAL_S apart), ?since= filters
        history = check_schema(client.get("/stats").json()).history
        assert [p.t for p in history] == sorted(p.t for p in history) and len(history) >= 1
        newer = check_schema(client.get(f"/stats?since={history[-1].t}").json()).history
        assert all(p.t > history[-1].t for p in newer)
        bad = client.get("/stats?since=yesterday")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.since"
        assert "/stats" in client.get("/openapi.json").json()["paths"]


def test_sample_history_rates_and_window():
    history = SampleHistory(window_s=10.0, min_interval_s=0.5)
    first = history.record(100.0, generated_tokens=0, bus_bytes=0, running=0, waiting=0, kv_bytes=0)
    assert first.decode_tokens_per_s == first.bus_bytes_per_s == 0.0
    second = history.record(102.0, generated_tokens=50, bus_bytes=4096, running=1, waiting=2, kv_bytes=7)
    assert second.decode_tokens_per_s == 25.0 and second.bus_bytes_per_s == 2048.0
    assert history.record(102.2, generated_tokens=99, bus_bytes=0, running=0, waiting=0, kv_bytes=0) is second
    history.record(113.0, generated_tokens=50, bus_bytes=4096, running=0, waiting=0, kv_bytes=0)
    assert [p["t"] for p in history.points()] == [113.0]  # 100 and 102 are older than the window
    assert history.points(since=113.0) == []


def test_the_browser_tests_stand_in_stats_follow_the_schema():
    from test_page_browser import GOOD  # the /stats the page's robustness test starts from

    check_schema(GOOD)
