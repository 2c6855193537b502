"""The page at ``/`` in a real browser (Debian's chromium through selenium; see tests/browser.py).

- On the default model: the page chats (streamed answers, TTFT, tokens/s and cached prompt
  tokens under each), its tier panel shows the weights' bytes, the KV of a request stopped
  mid-stream returns to 0, and it made no request outside the server's origin; the screenshot is
  saved (build/test-artifacts/).
- With ``--api-key``: without the key the page shows the 401; with it (asked once) chat works.
- Against a stand-in ``/stats`` that answers with missing, mistyped and broken fields, and in the
  ``serve --ray`` shape with one replica down: the page shows what it has and never breaks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from browser import NetworkLog, chromium, save_screenshot, script_errors
from test_server import InProcessServer, metrics, serve_process

pytestmark = pytest.mark.slow  # a browser, and servers of the default model

ANSWER_TIMEOUT_S = 120  # bounds, not timings: a shared 2-core machine is slow


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except Exception:  # an element not there yet, a stale one
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def field(driver: Any, name: str, card: int = 0) -> Any:
    """The element ``[data-field=name]`` of the ``card``-th replica card of the live view."""
    cards = driver.find_elements("css selector", "#replicas .replica")
    return cards[card].find_element("css selector", f'[data-field="{name}"]')


def field_bytes(driver: Any, name: str) -> int | None:
    value = field(driver, name).get_attribute("data-bytes")
    return int(value) if value else None


def ask(driver: Any, message: str, *, enter: bool = True) -> None:
    box = driver.find_element("id", "message-input")
    box.clear()
    box.send_keys(message)
    if enter:
        box.send_keys("\n")  # Enter sends
    else:
        driver.find_element("id", "send-button").click()


def answers(driver: Any) -> list[Any]:
    return driver.find_elements("css selector", "#conversation .message.assistant")


def finished_answer(driver: Any, count: int) -> Any:
    """The ``count``-th answer once it has ended (done, or failed)."""
    def ended() -> Any:
        found = answers(driver)
        if len(found) >= count and re.search(r"\b(done|error)\b", found[count - 1].get_attribute("class")):
            return found[count - 1]
        return None

    return wait_until(ended, ANSWER_TIMEOUT_S, f"answer {count} to end")


def set_input(driver: Any, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


# ---- the default model ---------------------------------------------------------------------------
def test_page_chats_shows_the_tiers_frees_kv_on_stop_and_stays_on_its_origin(monkeypatch):
    # 20 of the 30 layers on the device: weights and KV in both tiers for the panel to show
    with serve_process("--max-batch", "4", "-ngl", "20") as (base, _proc), chromium(monkeypatch) as driver:
        network = NetworkLog(driver)
        driver.get(base + "/")
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        wait_until(lambda: driver.find_element("id", "model-name").text == model, 30, "the model name")
        wait_until(lambda: field_bytes(driver, "device-weights"), 30, "the tier panel")
        stats = httpx.get(f"{base}/stats").json()
        weights = stats["memory"]["device"]["weights"]
        host_weights = stats["memory"]["host"]["weights"]
        assert weights > 0 and field_bytes(driver, "device-weights") == weights
        assert host_weights > 0 and field_bytes(driver, "host-weights") == host_weights
        assert field(driver, "device-weights").text.endswith("MiB")
        tiers = [cell.get_attribute("data-tier")
                 for cell in driver.find_elements("css selector", '[data-field="layers"] .layer')]
        assert tiers[1:-1] == stats["placement"]["layers"] == ["device"] * 20 + ["host"] * 10

        set_input(driver, "system-prompt", "You are a helpful assistant.")
        set_input(driver, "temperature", "0")
        set_input(driver, "max-tokens", "48")
        ask(driver, "What is the capital of France?")
        first = finished_answer(driver, 1)
        assert "error" not in first.get_attribute("class"), first.text
        assert "Paris" in first.find_element("css selector", ".answer-text").text  # greedy, as `generate` answers
        line = first.find_element("css selector", ".answer-metrics")
        assert re.search(r"TTFT \d+ ms", line.text) and re.search(r"[\d.]+ tok/s", line.text), line.text
        assert line.get_attribute("data-cached-tokens") == "0", line.text  # a cold prompt
        # the second turn resends the first: the prefix cache supplies its KV
        ask(driver, "And of Italy?", enter=False)
        second = finished_answer(driver, 2)
        assert "Rome" in second.find_element("css selector", ".answer-text").text  # it saw the first turn
        cached = second.find_element("css selector", ".answer-metrics").get_attribute("data-cached-tokens")
        assert cached and int(cached) > 0, second.text
        wait_until(lambda: field(driver, "prefix-pages").text.split(" / ")[0] not in ("0", "—"), 10,
                   "prefix-cache pages in RAM")
        wait_until(lambda: field(driver, "generated").text not in ("0", "—"), 10, "generated tokens")
        save_screenshot(driver, "page-chat.png")

        # a long answer, stopped mid-stream: its KV shows on the panel, then goes back to 0
        aborted = metrics(base)['hybridllm:request_success_total{finished_reason="abort"}']
        set_input(driver, "max-tokens", "1500")
        ask(driver, "Write a long story about a dragon who learns to read.")  # greedy: 1500 tokens
        wait_until(lambda: len(answers(driver)) == 3 and len(answers(driver)[2].text) > 300, ANSWER_TIMEOUT_S,
                   "the third answer to stream")
        wait_until(lambda: (field_bytes(driver, "device-kv") or 0) > 0 and (field_bytes(driver, "host-kv") or 0) > 0,
                   30, "the request's KV in both tiers on the panel")
        assert field(driver, "running").text == "1"
        assert driver.find_elements("css selector", '[data-field="kv-maps"] canvas')  # its pages, per layer
        save_screenshot(driver, "page-streaming.png")
        driver.find_element("id", "stop-button").click()
        third = finished_answer(driver, 3)
        assert "stopped" in third.find_element("css selector", ".answer-metrics").text
        wait_until(lambda: field_bytes(driver, "device-kv") == 0 and field_bytes(driver, "host-kv") == 0, 30,
                   "KV back to 0 on the panel")
        assert field(driver, "running").text == "0"
        after = metrics(base)
        assert after['hybridllm:request_success_total{finished_reason="abort"}'] == aborted + 1
        assert after['hybridllm:kv_cache_bytes{tier="device"}'] == after['hybridllm:kv_cache_bytes{tier="host"}'] == 0

        network.read()
        assert any(url.startswith(base + "/stats") for url in network.urls)  # the log saw the page's calls
        assert any(url == base + "/v1/chat/completions" for url in network.urls)
        assert network.outside(base) == []
        assert script_errors(driver) == []


def test_page_with_api_key_shows_the_401_then_chats_with_the_key(monkeypatch):
    key = "page-s3cret"
    with serve_process("--max-batch", "2", "--api-key", key) as (base, _proc), chromium(monkeypatch) as driver:
        network = NetworkLog(driver)
        driver.get(base + "/")
        banner = driver.find_element("id", "auth-banner")
        wait_until(banner.is_displayed, 30, "the API key banner")
        assert "401" in banner.text and "API key" in banner.text, banner.text
        ask(driver, "Hello?")
        refused = finished_answer(driver, 1)
        assert "error" in refused.get_attribute("class") and "401" in refused.text, refused.text
        assert field_bytes(driver, "device-weights")  # /stats needs no key: the live view works

        set_input(driver, "api-key-input", key)
        driver.find_element("id", "api-key-save").click()
        wait_until(lambda: not banner.is_displayed(), 30, "the banner to go")
        set_input(driver, "max-tokens", "16")
        ask(driver, "What is 2+2?")
        answer = finished_answer(driver, 2)
        assert "error" not in answer.get_attribute("class"), answer.text
        assert answer.find_element("css selector", ".answer-text").text.strip()

        driver.refresh()  # asked once: the page keeps the key
        wait_until(lambda: driver.find_element("id", "model-name").text.startswith("SmolLM2"), 30, "the model")
        assert not driver.find_element("id", "auth-banner").is_displayed()
        assert network.read().outside(base) == [] and network.urls
        assert script_errors(driver) == []


# ---- a stand-in /stats: bad or missing fields never break the page --------------------------------
MIB = 1 << 20
GOOD = {
    "model": "stand-in", "version": "0", "time": 1000.0, "uptime_s": 12.0,
    "requests": {"running": 2, "waiting": 1},
    "memory": {"device": {"weights": 80 * MIB, "kv": 3 * MIB, "kv_budget": None, "prefix_cache": 0,
                          "capacity": 1024 * MIB},
               "host": {"weights": 20 * MIB, "kv": 1 * MIB, "kv_budget": 64 * MIB, "prefix_cache": 2 * MIB,
                        "capacity": 4096 * MIB},
               "disk": {"prefix_cache": 5 * MIB, "budget": 100 * MIB}, "device_is_host": False},
    "kv": {"strategy": "tiered", "page_size": 16, "pages": {"device": 12, "host": 4}, "reserved_bytes": 0,
           "holdable_bytes": 1},
    "bus": {"bytes": {"h2d": 10, "d2h": 5, "hidden_states": 0}, "bytes_per_s": 2048.0},
    "decode": {"tokens_per_s": 42.5, "generated_tokens": 1234, "prompt_tokens": 99},
    "prefix_cache": {"pages": {"device": 0, "host": 7, "disk": 9}, "bytes": {}, "budgets": {}, "queries": 10,
                     "hits": 5, "hit_rate": 0.5},
    "placement": {"device": "cuda:0", "dtype": "float16", "weights": "int4", "decode_on": "device",
                  "embed": "host", "head": "device", "layers": ["device", "device", "host"], "max_batch": 4,
                  "prefill_chunk": 512},
    "sequences": [{"id": "chatcmpl-abcdef0123", "index": 0, "tokens": [40, 40, 40], "host_tokens": [16, 16, 40]}],
    "history": [{"t": 990.0 + i, "decode_tokens_per_s": float(i), "bus_bytes_per_s": 0.0, "running": 1,
                 "waiting": 0, "kv_bytes": i * 1000} for i in range(10)],
}
BROKEN = {
    "partial": {"requests": {"running": 3}, "memory": {"device": {"weights": MIB}}},
    "mistyped": {**GOOD, "requests": "many", "memory": {"device": {"weights": "80", "kv": None}, "host": [1, 2]},
                 "placement": {"layers": "device"}, "sequences": {"id": 1}, "history": [{"t": "x"}, None, 3],
                 "decode": {"tokens_per_s": "fast"}, "prefix_cache": {"pages": None, "hit_rate": "half"}},
    "empty": {},
    "not an object": ["stats"],
    "ray": {"replicas": [{"replica": "0", "live": True, "pid": 11, "hostname": "node-a", "stats": GOOD},
                         {"replica": "1", "live": False, "in_flight": 0, "stats": None}]},
}


def stand_in_app(mode: dict[str, str]) -> Any:
    """The page's files, ``/v1/models``, and a ``/stats`` that answers as ``mode["stats"]`` says."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    from hybridllm.server.page_assets import PAGE_FILES, page_response

    async def stats(_request: Any) -> Any:
        kind = mode["stats"]
        if kind == "good":
            return JSONResponse(GOOD)
        if kind == "garbage":
            return PlainTextResponse("{not json")
        if kind == "500":
            return PlainTextResponse("boom", status_code=500)
        return JSONResponse(BROKEN[kind])

    async def models(_request: Any) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def page(request: Any) -> Any:
        return page_response(request.url.path)

    routes = [Route(path, page) for path in PAGE_FILES]
    return Starlette(routes=[*routes, Route("/stats", stats), Route("/v1/models", models)])


def test_bad_or_missing_stats_fields_never_break_the_page(monkeypatch):
    mode = {"stats": "good"}
    with InProcessServer(stand_in_app(mode)) as server, chromium(monkeypatch) as driver:
        network = NetworkLog(driver)
        driver.get(server.base + "/")
        wait_until(lambda: field(driver, "running").text == "2", 30, "the good stats")
        assert field(driver, "device-weights").text == "80.0 MiB"
        assert field(driver, "decode-rate").text == "43 tok/s"
        assert field(driver, "prefix-pages").text == "7 / 9" and field(driver, "prefix-hit-rate").text == "50.0%"
        tiers = [cell.get_attribute("data-tier")
                 for cell in driver.find_elements("css selector", '[data-field="layers"] .layer')]
        assert tiers == ["host", "device", "device", "host", "device"]  # embedding, 3 layers, head
        assert len(field(driver, "spark-decode").find_elements("css selector", "polyline")) == 1

        mode["stats"] = "partial"  # what is there is shown; the rest is a dash
        wait_until(lambda: field(driver, "running").text == "3", 30, "the partial stats")
        assert field(driver, "device-weights").text == "1.00 MiB"
        assert field(driver, "waiting").text == "—" and field(driver, "host-weights").text == "—"

        for kind in ("mistyped", "empty", "not an object", "garbage", "500"):
            mode["stats"] = kind
            time.sleep(2.5)  # two refreshes of the page
            assert driver.find_element("id", "message-input").is_enabled()
            assert driver.find_elements("css selector", "#replicas .replica"), kind
        assert "unavailable" in driver.find_element("id", "stats-error").text  # the 500

        mode["stats"] = "ray"  # serve --ray: one card per replica
        wait_until(lambda: len(driver.find_elements("css selector", "#replicas .replica")) == 2, 30,
                   "two replica cards")
        titles = [el.text for el in driver.find_elements("css selector", "#replicas .replica-title")]
        assert titles[0].startswith("replica 0") and "node-a" in titles[0], titles
        assert titles[1].startswith("replica 1 (down)"), titles
        assert field(driver, "device-weights", card=0).text == "80.0 MiB"
        assert field(driver, "device-weights", card=1).text == "—"
        assert not driver.find_element("id", "stats-error").is_displayed()  # recovered
        assert script_errors(driver) == []
        assert network.read().outside(server.base) == [] and network.urls
