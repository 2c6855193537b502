"""The command line: JSON output, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Annotated

import numpy as np
import pytest
import typer

from hybridllm.cli.options import KVOptions

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

    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.Q8_K  # llama.cpp's intermediate type: no file format reads it
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8),
                      raw_dtype=qtype)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    assert_one_line_error(run_cli("generate", "hi", "--model", str(path)), "Q8_K", "IQ4_NL")


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
    ("--activations", "int4", "activations mode"),
])
def test_invalid_values(flag, value, needle):
    assert_one_line_error(run_cli("generate", "hi", flag, value), needle)


def test_int8_activations_need_the_files_own_weights():
    assert_one_line_error(run_cli("generate", "hi", "--activations", "int8", "--weights", "int8"),
                          "--activations int8", "--weights auto")


def test_prompt_from_stdin(tiny_models):
    folder = tiny_models["llama"][0]
    proc = run_cli("generate", "--model", str(folder), "--max-tokens", "3", "--temperature", "0", "--json",
                   "--no-chat", stdin="the quick")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["metrics"]["prompt_tokens"] > 0


def test_non_utf8_prompt_on_stdin_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "hybridllm.cli", "generate", "--max-tokens", "3"],
                          input=b"caf\xe9 \xff\xfe", capture_output=True, timeout=300)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                                      proc.stderr.decode()), "UTF-8", "0xe9")


# ---- shared options: declared once, taken by every command that loads a model ------------------
def _shared_option_names(groups: tuple[type, ...] | None = None) -> set[str]:
    import dataclasses
    import typing

    from hybridllm.cli.options import INFERENCE_GROUPS

    names = set()
    for group in groups or INFERENCE_GROUPS:
        hints = typing.get_type_hints(group, include_extras=True)
        for field in dataclasses.fields(group):
            info = hints[field.name].__metadata__[0]  # the typer.Option of the Annotated alias
            names.update(part for decl in (info.default, *info.param_decls) for part in decl.split("/"))
    return names


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_every_inference_command_takes_every_shared_option(command):
    import typer.main

    from hybridllm.cli import app

    names = _shared_option_names()
    assert {"--kv-adaptive", "--no-kv-adaptive", "-ngl", "--placement", "--decode-backend", "--native-decode",
            "--kv-threshold", "--prefill-chunk"} <= names
    click_command = typer.main.get_command(app).commands[command]
    taken = {opt for param in click_command.params for opt in (*param.opts, *param.secondary_opts)}
    assert names - taken == set()
    if command != "bench":  # a bench preset sets the prefix cache itself (multi-turn)
        from hybridllm.cli.options import PrefixCacheOptions

        prefix_flags = _shared_option_names((PrefixCacheOptions,))
        assert "--prefix-cache-ram" in prefix_flags and prefix_flags <= taken


def test_option_group_defaults_equal_the_engine_defaults():
    import dataclasses
    import inspect

    from hybridllm.cli.options import KVOptions, ModelOptions, SpeedOptions
    from hybridllm.config import KVConfig
    from hybridllm.llm import LLM

    kv_defaults = vars(KVConfig())
    assert {k: kv_defaults[k] for k in dataclasses.asdict(KVOptions())} == dataclasses.asdict(KVOptions())
    llm = inspect.signature(LLM.__init__).parameters
    for name, value in {**dataclasses.asdict(SpeedOptions()), **dataclasses.asdict(ModelOptions())}.items():
        if name in llm:
            assert llm[name].default == value, name


def test_llm_kwargs_passes_only_changed_kv_flags_with_a_placement_file(tmp_path):
    from hybridllm.cli.options import KVOptions, ModelOptions, PlacementOptions, SpeedOptions, llm_kwargs

    plain = llm_kwargs(ModelOptions(), PlacementOptions(), KVOptions(kv_hot_window=64), SpeedOptions())
    assert plain["kv_hot_window"] == 64 and plain["kv_cache"] == "dynamic" and plain["decode_backend"] == "auto"
    placed = llm_kwargs(ModelOptions(), PlacementOptions(file=tmp_path / "p.json"), KVOptions(kv_hot_window=64),
                        SpeedOptions(decode_backend="eager"))
    assert placed["kv_hot_window"] == 64 and "kv_cache" not in placed and placed["decode_backend"] == "eager"


def test_serve_help_lists_kv_adaptive():
    from typer.testing import CliRunner

    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "--kv-adaptive" in result.output and "--no-kv-adaptive" in result.output


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_bad_kv_flag_is_one_line_on_every_command(command):
    assert_one_line_error(run_cli(command, "--kv-cold-bits", "5"), "kv_cold_bits")


def _declares_kv_bits_twice(kv: KVOptions = KVOptions(),
                             kv_bits: Annotated[int, typer.Option("--kv-bits")] = 8) -> None:
    """A command with the KV group and its own --kv-bits (annotations resolve in this module)."""


def test_option_groups_refuse_a_flag_declared_twice():
    from hybridllm.cli.options import with_option_groups

    twice = _declares_kv_bits_twice
    with pytest.raises(TypeError, match="declared twice"):
        with_option_groups(twice)
    with pytest.raises(TypeError, match="own"):
        with_option_groups(twice, own=("kv_bits", "kv_hot_window"))  # kv_hot_window: not declared by it
    expanded = with_option_groups(twice, own=("kv_bits",))
    assert "kv_hot_window" in expanded.__signature__.parameters


def test_c_means_ctx_size_in_every_command():
    """One meaning per flag: -c is llama.cpp's context size wherever it exists; bench's prompt
    lengths (--prompt-tokens) keep -c/--context only as a hidden, deprecated spelling for one release."""
    import typer.main

    from hybridllm.cli import app

    def leaves(group, path=()):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from leaves(command, (*path, name))
            else:
                yield " ".join((*path, name)), command

    with_c = {name: param for name, command in leaves(typer.main.get_command(app))
              for param in command.params if "-c" in param.opts}
    assert {"generate", "chat", "serve", "bench"} <= set(with_c)
    for name, param in with_c.items():
        if name == "bench":
            assert param.hidden and "--context" in param.opts
        else:
            assert "--ctx-size" in param.opts, name
