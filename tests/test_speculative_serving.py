"""Speculative decoding where users reach it (issue 35): the server (a request may turn it off; the
usage's ``completion_tokens_details``; vLLM's spec-decode counters on /metrics), the CLI flags, and
the bench (``--spec`` axis, ``--preset spec`` and its table)."""

from __future__ import annotations

import json
import subprocess
import sys

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
    return LLM(str(tiny_models["llama"][1]), spec="ngram", spec_ngram_min=1, threads=1)


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


# ---- the bench ----------------------------------------------------------------------------------------
def test_spec_preset_runs_each_workload_with_and_without_speculation_beside_prompt_lookup(default_model_path):
    settings = resolve("spec")
    assert settings["workloads"] == ["rewrite", "quote", "chat"] and settings["specs"] == ["none", "ngram"]
    grid = build_preset_grid(settings, model=str(default_model_path), new_tokens=settings["new_tokens"],
                             threads=2, weights="auto")
    assert {(c.workload, c.engine, c.spec) for c in grid} == {
        (w, e, s) for w in ("rewrite", "quote", "chat") for e in ("hybridllm", "llama.cpp") for s in ("none", "ngram")}
    lengths = {c.workload: c.context for c in grid}
    assert 550 <= lengths["rewrite"] <= 750 and 500 <= lengths["quote"] <= 700 and lengths["chat"] < 100
    assert all(c.threads == 2 for c in grid)
    assert len({c.context for c in grid if c.workload == "rewrite"}) == 1  # every engine the same prompt ids


def _row(engine: str, spec: str, decode: float, **extra) -> dict:
    return {"engine": engine, "model": "m", "spec": spec, "workload": "rewrite", "context": 620, "status": "ok", "error": None,
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


@pytest.mark.slow
def test_spec_rows_measure_our_proposals_and_llama_cpps_prompt_lookup_on_one_prompt(default_model_path):
    from hybridllm.bench.sweep import BenchConfig
    from hybridllm.bench.worker import measure_row

    pytest.importorskip("llama_cpp")
    common = dict(model=str(default_model_path), workload="quote", context=600, new_tokens=24, threads=2,
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
