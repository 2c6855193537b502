"""Issue 38's findings, each reproduced: departed clients stop their work at once (every route and
mode), a client that stops reading pauses its request and is given up on after the stall timeout,
bad input is a 4xx with an OpenAI error object (never a 500, never a dropped connection), a fault
is one 500 logged once, unknown fields are named in the log, cheap checks come before
tokenizing, HEAD /health and Retry-After, a stream cut by shutdown ends with an error event and
[DONE] (and a non-zero exit), KV holdable bytes counted once, prefix-cache page headers checked.

Most run on a tiny random model in this process; those that need a long generation on the default
model, a server process or many requests are marked slow.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from test_server import InProcessServer, metrics, serve_process
from tiny_models import build_hf_model

from hybridllm import LLM, SamplingParams
from hybridllm.engine.scheduler import RequestLoopStopped, Scheduler, SeqEvent
from hybridllm.engine.structured import GrammarError
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVBudgetError
from hybridllm.kvcache.prefix_disk import DiskTier, checksum
from hybridllm.kvcache.prefix_hash import salt
from hybridllm.kvcache.prefix_page import KVPage
from hybridllm.server.app import create_app
from hybridllm.server.engine_view import EngineView
from hybridllm.server.protocol import APIError
from hybridllm.server.request_params import logit_bias
from hybridllm.server.streams import event_error

BOUND_S = 120  # a bound on waits for something that must happen (never a timing assertion)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def wait_for(condition, what: str, bound_s: float = BOUND_S, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> Path:
    """A tiny random Llama with an 8K context: long generations, fast."""
    folder = tmp_path_factory.mktemp("long-tiny") / "llama"
    build_hf_model(folder, "llama", max_position_embeddings=8192)
    return folder


@pytest.fixture(scope="module")
def tiny_llm(long_tiny) -> LLM:
    return LLM(long_tiny, device="cpu", threads=1)


class SmallBufferServer(InProcessServer):
    """uvicorn on a listening socket whose connections have a small kernel send buffer (as over a
    slow network): a client that stops reading fills it after a few KB instead of megabytes."""

    def __init__(self, app, sndbuf: int = 8192) -> None:
        super().__init__(app)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


def model_of(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def raw_request(port: int, path: str, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """Send a POST and read nothing back: a client that stopped reading (a small receive window)."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(payload)) + payload)
    return sock


def long_chat(model: str, max_tokens: int = 6000, **extra: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


# ---- the request loop's pause and resume ---------------------------------------------------------
def test_a_paused_request_leaves_the_batch_keeps_its_kv_and_resumes_to_the_same_tokens(tiny_llm):
    prompt = tiny_llm.tokenizer.encode("Once upon a time")
    alone = tiny_llm.generate("Once upon a time", GREEDY).token_ids
    sched = Scheduler(tiny_llm.runtime, max_batch=1)
    events: dict[str, list[SeqEvent]] = {"a": [], "b": []}
    sched.submit("a", prompt, GREEDY, events["a"].append)
    while len(events["a"]) < 5:
        sched.step()
    sched.pause("a")
    held = sched.ledger.current("device")
    sched.submit("b", prompt, GREEDY, events["b"].append)
    for _ in range(3):
        sched.step()
    # a's slot went to b: a's KV is still held, a produced nothing more while b runs
    assert sched.num_paused == 1 and sched.num_running == 1 and sched.num_waiting == 0
    assert sched.stats()["paused"] == 1 and sched.ledger.current("device") > held
    produced = len(events["a"])
    while not (events["b"] and events["b"][-1].finished):
        sched.step()
    assert len(events["a"]) == produced
    assert sched.ledger.current("device") == held  # b freed its KV, a's is intact
    sched.resume("a")
    while not events["a"][-1].finished:
        sched.step()
    assert events["a"][-1].token_ids == alone and events["b"][-1].token_ids == alone
    assert sched.num_paused == 0 and sched.ledger.current("device") == 0


def test_a_resumed_request_waits_for_room_and_an_aborted_paused_one_frees_its_kv(tiny_llm):
    prompt = tiny_llm.tokenizer.encode("hello")
    sched = Scheduler(tiny_llm.runtime, max_batch=1)
    seen: list[SeqEvent] = []
    sched.submit("a", prompt, GREEDY, seen.append)
    sched.step()
    sched.pause("a")
    sched.submit("b", prompt, GREEDY, lambda _e: None)
    sched.step()
    sched.resume("a")  # no room while b runs: a stays paused, b is not preempted
    sched.step()
    assert sched.num_paused == 1 and sched.num_running == 1
    sched.abort("a")
    sched.step()
    assert sched.num_paused == 0
    sched.abort("b")
    sched.step()
    assert sched.ledger.current("device") == 0 and sched.reserved_bytes == 0 and not sched.has_work()


# ---- error mapping, logit_bias, prefix pages ------------------------------------------------------
def test_loop_errors_become_the_right_status():
    def status(exc: BaseException | None) -> APIError:
        return event_error(SeqEvent("r", error="message", exception=exc))

    stopped = status(RequestLoopStopped("the server is shutting down"))
    assert stopped.status == 503 and stopped.code == "shutting_down" and stopped.headers == {"Retry-After": "1"}
    budget = status(KVBudgetError("device budget"))
    assert budget.status == 503 and budget.headers == {"Retry-After": "1"}
    schema = event_error(SeqEvent("r", error="no token", exception=GrammarError("x")), "tools")
    assert schema.status == 400 and schema.param == "tools" and schema.message == "tools: no token"
    assert status(ConfigError("bad")).status == 400
    fault = status(RuntimeError("boom"))
    assert fault.status == 500 and fault.type == "server_error" and fault.message == "message"


def test_logit_bias_keys_are_plain_decimal_token_ids():
    assert logit_bias({"5": 1.0, "10": -2.0}, 100) == {5: 1.0, 10: -2.0}
    for key in (" 5", "5 ", "+5", "0x5", "5.0", "٥", "1_0", ""):
        with pytest.raises(APIError) as exc_info:
            logit_bias({key: 1.0}, 100)
        assert exc_info.value.status == 400 and exc_info.value.param == "logit_bias"


def page(value: float) -> KVPage:
    keys = torch.full((2, 1, 2, 4, 8), value)  # (n_layers, B, Hkv, P, D)
    return KVPage(keys, -keys)


def rewrite_header(path: Path, edit) -> None:
    """Change a page file's JSON header with ``edit(header)``, keeping it valid JSON (and the
    length field right), the payload untouched."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:12], "little")
    header = json.loads(data[12:12 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(data[:8] + len(raw).to_bytes(4, "little") + raw + data[12 + length:])


def dropped_with_one_warning(directory: Path, stored: KVPage, edit, caplog) -> str:
    """Store ``stored`` in a disk tier, ``edit`` its file's header, then read it back in a restarted
    tier: None, one warning, the file removed. Returns the warning."""
    address = b"\x01" * 16
    assert DiskTier(directory, budget=1 << 20, root=salt("m")).put(address, stored)
    path = directory / f"{address.hex()}.kvpage"
    rewrite_header(path, edit)
    restarted = DiskTier(directory, budget=1 << 20, root=salt("m"))  # told no page shape or dtype
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        assert restarted.get(address) is None
    assert len(caplog.records) == 1 and "ignoring and removing" in caplog.records[0].getMessage()
    assert not path.exists() and address not in restarted
    return caplog.records[0].getMessage()


@pytest.mark.parametrize("edit", [
    lambda h: h.update(shape=[h["shape"][i] for i in (0, 1, 4, 3, 2)]),  # a permuted shape
    lambda h: h.update(dtype="float64", payload_bytes=h["payload_bytes"]),  # another dtype
    lambda h: h.__setitem__("shapes", h.pop("shape")),  # a renamed key
], ids=["permuted-shape", "dtype", "renamed-key"])
def test_an_edited_page_header_is_dropped_with_one_warning(tmp_path, caplog, edit):
    assert "checksum mismatch" in dropped_with_one_warning(tmp_path, page(1.0), edit, caplog)


def test_a_page_of_another_shape_with_a_good_checksum_is_refused_by_the_model_check(tmp_path, caplog):
    """A consistent file (its checksum matches) whose page is not this model's shape."""
    DiskTier(tmp_path, budget=1 << 20, root=salt("m")).put(b"\x02" * 16, page(2.0))
    checked = DiskTier(tmp_path, budget=1 << 20, root=salt("m"), page_shape=(2, 1, 2, 4, 16),
                       page_dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        assert checked.get(b"\x02" * 16) is None
    assert "this model's pages are [2, 1, 2, 4, 16]" in caplog.text


def test_a_consistent_file_whose_payload_cannot_be_read_raises_nothing_past_the_tier(tmp_path, caplog):
    """A header rewritten with its checksum made right again (so every check up to reading the
    payload passes), naming a dtype the payload's bytes cannot be viewed as: torch raises a
    RuntimeError, and the tier still answers None with one warning and removes the file."""
    keys = torch.ones((1, 1, 1, 1, 1), dtype=torch.float16)  # a payload of 4 bytes: no float64 in it

    def float64_with_its_checksum(header: dict) -> None:
        header["dtype"] = "float64"
        fields = {key: value for key, value in header.items() if key != "checksum"}
        header["checksum"] = checksum(fields, KVPage(keys, keys).payload())

    warning = dropped_with_one_warning(tmp_path, KVPage(keys, keys), float64_with_its_checksum, caplog)
    assert "checksum" not in warning  # it got past every check of the header


def test_an_edited_page_header_costs_a_recomputation_not_a_request(long_tiny, tmp_path, caplog):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # several whole pages
    cold = LLM(long_tiny, device="cpu", threads=1, prefix_cache_ram=0, prefix_cache_disk=tmp_path)
    expected = cold.generate(prompt, GREEDY).token_ids
    files = sorted(tmp_path.glob("*.kvpage"))
    assert files
    for path in files:  # every page: a permuted shape, valid JSON
        rewrite_header(path, lambda h: h.update(shape=[h["shape"][i] for i in (0, 1, 4, 3, 2)]))
    for _restart in range(len(files) + 1):  # each lookup stops at the first bad page, drops and rebuilds it
        warm = LLM(long_tiny, device="cpu", threads=1, prefix_cache_ram=0, prefix_cache_disk=tmp_path)
        with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
            assert warm.generate(prompt, GREEDY).token_ids == expected
    warnings = [r.getMessage() for r in caplog.records if "ignoring and removing" in r.getMessage()]
    names = [w.split("removing ")[1].split(":")[0] for w in warnings]
    assert len(names) >= 2 and len(set(names)) == len(names)  # the prompt's pages, one warning each, once
    assert all("checksum mismatch" in w for w in warnings)
    caplog.clear()
    disk = DiskTier(tmp_path, budget=1 << 30, root=warm.prefix_cache.root)
    with caplog.at_level(logging.WARNING, logger="hybridllm.kvcache.prefix_disk"):
        assert all(disk.get(bytes.fromhex(Path(name).stem)) is not None for name in names)  # rebuilt, readable
    assert not caplog.records


# ---- the app on a tiny model: bad input is 4xx, a fault is one 500 ---------------------------------
@pytest.fixture(scope="module")
def tiny_server(tiny_llm):
    """A started app of the tiny model (stall timeout 1 s) on a small-send-buffer socket:
    (base, port, scheduler)."""
    sched = Scheduler(tiny_llm.runtime, max_batch=2)
    app = create_app(tiny_llm, sched, stream_stall_timeout_s=1.0)
    with SmallBufferServer(app) as srv:
        yield srv.base, srv.port, sched


def test_a_lone_surrogate_is_a_400_naming_it_and_the_connection_stays_open(tiny_server):
    base, port, _ = tiny_server
    model = model_of(base)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    cases = [("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
              "messages.0.content"),
             ("/v1/completions", '{"model": "%s", "prompt": "\\udfff"}', "prompt"),
             ("/tokenize", '{"content": "x\\ud83d", "m": "%s"}', "content"),
             ("/v1/chat/completions", '{"model": "%s", "messages": [], "extra": {"k\\ud800": 1}}', "extra")]
    for path, body, param in cases:
        conn.request("POST", path, body=(body % model if "%s" in body else body).encode(),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400, error
        assert error["param"] == param and "lone surrogate" in error["message"] and len(error["message"]) < 200
        assert not response.will_close  # keep-alive: the next request goes on the same connection
    conn.request("POST", "/tokenize", body=json.dumps({"content": "fine"}).encode(),
                 headers={"Content-Type": "application/json"})
    assert conn.getresponse().status == 200


def test_an_unsatisfiable_json_schema_is_a_short_400(tiny_server):
    base, _, _ = tiny_server
    model = model_of(base)
    unsatisfiable = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": unsatisfiable}}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        for stream in (False, True):
            r = httpx.post(f"{base}{path}", json={"model": model, **body, "response_format": fmt, "max_tokens": 8,
                                                  "stream": stream}, timeout=60)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "response_format" and error["code"] == "invalid_schema"
            assert len(error["message"]) < 250 and "<state>" not in error["message"], error["message"]


def test_a_fault_is_one_500_logged_once_and_the_connection_stays_open(tiny_server, monkeypatch, caplog):
    base, port, sched = tiny_server
    model = model_of(base)

    def broken_submit(*_args, **_kwargs):
        raise RuntimeError("boom: a bug")

    monkeypatch.setattr(sched, "submit", broken_submit)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    with caplog.at_level(logging.ERROR):
        conn.request("POST", "/v1/completions", body=json.dumps({"model": model, "prompt": "hi"}).encode(),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
    assert response.status == 500 and error["type"] == "server_error"
    assert error["message"].count("internal error") == 1 and "boom" not in error["message"]
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "boom: a bug" in logged[0].exc_text
    assert not response.will_close
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_a_failing_forward_says_internal_error_once(tiny_llm, monkeypatch):
    sched = Scheduler(tiny_llm.runtime, max_batch=2)

    def broken(*_args, **_kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(sched.executor, "execute", broken)  # a fault outside the per-row guards: the whole step
    seen: list[SeqEvent] = []
    sched.submit("r", tiny_llm.tokenizer.encode("hi"), GREEDY, seen.append)
    sched.start()
    try:
        wait_for(lambda: seen and seen[-1].finished, "the request's error event")
    finally:
        sched.stop()
    assert seen[-1].error.count("internal error") == 1 and "kernel exploded" in seen[-1].error
    assert event_error(seen[-1]).status == 500


def test_unknown_fields_are_served_and_named_once_per_request(tiny_server, caplog):
    base, _, _ = tiny_server
    model = model_of(base)
    body = {"model": model, "messages": [{"role": "user", "content": "hi", "mood": "happy"}], "max_tokens": 2,
            "my_client_field": 1, "stream_options": None, "response_format": {"type": "text", "strictness": 3}}
    with caplog.at_level(logging.WARNING, logger="hybridllm.server.unsupported"):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        r2 = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r2.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(lines) == 1, lines
    for name in ("my_client_field", "messages.0.mood", "response_format.strictness"):
        assert name in lines[0]


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tiny_server, tiny_llm, monkeypatch):
    base, _, sched = tiny_server
    model = model_of(base)
    calls = []
    encode = tiny_llm.tokenizer.encode
    monkeypatch.setattr(tiny_llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    size = sched.context_length * tiny_llm.tokenizer.max_token_bytes + 1  # at least a context of tokens
    for path, body in (("/v1/completions", {"prompt": "a" * size}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * size}]})):
        r = httpx.post(f"{base}{path}", json={"model": model, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []
    ok = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "a b c", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and calls


def test_head_health_and_retry_after_on_every_503(tiny_llm):
    sched = Scheduler(tiny_llm.runtime)
    app = create_app(tiny_llm, sched, manage_scheduler=False)  # the loop is not running: 503

    async def run() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out = {"head_stopped": await client.head("/health"), "get_stopped": await client.get("/health")}
            sched.start()
            out["head_ok"] = await client.head("/health")
            app.state.draining.begin()
            out["draining_health"] = await client.get("/health")
            out["draining"] = await client.get("/v1/models")
            sched.stop()
            return out

    out = asyncio.run(run())
    assert out["head_ok"].status_code == 200 and out["head_ok"].content == b""
    for name in ("head_stopped", "get_stopped", "draining_health", "draining"):
        assert out[name].status_code == 503 and out[name].headers["retry-after"] == "1", name
    assert out["draining"].json()["error"]["code"] == "shutting_down"
    assert "/health" in app.openapi()["paths"] and "head" in app.openapi()["paths"]["/health"]


# ---- KV holdable bytes against the ledger ---------------------------------------------------------
def test_holdable_kv_bytes_count_each_memory_once_and_usage_is_reserved_over_it(long_tiny):
    ram = psutil.virtual_memory()
    bounded = LLM(long_tiny, device="cpu", threads=1, vram_budget="64MiB")
    sched = Scheduler(bounded.runtime, host_budget=32 << 20)
    view = EngineView(sched)
    # both tiers bounded and within the RAM: exactly the ledger's budgets
    assert view.kv_holdable_bytes == sched.ledger.budget("device") + sched.ledger.budget("host")
    # the CPU "device" unbounded beside a host budget as large as the RAM (what serve sets): the
    # RAM once, not twice (issue 38: 48.4 GB on a 23 GiB machine)
    unbounded = Scheduler(LLM(long_tiny, device="cpu", threads=1).runtime, host_budget=ram.available)
    holdable = EngineView(unbounded).kv_holdable_bytes
    assert holdable <= ram.total and holdable <= unbounded.ledger.budget("host") + (1 << 30)
    # kv_cache_usage_perc: the reserved bytes over it; the reservation is what the ledger holds
    app = create_app(bounded, sched, manage_scheduler=False)
    seen: list[SeqEvent] = []
    sched.submit("r", bounded.tokenizer.encode("hello"), SamplingParams(max_tokens=100, ignore_eos=True), seen.append)
    sched.step()
    text = app.state.metrics.render().decode()

    def sample(name: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith(f"hybridllm:{name}{{")).rsplit(" ", 1)[1])

    assert sched.reserved_bytes == sched.ledger.current("device") + sched.ledger.current("host") > 0
    assert sample("kv_cache_holdable_bytes") == view.kv_holdable_bytes
    assert sample("kv_cache_usage_perc") == pytest.approx(sched.reserved_bytes / view.kv_holdable_bytes)
    sched.abort("r")
    sched.step()


# ---- backpressure: a client that stops reading ----------------------------------------------------
def test_a_client_that_stops_reading_is_paused_yields_its_slot_and_is_given_up_on(tiny_server):
    base, port, sched = tiny_server
    model = model_of(base)
    before = metrics(base)
    sock = raw_request(port, "/v1/chat/completions", long_chat(model, stream=True, logprobs=True, top_logprobs=20))
    try:
        # paused, its KV kept: the gauge and the counter say so. A busy machine may pause it more
        # than once before its socket is full (the writer falls behind the loop, catches up to half
        # the buffer, and the request resumes), so the counter grows by one or more.
        wait_for(lambda: sched.num_paused == 1 and metrics(base)["hybridllm:num_requests_paused"] == 1,
                 "the request paused")
        paused = metrics(base)
        assert paused['hybridllm:kv_cache_bytes{tier="device"}'] > 0
        assert paused["hybridllm:stream_pauses_total"] >= before["hybridllm:stream_pauses_total"] + 1
        tokens_at_pause = paused["hybridllm:generation_tokens_total"]
        # the paused request's slot serves others meanwhile (max_batch 2: two more run at once)
        replies = [httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 8},
                              timeout=60) for p in ("one", "two")]
        assert all(r.status_code == 200 for r in replies)
        wait_for(lambda: metrics(base)["hybridllm:stream_stalls_total"] == before["hybridllm:stream_stalls_total"] + 1,
                 "the stall timeout (1 s) gave the client up")
        wait_for(lambda: sched.num_running + sched.num_paused == 0, "its sequence gone")
        after = metrics(base)
    finally:
        sock.close()
    assert after['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and after["hybridllm:kv_cache_reserved_bytes"] == 0
    assert after['hybridllm:request_success_total{finished_reason="abort"}'] == \
        before['hybridllm:request_success_total{finished_reason="abort"}'] + 1
    assert after["hybridllm:generation_tokens_total"] - tokens_at_pause < 100  # nothing decoded while paused


def test_a_slow_reader_pauses_resumes_and_gets_the_whole_answer(tiny_server, tiny_llm):
    base, port, _ = tiny_server
    model = model_of(base)
    n = 1500
    expected = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    before = metrics(base)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 5}
    sock = raw_request(port, "/v1/completions", body)
    chunks = []
    try:
        wait_for(lambda: metrics(base)["hybridllm:stream_pauses_total"] > before["hybridllm:stream_pauses_total"],
                 "the stream paused")
        sock.settimeout(60)
        while b"data: [DONE]" not in b"".join(chunks[-2:]):
            chunks.append(sock.recv(2048))
            time.sleep(0.001)  # slowly, but reading: never given up on
            assert chunks[-1], "the server closed the stream"
    finally:
        sock.close()
    raw = b"".join(chunks).decode()
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.split("\n")
                   if line.startswith("data: {") and '"choices": [{' in line)
    assert text == expected.text
    after = metrics(base)
    assert after["hybridllm:stream_stalls_total"] == before["hybridllm:stream_stalls_total"]
    assert after['hybridllm:request_success_total{finished_reason="length"}'] == \
        before['hybridllm:request_success_total{finished_reason="length"}'] + 1


# ---- departed clients: every route and mode, at once (the default model: long generations) --------
@pytest.mark.slow
@pytest.mark.parametrize("route,stream,tools", [
    ("/v1/chat/completions", False, False), ("/v1/chat/completions", True, False),
    ("/v1/chat/completions", True, True), ("/v1/completions", False, False), ("/v1/completions", True, False)],
    ids=["chat-json", "chat-sse", "chat-sse-tools", "completions-json", "completions-sse"])
def test_a_departed_client_aborts_its_request_at_once(default_llm, route, stream, tools, monkeypatch):
    sched = Scheduler(default_llm.runtime, max_batch=4)
    app = create_app(default_llm, sched)
    abort, execute, steps, aborted_at_step = sched.abort, sched.executor.execute, [0], []

    def execute_counting_steps(plan):  # each step that runs sequences executes its plan once
        steps[0] += 1
        return execute(plan)

    def abort_counting_steps(request_id: str) -> None:
        aborted_at_step.append(steps[0])
        abort(request_id)

    monkeypatch.setattr(sched.executor, "execute", execute_counting_steps)
    monkeypatch.setattr(sched, "abort", abort_counting_steps)
    with InProcessServer(app) as srv:
        base = srv.base
        model = model_of(base)
        body: dict[str, Any] = {"model": model, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                                "stream": stream}
        if route == "/v1/completions":
            body["prompt"] = "Once upon a time"
        else:
            body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
        if tools:  # streamed whole: nothing is sent until the reply ends
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        before = metrics(base)
        sock = raw_request(srv.port, route, body, rcvbuf=1 << 16)
        wait_for(lambda: metrics(base)["hybridllm:generation_tokens_total"] > before["hybridllm:generation_tokens_total"] + 3,
                 "the request decoding")
        sock.close()  # the client goes away
        wait_for(lambda: sched.num_running == 0, "the request aborted")
        after = metrics(base)
    assert len(aborted_at_step) == 1 and steps[0] - aborted_at_step[0] <= 1  # its KV freed within one step
    assert after['hybridllm:request_success_total{finished_reason="abort"}'] == \
        before['hybridllm:request_success_total{finished_reason="abort"}'] + 1
    assert after['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and after["hybridllm:kv_cache_reserved_bytes"] == 0
    assert after["hybridllm:generation_tokens_total"] - before["hybridllm:generation_tokens_total"] < 1000


# ---- shutdown: a stream cut at the end of the grace ------------------------------------------------
@pytest.mark.slow
def test_streams_cut_by_shutdown_get_an_error_event_and_done_and_the_exit_code_says_so(long_tiny):
    with serve_process("--model", str(long_tiny), "--max-batch", "1", "--shutdown-grace", "1") as (base, proc):
        model = model_of(base)
        results: list[str] = []

        def stream(i: int) -> None:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                              json={"model": model, "prompt": f"story {i}", "max_tokens": 8000, "stream": True,
                                    "ignore_eos": True, "temperature": 0}) as r:
                results.append("".join(r.iter_text()))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: metrics(base)["hybridllm:num_requests_waiting"] == 2, "one running, two queued")
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(BOUND_S)
        code = proc.wait(BOUND_S)
        log = proc.stderr.read()
    assert code == 1, log
    assert "3 request(s) unfinished" in log
    assert len(results) == 3
    for text in results:
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"


def test_an_idle_keep_alive_connection_outlives_the_clients_pools(long_tiny):
    """An idle connection still answers after 6 s (clients' pools expire theirs at 5 s: httpx, the
    OpenAI SDK), so the client closes first: a server closing at the same time races a request
    sent on it (the soak below failed once that way)."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with serve_process("--model", str(long_tiny), "--max-batch", "1") as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            for pause in (0.0, 6.0):
                time.sleep(pause)
                sock.sendall(request)
                response = http.client.HTTPResponse(sock)
                response.begin()
                response.read()
                assert response.status == 200 and not response.will_close


# ---- soak: 300 requests, 10% aborted mid-stream, 10% never read -------------------------------------
SOAK_REQUESTS = 300
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3  # shared: whole prefix-cache pages


def soak_request(http: httpx.Client, port: int, model: str, i: int) -> tuple[str, Any]:
    """Request ``i`` of the soak (``http``: a client of the server, shared by the soak's threads):
    every tenth aborted after three chunks, every tenth (offset by 5) sent and never read, the rest
    chat or text, JSON or SSE, all checked."""
    if i % 10 == 0:  # the client goes away mid-stream (a response closed unread closes its connection)
        with http.stream("POST", "/v1/completions", json={
                "model": model, "prompt": f"{SYSTEM} story {i}", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data:")
        return "aborted", None
    if i % 10 == 5:  # a stream nobody reads: paused, then given up on by the server
        return "never_read", raw_request(port, "/v1/chat/completions", long_chat(
            model, max_tokens=5000, stream=True, logprobs=True, top_logprobs=20))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]
    stream = i % 3 == 0
    if i % 2:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 24,
                                                    "temperature": 0, "stream": stream})
    else:
        r = http.post("/v1/completions", json={"model": model, "prompt": f"{SYSTEM} {i}:", "max_tokens": 24,
                                               "stream": stream, "seed": i})
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-500:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return "ok", None


def soak_round(http: httpx.Client, port: int, model: str, indices: range, pool: Any) -> list[tuple[str, Any]]:
    """The requests ``indices`` of the soak, 16 at a time; then waits until every never-read stream
    of them has been given up on and the loop is empty. Returns their outcomes (the never-read
    sockets still open)."""
    base = str(http.base_url).rstrip("/")
    stalls = metrics(base)["hybridllm:stream_stalls_total"]
    outcomes = list(pool.map(lambda i: soak_request(http, port, model, i), indices))
    never_read = sum(kind == "never_read" for kind, _ in outcomes)
    wait_for(lambda: metrics(base)["hybridllm:stream_stalls_total"] == stalls + never_read,
             "every never-read stream given up on", poll_s=0.2)
    wait_for(lambda: (m := metrics(base))["hybridllm:num_requests_running"] == 0
             and m["hybridllm:num_requests_paused"] == 0, "the loop empty", poll_s=0.2)
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("prefix_ram", [0, 16 << 20], ids=["prefix-cache-off", "prefix-cache-16MiB"])
def test_soak_aborts_and_never_read_streams_leave_nothing_behind(long_tiny, prefix_ram, monkeypatch):
    """300 requests, 16 at a time: 30 aborted mid-stream, 30 never read (a 1 s stall timeout), the
    rest chat and text, JSON and SSE, sharing a system prompt, in two rounds of 150 of the same mix.
    RSS is compared between the ends of the two rounds: the first one grows the heap to the peak
    of the mix (a leak would grow it again in the second). The server runs with glibc's mmap threshold fixed at
    128 KiB, so that a freed KV cache goes back to the system: left dynamic, glibc raises the
    threshold after the first free and keeps every later KV cache's memory in its heap for reuse,
    and RSS would show the peak of concurrent reservations (5000 tokens per never-read stream)
    instead of what is held."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

    with serve_process("--model", str(long_tiny), "--threads", "1", "--max-batch", "16", "--stream-stall-timeout",
                       "1", "--prefix-cache-ram", str(prefix_ram)) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        model = model_of(base)
        server = psutil.Process(proc.pid)
        sockets = []
        try:
            with ThreadPoolExecutor(16) as pool, httpx.Client(base_url=base, timeout=BOUND_S) as http:
                start = metrics(base)
                first = soak_round(http, port, model, range(SOAK_REQUESTS // 2), pool)
                sockets += [sock for _, sock in first if sock is not None]
                rss_half = server.memory_info().rss
                second = soak_round(http, port, model, range(SOAK_REQUESTS // 2, SOAK_REQUESTS), pool)
                sockets += [sock for _, sock in second if sock is not None]
            end, rss_end = metrics(base), server.memory_info().rss
        finally:
            for sock in sockets:
                sock.close()

    def delta(name: str) -> float:
        return end[name] - start[name]

    kinds = [kind for kind, _ in first + second]
    assert kinds.count("ok") == 240 and kinds.count("aborted") == 30 and kinds.count("never_read") == 30
    assert delta("hybridllm:stream_stalls_total") == 30
    assert delta('hybridllm:request_success_total{finished_reason="abort"}') == 60
    assert end['hybridllm:request_success_total{finished_reason="error"}'] == 0
    assert end['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and end['hybridllm:kv_cache_bytes{tier="host"}'] == 0
    assert end["hybridllm:kv_cache_reserved_bytes"] == 0 and end["hybridllm:num_requests_waiting"] == 0
    assert end["hybridllm:num_requests_running"] == 0 and end["hybridllm:num_requests_paused"] == 0
    growth = rss_end - rss_half
    assert growth < 0.05 * rss_half + prefix_ram, (rss_half, rss_end, prefix_ram)
    if prefix_ram:
        assert end['hybridllm:prefix_cache_bytes{tier="host"}'] <= prefix_ram
        assert delta("hybridllm:prefix_cache_hits_total") > 0


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_the_stall_timeout_flag_is_checked_in_one_line(value):
    from typer.testing import CliRunner

    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["serve", "--stream-stall-timeout", value])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--stream-stall-timeout must be > 0" in lines[0]
