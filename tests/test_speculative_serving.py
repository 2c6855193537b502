"""Speculative decoding where users reach it (issue 35): the server (a request may turn it off; the
usage's ``completion_tokens_details``; vLLM's spec-decode counters on /metrics), the CLI flags, and
the bench (``--spec`` axis, ``--preset spec`` and its table)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from hybridllm import LLM, SamplingParams
from hybridllm.bench import spec_report
from hybridllm.bench.presets import build_preset_grid, resolve
from hybridllm.engine.scheduler import Scheduler
from hybridllm.server.app import create_app

from conftest import NEEDS_COMPILER
from spec_helpers import repetitive_prompt


@pytest.fixture(scope="module")
def spec_llm(tiny_models):
    return LLM(str(tiny_models["llama"][1]), spec="ngram", spec_ngram_min=1, spec_max_batch=0, threads=1)


def _sample(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"hybridllm:{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


@NEEDS_COMPILER
def test_server_reports_proposals_and_a_request_may_turn_speculation_off(spec_llm):
    app = create_app(spec_llm, Scheduler(spec_llm.runtime, max_batch=4))
    prompt = repetitive_prompt(spec_llm)
    body = {"model": app.state.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        on = client.post("/v1/completions", json=body).json()
        off = client.post("/v1/completions", json={**body, "speculative": False}).json()
        assert on["choices"][0]["text"] == off["choices"][0]["text"]  # the same text, either way
        details = on["usage"]["completion_tokens_details"]
        accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        assert accepted > 0 and details["speculative_draft_tokens"] == accepted + rejected
        assert details["speculative_acceptance_rate"] == pytest.approx(accepted / (accepted + rejected))
        assert details["speculative_drafts"] > 0
        assert off["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0, "speculative_drafts": 0,
            "speculative_draft_tokens": 0, "speculative_acceptance_rate": None}
        streamed = client.post("/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens_details"] == details  # greedy: the same proposals
        metrics = client.get("/metrics").text
        assert _sample(metrics, "spec_decode_num_drafts_total") == 2 * details["speculative_drafts"]
        assert _sample(metrics, "spec_decode_num_draft_tokens_total") == 2 * details["speculative_draft_tokens"]
        assert _sample(metrics, "spec_decode_num_accepted_tokens_total") == 2 * accepted
        first = _sample(metrics, "spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
        assert 0 < first <= 2 * details["speculative_drafts"]
        bad = client.post("/v1/completions", json={**body, "speculative": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        assert "speculative" in schema["ChatCompletionRequest"]["properties"]
        assert "speculative" in schema["CompletionRequest"]["properties"]
        assert "accepted_prediction_tokens" in schema["CompletionTokensDetails"]["properties"]


@NEEDS_COMPILER
def test_concurrent_requests_each_draft_for_themselves_and_are_verified_together(spec_llm, monkeypatch):
    """8 requests in flight at once: every sequence proposes for itself, steps verify rows of
    different lengths in one forward, and each text is the text of the same request without
    speculation."""
    from hybridllm.engine.executor import Executor

    n = 8
    base = repetitive_prompt(spec_llm)
    all_submitted = threading.Event()
    submitted: list[str] = []
    submit, execute = Scheduler.submit, Executor.execute

    def counting_submit(self, request_id, *args, **kwargs):
        seq = submit(self, request_id, *args, **kwargs)
        submitted.append(request_id)
        if len(submitted) >= n:
            all_submitted.set()
        return seq

    row_lengths: list[list[int]] = []

    def gated_execute(self, plan):  # the loop waits for the burst: the requests run together
        all_submitted.wait(60)
        row_lengths.append([len(row.token_ids) for row in plan.rows if not row.is_prompt])
        return execute(self, plan)

    monkeypatch.setattr(Scheduler, "submit", counting_submit)
    monkeypatch.setattr(Executor, "execute", gated_execute)
    app = create_app(spec_llm, Scheduler(spec_llm.runtime, max_batch=n))
    bodies = [{"model": app.state.model_name, "prompt": base[2 * i:], "max_tokens": 24, "temperature": 0,
               "ignore_eos": True} for i in range(n)]
    with TestClient(app) as client, ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda body: client.post("/v1/completions", json=body).json(), bodies))
        row_lengths_together = list(row_lengths)
        alone = [client.post("/v1/completions", json={**body, "speculative": False}).json() for body in bodies]
    assert [r["choices"][0]["text"] for r in together] == [r["choices"][0]["text"] for r in alone]
    drafts = [r["usage"]["completion_tokens_details"]["speculative_drafts"] for r in together]
    assert all(d > 0 for d in drafts), drafts  # each sequence proposed for itself
    assert sum(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for r in together) > 0
    mixed = [lengths for lengths in row_lengths_together
             if len(lengths) >= 2 and max(lengths) > 1 and len(set(lengths)) > 1]
    assert mixed, "no step verified rows of different lengths together"
    assert max(len(lengths) for lengths in row_lengths_together) == n  # all eight decoded in one step


# ---- the CLI ----------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridllm.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@NEEDS_COMPILER
def test_generate_json_reports_the_proposals(tiny_models):
    model = str(tiny_models["llama"][1])
    done = _cli("generate", "--model", model, "--no-chat", "--temperature", "0", "--max-tokens", "24",
                "--ignore-eos", "--spec", "ngram", "--spec-ngram-min", "1", "--draft-max", "6", "--json",
                "The quick brown fox. The quick brown fox. The quick brown")
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)["metrics"]
    assert metrics["spec_method"] == "ngram" and metrics["spec_drafts"] > 0
    assert {"spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate"} <= set(metrics)


@pytest.mark.parametrize("args, needle", [
    (["--spec", "medusa"], "--spec must be one of none, ngram, draft"),
    (["--spec", "ngram", "--spec-ngram-min", "5", "--spec-ngram-max", "3"], "--spec-ngram-min"),
    (["--spec", "ngram", "--draft-max", "0"], "--draft-max"),
    (["-ngld", "2"], "it needs --model-draft"),
    (["--model-draft", "/no/such/draft.gguf"], "/no/such/draft.gguf"),
])
def test_bad_speculative_flags_are_one_line_errors(args, needle):
    from typer.testing import CliRunner

    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "--max-tokens", "2", *args])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_command_hands_the_speculative_flags_to_the_engine(command, monkeypatch):
    """generate, chat and serve build their ``LLM`` with the flags (stopped just before loading)."""
    from typer.testing import CliRunner

    from hybridllm.cli import app
    from hybridllm.errors import ConfigError

    seen: dict = {}

    def recording_init(self, *args, **kwargs):
        seen.update(kwargs)
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(LLM, "__init__", recording_init)
    args = [command, *(["hi"] if command == "generate" else []), "--spec", "ngram", "--spec-ngram-max", "5",
            "--spec-ngram-min", "3", "--draft-max", "7", "--draft-min", "2", "--spec-max-batch", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "stopped before loading" in result.stderr, result.output
    assert {k: seen[k] for k in ("spec", "spec_ngram_max", "spec_ngram_min", "draft_max", "draft_min",
                                 "spec_max_batch")} == {
        "spec": "ngram", "spec_ngram_max": 5, "spec_ngram_min": 3, "draft_max": 7, "draft_min": 2, "spec_max_batch": 8}


def test_a_draft_model_of_another_vocabulary_is_a_one_line_cli_error(tiny_models, tmp_path):
    from tiny_models import build_hf_model

    other = tmp_path / "other"
    build_hf_model(other, "llama", tokenizer_style="qwen2")
    done = _cli("generate", "hi", "--model", str(tiny_models["llama"][1]), "--model-draft", str(other),
                "--max-tokens", "2", "--threads", "1")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "same vocabulary" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


# ---- the bench ----------------------------------------------------------------------------------------
def test_spec_preset_runs_each_workload_with_and_without_speculation_beside_prompt_lookup(default_model_path):
    settings = resolve("spec")
    assert settings["workloads"] == ["rewrite", "quote", "chat"] and settings["specs"] == ["none", "ngram"]
    assert settings["serve_concurrency"] == 16  # then serve without and with --spec ngram, 16 requests at once
    grid = build_preset_grid(settings, model=str(default_model_path), new_tokens=settings["new_tokens"],
                             threads=2, weights="auto")
    assert {(c.workload, c.engine, c.spec) for c in grid} == {
        (w, e, s) for w in ("rewrite", "quote", "chat") for e in ("hybridllm", "llama.cpp") for s in ("none", "ngram")}
    lengths = {c.workload: c.context for c in grid}
    assert 550 <= lengths["rewrite"] <= 750 and 500 <= lengths["quote"] <= 700 and lengths["chat"] < 100
    assert all(c.threads == 2 for c in grid)
    assert {c.workload: c.new_tokens for c in grid} == {"rewrite": 768, "quote": 768, "chat": 128}
    assert len({c.context for c in grid if c.workload == "rewrite"}) == 1  # every engine the same prompt ids


def _row(engine: str, spec: str, decode: float, **extra) -> dict:
    return {"engine": engine, "model": "m", "spec": spec, "workload": "rewrite", "context": 620, "new_tokens": 768,
            "status": "ok", "error": None,
            "decode_tps": decode, "generated_tokens": 600, **extra}


def test_spec_table_puts_speed_ups_and_acceptance_side_by_side():
    rows = [_row("llama.cpp", "ngram", 50.0), _row("hybridllm", "none", 40.0),
            _row("hybridllm", "ngram", 100.0, spec_draft_tokens=500, spec_accepted_tokens=450),
            _row("llama.cpp", "none", 40.0),
            {**_row("hybridllm", "ngram", 0.0), "workload": "chat", "status": "error", "error": "boom"}]
    cells, notes = spec_report.records(rows)
    by = {(c[0], c[1], c[2]): c for c in cells}
    ours = by[("rewrite", "hybridllm", "ngram")]
    assert ours[6] == "450 / 500 (90 %)" and ours[7] == "2.50x" and ours[8] == "2.00x"
    assert by[("rewrite", "llama.cpp", "prompt lookup")][7] == "1.25x"
    assert by[("chat", "hybridllm", "ngram")][-1] == "error [1]" and "boom" in notes[0]
    machine = {"cpu": "CPU X", "kernel_isa": "avx512-vnni", "cores": 2, "ram_bytes": 2**33, "os": "Linux",
               "python": "3.11", "torch": "2", "llama-cpp-python": "0.3.36"}
    text = spec_report.section(rows, machine, {"command": "hybridllm bench --preset spec --threads 2", "threads": 2,
                                               "started": "2026-01-01T10:00:00", "load_average": [0.1, 0.2],
                                               "new_tokens": 768, "repeat": 3})
    assert text.startswith("## Speculative decoding") and "CPU X (native kernels: avx512-vnni)" in text
    assert "hybridllm bench --preset spec --threads 2" in text and "| rewrite | hybridllm | ngram |" in text
    assert "new tokens at most chat 768, rewrite 768" in text and "median of 3 run(s)" in text


def _burst(speculation: str, tokens_per_s: float, failed: int = 0, **extra) -> dict:
    return {"speculation": speculation, "round": 1, "concurrency": 16, "max_tokens": 128, "failed": failed,
            "errors": [], "generated_tokens_per_s": tokens_per_s, "draft_tokens": 0, "accepted_tokens": 0, **extra}


def test_spec_section_adds_the_serving_comparison():
    serve_rows = [_burst("none", 100.0), _burst("ngram", 90.0, draft_tokens=40, accepted_tokens=10),
                  _burst("none", 120.0), _burst("ngram", 150.0, draft_tokens=60, accepted_tokens=30),
                  _burst("none", 110.0), _burst("ngram", 999.0, failed=1),  # a burst with a failure is not counted
                  {"speculation": "ngram", "round": 4, "error": "the server exited with code 1"}]
    cells = {c[0]: c for c in spec_report.serve_records(serve_rows)}
    assert cells["serve"][2] == "110.0" and cells["serve"][3] == "1.00x" and cells["serve"][5] == "3 / 3"
    ours = cells["serve --spec ngram"]
    assert ours[2] == "120.0" and ours[3] == "1.09x" and ours[4] == "40 / 100 (40 %)" and ours[5] == "2 / 4"
    machine = {"cpu": "CPU X", "kernel_isa": "avx2", "cores": 2, "ram_bytes": 2**33, "os": "Linux",
               "python": "3.11", "torch": "2", "llama-cpp-python": "0.3.36"}
    text = spec_report.section([_row("hybridllm", "none", 40.0)], machine, {"threads": 2, "repeat": 3}, serve_rows)
    assert "### Serving 16 concurrent requests" in text and "| serve --spec ngram | 16 | 120.0 | 1.09x |" in text


@pytest.mark.slow
def test_serving_comparison_runs_both_servers_on_the_same_burst(tiny_models):
    """``bench --preset spec``'s serving part on a tiny model: a server without and one with
    ``--spec ngram``, the same concurrent greedy requests, the same tokens generated."""
    from hybridllm.bench.spec_serve import compare_serving

    rows = compare_serving(["--model", str(tiny_models["llama"][1])], threads=1, rounds=1, concurrency=4,
                           max_tokens=24)
    assert [r["speculation"] for r in rows] == ["none", "ngram"]
    assert all(r["succeeded"] == 4 and r["failed"] == 0 for r in rows), rows
    assert rows[0]["generated_tokens"] == rows[1]["generated_tokens"] > 0
    assert rows[0]["draft_tokens"] == 0 and rows[1]["draft_tokens"] >= rows[1]["accepted_tokens"]


@pytest.mark.slow
def test_spec_rows_measure_our_proposals_and_llama_cpps_prompt_lookup_on_one_prompt(default_model_path):
    from hybridllm.bench.sweep import BenchConfig
    from hybridllm.bench.worker import measure_row

    pytest.importorskip("llama_cpp")
    common = dict(model=str(default_model_path), workload="quote", context=600, new_tokens=10, threads=2,
                  weights="auto", warmup=False)
    config = build_preset_grid(resolve("spec", workloads=["quote"]), **{k: v for k, v in common.items()
                                                                          if k not in ("workload", "context")})[0]
    common["context"] = config.context
    ours = measure_row(BenchConfig(spec="ngram", **common))
    theirs = measure_row(BenchConfig(engine="llama.cpp", spec="ngram", **common))
    assert ours["status"] == "ok" and theirs["status"] == "ok", (ours["error"], theirs["error"])
    assert ours["spec_draft_tokens"] > 0 and ours["spec_accepted_tokens"] > 0
    assert theirs["spec_draft_tokens"] is None and "LlamaPromptLookupDecoding" in theirs["variant"]
    assert ours["prompt_tokens"] == theirs["prompt_tokens"] == config.context


def test_speculative_flags_default_to_the_engine_defaults():
    import dataclasses
    import inspect

    from hybridllm.cli.options import SpeculativeOptions
    from hybridllm.config import SpeculativeConfig

    flags = dataclasses.asdict(SpeculativeOptions())
    assert flags == dataclasses.asdict(SpeculativeConfig())
    llm = inspect.signature(LLM.__init__).parameters
    assert {name: llm[name].default for name in flags} == flags
