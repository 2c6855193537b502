"""The OpenAI-compatible server, end to end: a real ``hybridllm serve`` on a free loopback port
with the default model, driven by the official ``openai`` client (and httpx for raw HTTP).

Also an in-process uvicorn server built with the app factory (API key, full queue, KV budget
errors, two apps in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import httpx
import psutil
import pytest
from conftest import OPENAI_MISSING, import_extra
from serving_helpers import CHAT_PROMPTS, MAX_TOKENS, reference

from hybridllm.bench.ports import free_port

openai = import_extra("openai", OPENAI_MISSING)

pytestmark = pytest.mark.slow  # servers in their own processes, a soak test

STARTUP_TIMEOUT_S = 300


def wait_healthy(base: str, proc: subprocess.Popen | None = None, expect: int = 200) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == expect:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy")


@contextlib.contextmanager
def serve_process(*args: str):
    """``hybridllm serve ARGS`` on a free loopback port, healthy: yields (base URL, process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridllm.cli", "serve", "--port", str(port), "--log-level", "warning", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server():
    """``hybridllm serve`` of the default model in a subprocess: (base URL, process)."""
    with serve_process("--max-batch", "16", "--weights", "float") as running:  # default_llm's weights
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{labels}': value} (label ``model_name`` dropped)."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
        out[key] = float(value)
    return out


def metrics_mid_stream(base: str, body: dict) -> dict[str, float]:
    """Start streaming ``body`` to /v1/completions, scrape /metrics after its first 3 chunks, then
    disconnect (closing the stream mid-way)."""
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        # keep the line iterator referenced: dropping it mid-stream makes httpx close the connection
        lines = response.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data:")
        return metrics(base)


def chat(client, model_id, prompt, **kw):
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


# ---- basics ------------------------------------------------------------------------------------
def test_startup_line_names_the_model_as_models_does_and_the_cpu(server, model_id):
    """The line serve prints at start: the model's one name (as /v1/models, `models` and chat say
    it) and, on a CPU-only machine, "layers on the CPU" (not "on the device")."""
    from hybridllm.config import resolve_device

    proc = server[1]
    line = next(text for text in iter(proc.stderr.readline, "") if text.startswith("serving "))
    assert line.startswith(f"serving {model_id} on http://127.0.0.1:"), line
    if resolve_device("auto") == "cpu":
        assert "30 layers on the CPU" in line and "device" not in line, line


def test_models_health_and_openapi(server, client, model_id):
    base = server[0]
    assert model_id == "SmolLM2-135M-Instruct.Q4_1"
    card = client.models.list().data[0]
    assert card.object == "model" and card.owned_by == "hybridllm"
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok"
    schema = httpx.get(f"{base}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert path in schema["paths"]
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_chat_completion_text_and_usage_equal_the_engine(client, model_id, default_llm):
    prompt = CHAT_PROMPTS[0]
    ref = reference(default_llm, prompt)
    out = chat(client, model_id, prompt, max_tokens=MAX_TOKENS)
    assert out.object == "chat.completion" and out.model == model_id
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    template = default_llm.apply_chat_template([{"role": "user", "content": prompt}])
    assert out.usage.prompt_tokens == len(default_llm.tokenizer.encode(template, add_special_tokens=False))
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streaming_with_usage(client, model_id, default_llm):
    prompt = CHAT_PROMPTS[1]
    ref = reference(default_llm, prompt)
    chunks = list(chat(client, model_id, prompt, max_tokens=MAX_TOKENS, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    no_usage = list(chat(client, model_id, prompt, max_tokens=4, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_text_completion_streaming_and_not(client, model_id, default_llm):
    prompt = "Once upon a time"
    ref = reference(default_llm, ("raw", prompt), 12)
    out = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(default_llm.tokenizer.encode(prompt)) == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    by_ids = client.completions.create(model=model_id, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == ref.text


def test_stop_strings(client, model_id, default_llm):
    prompt = CHAT_PROMPTS[0]
    full = reference(default_llm, prompt).text
    assert "Paris" in full
    out = chat(client, model_id, prompt, max_tokens=MAX_TOKENS, stop=["Paris"])
    assert out.choices[0].message.content == full[: full.index("Paris")]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(reference(default_llm, prompt, MAX_TOKENS, ("Paris",)).token_ids)
    streamed = chat(client, model_id, prompt, max_tokens=MAX_TOKENS, stop="Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index("Paris")]


def test_sampling_with_a_seed_is_reproducible(client, model_id):
    kw = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell a story."}], **kw)
    b = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell a story."}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


# ---- greedy == `hybridllm generate`, alone and batched with 7 others -------------------------------
@pytest.fixture(scope="module")
def cli_reference() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "hybridllm.cli", "generate", CHAT_PROMPTS[0], "--temperature", "0",
         "--max-tokens", str(MAX_TOKENS), "--weights", "float", "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_greedy_equals_cli_generate_alone_and_batched_with_seven_others(server, client, model_id, cli_reference,
                                                                       default_llm):
    base = server[0]
    alone = chat(client, model_id, CHAT_PROMPTS[0], max_tokens=MAX_TOKENS)
    assert alone.choices[0].message.content == cli_reference["text"]
    assert alone.usage.completion_tokens == len(cli_reference["token_ids"])
    refs = [reference(default_llm, p) for p in CHAT_PROMPTS]  # before the burst, so it all runs batched
    before = metrics(base)
    barrier = threading.Barrier(len(CHAT_PROMPTS))

    def one(prompt: str):
        barrier.wait()
        return chat(client, model_id, prompt, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        outs = list(pool.map(one, CHAT_PROMPTS))
    assert outs[0].choices[0].message.content == cli_reference["text"]
    for out, ref in zip(outs, refs):
        assert out.choices[0].message.content == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
    after = metrics(base)
    batched_steps = (after["hybridllm:decode_batch_size_count"] - before["hybridllm:decode_batch_size_count"]) - (
        after['hybridllm:decode_batch_size_bucket{le="4.0"}'] - before['hybridllm:decode_batch_size_bucket{le="4.0"}'])
    assert batched_steps > 0  # some decode steps ran more than four sequences in one forward


# ---- validation ------------------------------------------------------------------------------------
def assert_error(exc_info, status: int, param: str | None = None) -> dict:
    err = exc_info.value
    assert err.status_code == status
    body = err.body
    assert set(body) >= {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param
    return body


def test_invalid_requests_get_openai_error_objects(server, client, model_id):
    base = server[0]
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "no-such-model", "messages": msgs, "max_tokens": 4}, "model"),
        ({"model": model_id, "messages": msgs, "max_tokens": -1}, "max_tokens"),
        ({"model": model_id, "messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"model": model_id, "messages": msgs, "max_tokens": 10**9}, "max_tokens"),
        ({"model": model_id, "messages": [], "max_tokens": 4}, "messages"),
        ({"model": model_id, "messages": msgs, "max_tokens": 4, "n": 1000}, "n"),  # more than --max-batch
        ({"model": model_id, "messages": msgs, "max_tokens": 4, "temperature": 5}, "temperature"),
        ({"model": model_id, "messages": msgs, "max_tokens": 4, "stop": [""]}, None),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.chat.completions.create(**kwargs)
        assert_error(exc_info, 400, param)
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.chat.completions.create(model=model_id, messages=msgs, extra_body={"max_tokens": "ten"})
    assert_error(exc_info, 400, "max_tokens")
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=model_id, prompt="hi", max_tokens=4, extra_body={"temperature": "hot"})
    assert_error(exc_info, 400, "temperature")
    raw = [
        httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(f"{base}/v1/chat/completions", json={"model": model_id, "messages": "hello"}),
        httpx.post(f"{base}/v1/chat/completions", json={"model": model_id, "messages": [{"role": "user"}],
                                                        "max_tokens": True}),
        httpx.post(f"{base}/v1/completions", json={"model": model_id}),
        httpx.post(f"{base}/v1/completions", json={"model": model_id, "prompt": [10**9], "max_tokens": 2}),
    ]
    for response in raw:
        assert response.status_code in (400, 422), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in raw[0].json()["error"]["message"]
    assert httpx.get(f"{base}/v1/nothing-here").json()["error"]["type"] == "not_found_error"


# ---- disconnects, soak ------------------------------------------------------------------------------
def test_disconnecting_a_streaming_client_frees_its_kv(server, model_id):
    base = server[0]
    aborted = metrics(base)['hybridllm:request_success_total{finished_reason="abort"}']
    body = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    during = metrics_mid_stream(base, body)  # the client disconnects after 3 chunks
    assert during["hybridllm:num_requests_running"] == 1
    assert during['hybridllm:kv_cache_bytes{tier="device"}'] > 0
    deadline = time.monotonic() + 60  # a bound, not a timing assertion: freed at the next step
    while time.monotonic() < deadline:
        now = metrics(base)
        if now['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and now["hybridllm:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert now['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and now['hybridllm:kv_cache_bytes{tier="host"}'] == 0
    assert now["hybridllm:num_requests_running"] == 0
    assert now['hybridllm:request_success_total{finished_reason="abort"}'] == aborted + 1
    assert now['hybridllm:generation_tokens_total'] < during['hybridllm:generation_tokens_total'] + 1000


def test_soak_300_short_requests_returns_kv_to_zero_and_rss_stays_flat(server, model_id):
    base, proc = server
    server_process = psutil.Process(proc.pid)
    prompts = [f"Count to {i % 10}:" for i in range(300)]
    rss_after_50 = None

    def one(prompt: str) -> str:
        with httpx.Client(timeout=300) as http:
            r = http.post(f"{base}/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(one, prompts[:50]))
        rss_after_50 = server_process.memory_info().rss
        rest = list(pool.map(one, prompts[50:]))
    assert set(first + rest) <= {"stop", "length"} and len(first + rest) == 300
    rss_end = server_process.memory_info().rss
    m = metrics(base)
    assert m['hybridllm:kv_cache_bytes{tier="device"}'] == 0 and m['hybridllm:kv_cache_bytes{tier="host"}'] == 0
    assert m["hybridllm:kv_cache_reserved_bytes"] == 0
    assert m["hybridllm:num_requests_running"] == 0 and m["hybridllm:num_requests_waiting"] == 0
    assert (rss_end - rss_after_50) / rss_after_50 < 0.05, (rss_after_50, rss_end)


def test_metrics_names_follow_vllm(server):
    text = httpx.get(f"{server[0]}/metrics").text
    for name in ("hybridllm:time_to_first_token_seconds_bucket", "hybridllm:inter_token_latency_seconds_bucket",
                 "hybridllm:e2e_request_latency_seconds_bucket", "hybridllm:request_queue_time_seconds_bucket",
                 "hybridllm:prompt_tokens_total", "hybridllm:generation_tokens_total",
                 "hybridllm:request_success_total", "hybridllm:num_requests_running",
                 "hybridllm:num_requests_waiting", "hybridllm:kv_cache_bytes", "hybridllm:kv_cache_pages",
                 "hybridllm:bus_bytes_total", "hybridllm:request_prefill_time_seconds_bucket",
                 "hybridllm:request_decode_time_seconds_bucket", "hybridllm:placement_info"):
        assert name in text, name
    m = metrics(server[0])
    assert m['hybridllm:request_success_total{finished_reason="stop"}'] > 0
    assert m["hybridllm:prompt_tokens_total"] > 0 and m["hybridllm:time_to_first_token_seconds_count"] > 0


def test_tight_vram_budget_request_finishes_on_the_host_and_is_counted(default_llm):
    # the device tier holds the weights and ~20 tokens of KV: the adaptive policy (on by default)
    # moves the request's decoding to the host mid-prefill instead of refusing or failing it
    budget = default_llm.weight_bytes["device"] + 1_000_000
    prompt = CHAT_PROMPTS[0]
    with serve_process("--weights", "float", "--vram-budget", str(budget)) as (base, _proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        out = chat(client, client.models.list().data[0].id, prompt, max_tokens=MAX_TOKENS)
        m = metrics(base)
    assert out.choices[0].message.content == reference(default_llm, prompt).text
    assert m['hybridllm:adaptive_actions_total{action="move_to_host"}'] == 1
    assert m['hybridllm:adaptive_actions_total{action="shrink_hot_window"}'] == 0
    assert m['hybridllm:request_success_total{finished_reason="length"}'] + \
        m['hybridllm:request_success_total{finished_reason="stop"}'] == 1


# ---- in-process: the app factory, API key, full queue, KV budget ----------------------------------
class InProcessServer:
    """uvicorn serving an app in a background thread of this process."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_api_key_full_queue_and_kv_budget_in_process(default_llm):
    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.server.app import create_app

    # the scheduler is never started: requests stay queued, which makes the queue checks exact
    sched = Scheduler(default_llm.runtime, max_batch=1, max_queue=1)
    app = create_app(default_llm, sched, api_key="s3cret", manage_scheduler=False)
    create_app(default_llm, Scheduler(default_llm.runtime), manage_scheduler=False)  # a second app: its own metrics registry
    with InProcessServer(app) as srv:
        base = srv.base
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(f"{base}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        model = good.models.list().data[0].id
        assert httpx.get(f"{base}/health").status_code == 503  # the scheduler is not running
        assert httpx.get(f"{base}/metrics").status_code == 200  # no key needed
        auth = {"Authorization": "Bearer s3cret"}
        body = {"model": model, "prompt": "hi", "max_tokens": 8, "stream": True}
        with httpx.Client(timeout=60, headers=auth) as http:
            with http.stream("POST", f"{base}/v1/completions", json=body) as first:
                assert first.status_code == 200
                deadline = time.monotonic() + 30
                while sched.num_waiting != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                full = http.post(f"{base}/v1/completions", json={**body, "stream": False})
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                assert full.json()["error"]["code"] == "queue_full"
            deadline = time.monotonic() + 30  # the client left: its queued request is dropped
            while sched.num_waiting:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sched.capacity = 10 * sched.token_bytes * sched.page_size  # a tiny KV budget
            with pytest.raises(openai.BadRequestError) as exc_info:
                good.completions.create(model=model, prompt="hi", max_tokens=11 * sched.page_size)
            assert assert_error(exc_info, 400, "max_tokens")["code"] == "kv_budget_exceeded"
        text = httpx.get(f"{base}/metrics").text
        assert re.search(r'hybridllm:request_rejected_total\{[^}]*reason="queue_full"\} 1\.0', text)
        assert re.search(r'hybridllm:request_rejected_total\{[^}]*reason="kv_budget"\} 1\.0', text)


# ---- placement flags on serve ---------------------------------------------------------------------
def test_serve_with_a_split_placement_and_host_decode(tiny_models, tmp_path):
    from hybridllm import LLM, SamplingParams

    folder = tiny_models["llama"][0]
    with serve_process("--model", str(folder), "-ngl", "1", "--decode-on", "host") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        prompts = ["The quick brown fox", "Paris is", "hello world"]
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model=model, prompt=p, max_tokens=8,
                                                                     temperature=0).choices[0].text, prompts))
        engine = LLM(model=folder)
        params = SamplingParams(max_tokens=8, temperature=0)
        assert texts == [engine.generate(p, params).text for p in prompts]
        text = httpx.get(f"{base}/metrics").text
        info = re.search(r'hybridllm:placement_info\{([^}]*)\}', text).group(1)
        assert 'decode_on="host"' in info and 'n_gpu_layers="1"' in info, info
        assert re.search(r'hybridllm:placement_layers\{[^}]*tier="host"\} 1\.0', text)
    bad = tmp_path / "bad.json"
    bad.write_text('{"layer_tiers": 3}')
    done = subprocess.run([sys.executable, "-m", "hybridllm.cli", "serve", "--model", str(folder), "--placement",
                           str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "placement" in done.stderr


# ---- issue 20: endpoints, refused fields, limits, metrics, the dashboard, SIGTERM -------------------
@pytest.fixture(scope="module")
def live(default_llm):
    """An in-process server of the default model (its own request loop, started): (base, client, model)."""
    from hybridllm.engine.scheduler import Scheduler
    from hybridllm.server.app import create_app

    app = create_app(default_llm, Scheduler(default_llm.runtime, max_batch=4), max_request_bytes=64 * 1024)
    with InProcessServer(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=300)
        yield srv.base, client, client.models.list().data[0].id


def test_tokenize_detokenize_version_model_by_id_and_fingerprint(live, default_llm):
    base, client, model = live
    text = "What is the capital of France? café 🤗"
    ids = httpx.post(f"{base}/tokenize", json={"content": text}).json()["tokens"]
    assert ids == default_llm.tokenizer.encode(text, add_special_tokens=False)
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json() == {"content": text}
    special = httpx.post(f"{base}/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert special == default_llm.tokenizer.encode(text, add_special_tokens=True)
    pieces = httpx.post(f"{base}/tokenize", json={"content": "Paris is big", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == default_llm.tokenizer.encode("Paris is big", add_special_tokens=False)
    assert "".join(p["piece"] for p in pieces) == "Paris is big"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base}/tokenize", json={"content": 5}).status_code == 400

    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc_info:
        client.models.retrieve("no-such-model")
    assert assert_error(exc_info, 404, "model")["code"] == "model_not_found"

    version = httpx.get(f"{base}/version").json()
    fingerprint = version["system_fingerprint"]
    assert re.fullmatch(r"hl-[0-9a-f]{10}", fingerprint) and version["model"] == model and version["version"]
    out = chat(client, model, "hi", max_tokens=2)
    assert out.system_fingerprint == fingerprint
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).system_fingerprint == fingerprint
    chunks = list(chat(client, model, "hi", max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(c.system_fingerprint == fingerprint for c in chunks)
    streamed = list(client.completions.create(model=model, prompt="hi", max_tokens=3, stream=True))
    assert streamed and all(c.system_fingerprint == fingerprint for c in streamed)
    schema = httpx.get(f"{base}/openapi.json").json()
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models/{model_id}"):
        assert path in schema["paths"], path


def test_unsupported_fields_are_refused_by_name_and_neutral_or_unknown_ones_pass(live):
    from hybridllm.server.unsupported import UNSUPPORTED_FIELDS

    _base, client, model = live
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    asking = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": "yes",
              "functions": [tool["function"]], "function_call": {"name": "f"},
              "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
              "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "suffix": " end",
              "best_of": 2}
    assert set(asking) == {field.name for field in UNSUPPORTED_FIELDS}  # every row of the table is exercised
    on_chat = {"tools", "tool_choice", "parallel_tool_calls"}  # implemented on chat (tests/test_structured_output.py)
    for name, value in asking.items():
        if name not in on_chat:
            with pytest.raises(openai.BadRequestError) as exc_info:
                client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={name: value})
            assert assert_error(exc_info, 400, name)["code"] == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={name: value})
        assert_error(exc_info, 400, name)
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "modalities": ["text"], "not_an_openai_field": {"anything": 1}}
    out = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body=neutral)
    assert out.choices[0].finish_reason in ("stop", "length")
    for seed in (2**70, -(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=2, seed=seed)
        assert_error(exc_info, 400, "seed")
    assert chat(client, model, "hi", max_tokens=2, seed=2**63 - 1).choices[0].finish_reason in ("stop", "length")


def test_request_body_over_the_limit_gets_413_with_an_error_object(live):
    base, _client, model = live
    refused_key = 'hybridllm:request_rejected_total{reason="request_too_large"}'
    refused_before = metrics(base)[refused_key]
    big = {"model": model, "messages": [{"role": "user", "content": "x" * (65 * 1024)}], "max_tokens": 2}
    r = httpx.post(f"{base}/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunked():  # no Content-Length: counted as it arrives
        yield json.dumps(big).encode()

    r = httpx.post(f"{base}/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert metrics(base)[refused_key] == refused_before + 2
    small = {"model": model, "messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=small, timeout=300).status_code == 200


def test_metrics_counters_kv_usage_and_phase_histograms(live):
    base, _client, model = live
    text = httpx.get(f"{base}/metrics").text
    assert "# TYPE hybridllm:bus_bytes_total counter" in text and "hybridllm:bus_bytes_total{" in text
    assert re.search(r"^hybridllm:bus_bytes[{ ]", text, re.M) is None  # no gauge left under the old name
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    during = metrics_mid_stream(base, body)
    assert during["hybridllm:kv_cache_holdable_bytes"] > 0
    assert 0 < during["hybridllm:kv_cache_usage_perc"] <= 1  # not 0 although no budget was set
    assert during["hybridllm:kv_cache_usage_perc"] == pytest.approx(
        during["hybridllm:kv_cache_reserved_bytes"] / during["hybridllm:kv_cache_holdable_bytes"])
    before = metrics(base)
    chat(openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300), model, "hi", max_tokens=4)
    after = metrics(base)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds"):
        assert after[f"hybridllm:{name}_count"] == before[f"hybridllm:{name}_count"] + 1, name
        assert after[f"hybridllm:{name}_sum"] >= before[f"hybridllm:{name}_sum"]


PROMQL_FUNCTIONS_AND_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers not followed by ``(``, outside
    label matchers, ranges and strings."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, legend parts)
    bare = re.sub(r"\{[^}]*\}", "", bare)  # label matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)  # label lists
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        name, rest = match.group(), bare[match.end():].lstrip()
        if rest.startswith("(") or name in PROMQL_FUNCTIONS_AND_KEYWORDS:
            continue  # a function call or a keyword
        names.add(name)
    return names


def test_every_grafana_dashboard_query_resolves_against_a_live_metrics_scrape(live):
    from pathlib import Path

    base, client, model = live
    chat(client, model, "hi", max_tokens=4)  # every histogram has a sample
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 16
    scrape = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line and not line.startswith("#")]
    exposed = {line.split("{")[0].split(" ")[0] for line in scrape}
    for variable in dashboard["templating"]["list"]:  # Grafana's label_values(metric, label), not PromQL
        if "definition" in variable:
            metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"]).groups()
            assert any(line.startswith(metric + "{") and f'{label}="' in line for line in scrape), variable
    used = set()
    for expr in exprs:
        names = promql_metric_names(expr.replace("$__rate_interval", "1m"))
        assert names, expr
        for name in names:
            assert name.startswith("hybridllm:"), (name, expr)
            assert name in exposed, (name, expr)
        used |= names
    for name in ("hybridllm:request_prefill_time_seconds_bucket", "hybridllm:request_decode_time_seconds_sum",
                 "hybridllm:bus_bytes_total", "hybridllm:kv_cache_usage_perc"):
        assert name in used, name


def test_promql_metric_names_reads_only_metrics():
    expr = ('histogram_quantile(0.99, sum by(le) (rate(hybridllm:x_bucket{model_name="$m", a=~"b|c"}[5m]))) '
            '/ on(model_name) hybridllm:y')
    assert promql_metric_names(expr) == {"hybridllm:x_bucket", "hybridllm:y"}


def test_sigterm_finishes_four_inflight_streams_refuses_new_requests_and_exits_zero():
    with serve_process("--weights", "float", "--max-batch", "4", "--shutdown-grace", "120") as (base, proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        max_tokens = 64
        started = threading.Barrier(5)

        def stream(prompt: str) -> tuple[str, list]:
            chunks = []
            for i, c in enumerate(client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}, stream_options={"include_usage": True})):
                chunks.append(c)
                if i == 1:
                    started.wait()
            return prompt, chunks

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, p) for p in ("The quick brown fox", "Paris is", "hello world", "One two")]
            started.wait()  # all four streams are under way
            assert metrics(base)["hybridllm:num_requests_running"] == 4
            proc.send_signal(subprocess.signal.SIGTERM)
            deadline = time.monotonic() + 60
            refused = None
            while refused is None and time.monotonic() < deadline:
                try:
                    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                                   timeout=30)
                except httpx.TransportError:
                    break  # already closed: every stream finished
                if r.status_code == 503:
                    refused = r
            results = [f.result() for f in futures]
        assert proc.wait(120) == 0, proc.stderr.read()
    assert refused is not None and refused.json()["error"]["code"] == "shutting_down"
    for _prompt, chunks in results:
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["length"]
        assert chunks[-1].usage.completion_tokens == max_tokens


def test_draining_refusals_are_counted():
    """Each request refused while draining calls the rejection hook once; /health passes."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from hybridllm.server.shutdown import Draining, RefuseWhileDraining

    refused = []
    draining = Draining()
    inner = Starlette(routes=[Route("/v1/models", lambda _r: PlainTextResponse("ok")),
                              Route("/health", lambda _r: PlainTextResponse("ok"))])
    app = RefuseWhileDraining(inner, draining=draining, on_refused=lambda: refused.append(1))

    async def run() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            codes = [(await client.get("/v1/models")).status_code]
            draining.begin()
            codes += [(await client.get("/v1/models")).status_code, (await client.get("/health")).status_code]
            return codes

    assert asyncio.run(run()) == [200, 503, 200]
    assert refused == [1]
