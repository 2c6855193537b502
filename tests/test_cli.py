"""The command line: JSON output, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from test_default_model import METRIC_KEYS

pytestmark = pytest.mark.slow  # each test runs the CLI in a new process


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridllm.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_json_answers_paris():
    proc = run_cli("generate", "What is the capital of France?", "--temperature", "0", "--max-tokens", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"text", "token_ids", "prompt_token_ids", "metrics"} <= set(out)
    assert METRIC_KEYS <= set(out["metrics"])
    assert "Paris" in out["text"]


def test_generate_plain_prints_text_and_metrics(tiny_models):
    folder = tiny_models["llama"][0]
    proc = run_cli("generate", "hello", "--model", str(folder), "--max-tokens", "4", "--temperature", "0",
                   "--ignore-eos", "--no-chat")
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stderr and "decode" in proc.stderr


def test_missing_model_file():
    assert_one_line_error(run_cli("generate", "hi", "--model", "/nonexistent/model.gguf"), "not found")


def test_truncated_gguf(tiny_models, tmp_path):
    data = tiny_models["llama"][1].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "hi", "--model", str(cut)), "truncated")
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(data[:100])
    assert_one_line_error(run_cli("generate", "hi", "--model", str(header_cut)), "truncated")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"hello world, not a model" * 10)
    assert_one_line_error(run_cli("generate", "hi", "--model", str(bad)), "not a GGUF")


def test_unsupported_architecture_lists_supported(tmp_path):
    import gguf

    path = tmp_path / "neox.gguf"
    writer = gguf.GGUFWriter(str(path), "gptneox")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    assert_one_line_error(run_cli("generate", "hi", "--model", str(path)), "gptneox", "supported", "qwen2")


def test_unsupported_tensor_type_lists_supported(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("token_embd.weight", np.zeros((4, 64 // block * size), dtype=np.uint8),
                      raw_dtype=qtype)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    assert_one_line_error(run_cli("generate", "hi", "--model", str(path)), "IQ4_NL", "Q4_K")


def test_prompt_longer_than_context(tiny_models):
    folder = tiny_models["llama"][0]  # context window 512
    proc = run_cli("generate", "fox " * 600, "--model", str(folder), "--no-chat")
    assert_one_line_error(proc, "context window")


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "2", "top_p"),
    ("--top-k", "-3", "top_k"),
    ("--max-tokens", "0", "max_tokens"),
    ("--dtype", "float8", "dtype"),
    ("--kv-cache", "magic", "KV cache"),
    ("--vram-budget", "lots", "byte count"),
])
def test_invalid_values(flag, value, needle):
    assert_one_line_error(run_cli("generate", "hi", flag, value), needle)


def test_prompt_from_stdin(tiny_models):
    folder = tiny_models["llama"][0]
    proc = run_cli("generate", "--model", str(folder), "--max-tokens", "3", "--temperature", "0", "--json",
                   "--no-chat", stdin="the quick")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["metrics"]["prompt_tokens"] > 0
