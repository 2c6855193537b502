"""The benchmark harness: sweeps in child processes, failure rows, JSON/CSV/PNG output, peers.

Fast: a tiny random model, short contexts, a handful of child processes. No wall-time asserts.
"""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridllm.bench import report
from hybridllm.bench.measure import PeerUnavailable, prompt_ids, summarize, synthetic_prompt_ids
from hybridllm.bench.plots import host_device_ratios, write_plots
from hybridllm.bench.presets import resolve
from hybridllm.bench.sweep import BenchConfig, build_grid, classify_failure, run_sweep, skip_reason
from hybridllm.bench.worker import classify_exception, measure_row
from hybridllm.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {
    "engine", "model", "kv_cache", "decode_on", "n_gpu_layers", "context", "new_tokens", "prefill_tps", "ttft_s",
    "decode_tps", "tpot_p50_s", "tpot_p99_s", "peak_device_bytes", "peak_host_bytes", "kv_bytes", "bus_bytes",
    "status", "error", "repeat", "weights_format", "weight_bytes",
}
TINY_CONFIG = {
    "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from tiny_models import build_hf_model, save_as_gguf

    root = tmp_path_factory.mktemp("bench")
    build_hf_model(root / "llama", "llama")
    return str(save_as_gguf(root / "llama", root / "llama.gguf"))


@pytest.fixture
def tiny_config_json(tmp_path) -> str:
    path = tmp_path / "tiny-config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    import matplotlib.image

    assert matplotlib.image.imread(str(path)).shape[:2] == (height, width)


# ---- the acceptance test -------------------------------------------------------------------------
@pytest.mark.slow
def test_two_config_sweep_with_a_forced_failure(tiny_gguf, tmp_path):
    common = dict(model=tiny_gguf, context=24, new_tokens=4, repeat=2, threads=1)
    configs = [BenchConfig(**common), BenchConfig(**common, kv_options={"vram_budget": "1KiB"})]
    rows = run_sweep(configs, timeout_s=300, progress=False)

    ok, failed = rows
    assert ok["status"] == "ok", ok["error"]
    assert failed["status"] == "error"
    assert "budget" in failed["error"].lower()
    assert failed["decode_tps"] is None

    report.write_json(rows, tmp_path / "out.json", {"note": "test"})
    report.write_csv(rows, tmp_path / "out.csv")
    write_plots(rows, tmp_path / "out.png")

    document = json.loads((tmp_path / "out.json").read_text())
    assert document["schema"] == report.SCHEMA
    assert {"created", "machine", "settings", "rows"} <= set(document)
    assert {"cpu", "cores", "torch"} <= set(document["machine"])
    assert len(document["rows"]) == 2
    for row in document["rows"]:
        assert ROW_KEYS <= set(row)
        assert set(row["kv_bytes"]) == {"device", "host"}
        assert row["status"] in ("ok", "error", "oom", "timeout", "skipped")
    row = document["rows"][0]
    assert (row["engine"], row["kv_cache"], row["context"], row["new_tokens"]) == ("hybridllm", "dynamic", 24, 4)
    assert row["prompt_tokens"] == 24 and row["generated_tokens"] == 4
    for key in ("prefill_tps", "ttft_s", "decode_tps", "tpot_p50_s", "tpot_p99_s", "peak_host_bytes",
                "peak_device_bytes"):
        assert row[key] > 0, key
    assert row["tpot_p99_s"] >= row["tpot_p50_s"]
    assert row["decode_tps_spread"] >= 0
    assert len(row["runs"]) == 2
    assert row["kv_bytes"]["device"] > 0
    assert row["weights_format"] == "float32" and row["weight_bytes"]["device"] > 0

    with open(tmp_path / "out.csv") as handle:
        records = list(csv.DictReader(handle))
    assert [r["status"] for r in records] == ["ok", "error"]
    assert set(report.CSV_COLUMNS) == set(records[0])
    assert_png(tmp_path / "out.png")


@pytest.mark.slow
def test_timeout_becomes_a_row(tiny_gguf):
    rows = run_sweep([BenchConfig(model=tiny_gguf, context=8, new_tokens=2)], timeout_s=0.3, progress=False)
    assert rows[0]["status"] == "timeout"
    assert "0.3" in rows[0]["error"]


@pytest.mark.slow
def test_sweep_skips_contexts_beyond_the_window_without_running(tiny_gguf):
    rows = run_sweep([BenchConfig(model=tiny_gguf, context=500, new_tokens=100)], progress=False)
    assert rows[0]["status"] == "skipped"
    assert "window of 512" in rows[0]["error"]
    assert rows[0]["wall_s"] is None  # never started


# ---- the CLI ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_bench_writes_every_output(tiny_gguf, tmp_path):
    from hybridllm.cli import app

    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "csv", "png", "md")}
    result = CliRunner().invoke(app, [
        "bench", "--model", tiny_gguf, "--prompt-tokens", "16", "--new-tokens", "3", "--repeat", "1", "--threads", "1",
        "--no-warmup", "--json", str(out["json"]), "--csv", str(out["csv"]), "--plot", str(out["png"]),
        "--markdown", str(out["md"]), "--timeout", "300",
    ])
    assert result.exit_code == 0, result.output
    assert "| hybridllm | dynamic |" in result.output
    rows = json.loads(out["json"].read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"], rows[0]["error"]
    assert json.loads(out["json"].read_text())["settings"]["contexts"] == [16]
    assert out["md"].read_text().startswith("| engine |")
    assert_png(out["png"])


def test_cli_bench_passes_the_shared_kv_and_speed_flags(tiny_gguf, tmp_path):
    from hybridllm.cli import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", tiny_gguf, "--prompt-tokens", "16", "--new-tokens", "2", "--repeat", "1", "--threads", "1",
        "--no-warmup", "--kv-cache", "tiered", "--kv-hot-window", "8", "--kv-opt", "sink_tokens=2", "--no-fuse",
        "--no-native-decode", "--json", str(out), "--timeout", "300",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["settings"]["llm_options"] == {"fuse": False, "native_decode": False}
    [row] = data["rows"]
    assert row["status"] == "ok", row["error"]
    assert row["kv_options"] == {"kv_hot_window": 8, "kv_sink_tokens": 2}


@pytest.mark.parametrize("old_flag", ["-c", "--context"])
def test_cli_bench_old_prompt_lengths_spelling_still_works_with_a_warning(tiny_gguf, tmp_path, old_flag):
    """-c/--context on bench: the prompt lengths for one more release, with a deprecation warning
    (everywhere else -c is --ctx-size); --help lists only --prompt-tokens."""
    from hybridllm.cli import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", tiny_gguf, old_flag, "16", "--new-tokens", "2", "--repeat", "1", "--threads", "1",
        "--no-warmup", "--baseline", "none", "--json", str(out), "--timeout", "300",
    ])
    assert result.exit_code == 0, result.output
    assert "warning: bench's -c/--context (prompt lengths) is deprecated" in result.output
    assert "use --prompt-tokens" in result.output
    data = json.loads(out.read_text())
    assert data["settings"]["contexts"] == [16] and [row["context"] for row in data["rows"]] == [16]
    helped = CliRunner().invoke(app, ["bench", "--help"], terminal_width=200).output
    assert "--prompt-tokens" in helped and "--context" not in helped and " -c " not in helped


def test_cli_speed_preset_stores_the_kv_in_float16_unless_told(tiny_gguf, tmp_path):
    from hybridllm.cli import app

    for extra, expected in (([], "float16"), (["--kv-dtype", "float32"], "float32")):
        out = tmp_path / "speed.json"
        result = CliRunner().invoke(app, [
            "bench", "--preset", "speed", "--model", tiny_gguf, "--prompt-tokens", "16", "--new-tokens", "2",
            "--repeat", "1", "--threads", "1", "--no-warmup", "--baseline", "none", "--json", str(out), *extra,
        ])
        assert result.exit_code == 0, result.output
        [row] = json.loads(out.read_text())["rows"]
        assert row["status"] == "ok", row["error"]
        assert row["kv_options"] == {"kv_dtype": expected}


@pytest.mark.parametrize("args, needle", [
    (["--kv-cache", "bogus"], "unknown KV cache 'bogus'"),
    (["--baseline", "vllm"], "unknown baseline 'vllm'"),
    (["--prompt-tokens", "abc"], "invalid --prompt-tokens value 'abc'"),
    (["--prompt-tokens", "16", "-c", "32"], "old spelling of --prompt-tokens"),
    (["--decode-on", "gpu"], "--decode-on value"),
    (["--preset", "nope"], "unknown preset"),
    (["--model", "/nonexistent/model.gguf"], "model not found"),
    (["--kv-opt", "hot_window"], "KEY=VALUE"),
    (["--vram-budget", "lots"], "invalid byte count"),
])
def test_cli_bench_bad_input_is_one_line(args, needle):
    from hybridllm.cli import app

    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.output


# ---- pieces ----------------------------------------------------------------------------------
def test_grid_maps_strategies_to_engines():
    grid = build_grid([512, 16], ["dynamic", "tiered", "quantized"], ["device", "host"], [None],
                      ["llama.cpp", "transformers"], new_tokens=8)
    assert [c.context for c in grid][:9] == [16] * 9 and len(grid) == 18
    ours = [c for c in grid if c.engine == "hybridllm" and c.context == 16]
    assert {(c.kv_cache, c.decode_on) for c in ours} == {(k, d) for k in ("dynamic", "tiered", "quantized")
                                                          for d in ("device", "host")}
    assert sorted(c.kv_cache for c in grid if c.engine == "transformers" and c.context == 16) == ["dynamic", "quantized"]
    assert [c.kv_cache for c in grid if c.engine == "llama.cpp" and c.context == 16] == ["f16"]
    with pytest.raises(ConfigError):
        build_grid([16], ["dynamic"], baselines=["vllm"])
    with pytest.raises(ConfigError):
        build_grid([16], ["paged"])


def test_failure_classification():
    assert classify_failure(-9, "")[0] == "oom"
    assert classify_failure(1, "Traceback ...\nMemoryError\n") == ("oom", "MemoryError")
    assert classify_failure(1, "Traceback ...\nValueError: boom\n") == ("error", "ValueError: boom")
    status, message = classify_failure(-11, "")
    assert status == "error" and "SIGSEGV" in message
    assert classify_exception(PeerUnavailable("not installed")) == ("skipped", "not installed")
    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory"))[0] == "oom"
    assert classify_exception(RuntimeError("DefaultCPUAllocator: can't allocate memory"))[0] == "oom"
    assert classify_exception(ValueError("bad"))[0] == "error"


def test_skip_rules():
    config = BenchConfig(context=1024, new_tokens=128)
    assert "window" in skip_reason(config, 1024, None)
    assert skip_reason(config, 4096, None) is None
    assert "out of memory" in skip_reason(config, 4096, 512)
    assert skip_reason(config, 4096, 2048) is None


def test_summarize_reports_median_and_spread():
    runs = [{"decode_tps": v, "ttft_s": 0.1, "peak_host_bytes": m, "kv_bytes": {"device": 1, "host": 0}}
            for v, m in ((10.0, 5), (14.0, 9), (11.0, 7))]
    out = summarize(runs)
    assert out["decode_tps"] == 11.0 and out["decode_tps_spread"] == 4.0
    assert out["ttft_s_spread"] == 0.0
    assert out["peak_host_bytes"] == 9
    assert out["prefill_tps"] is None


def test_prompts_have_exactly_n_tokens(tiny_gguf):
    from hybridllm.loading.registry import open_checkpoint

    tokenizer = open_checkpoint(tiny_gguf).tokenizer()
    for n in (1, 7, 300):
        ids = prompt_ids(tokenizer.encode, n)
        assert len(ids) == n and ids == prompt_ids(tokenizer.encode, n)
    assert len(synthetic_prompt_ids(300, 50)) == 50 and max(synthetic_prompt_ids(300, 50)) < 300


def test_paper_preset_and_layout():
    settings = resolve("paper", repeat=1)
    assert settings["contexts"][0] == 1024 and settings["contexts"][-1] == 131072
    assert settings["kv_caches"] == ["dynamic", "offloaded", "quantized", "tiered"]
    assert settings["decode_ons"] == ["device", "host"] and settings["repeat"] == 1
    rows = [dict(engine="hybridllm", kv_cache="tiered", decode_on="host", context=32768, status="ok",
                 decode_tps=12.5, peak_device_bytes=2**30, peak_host_bytes=3 * 2**30),
            dict(engine="hybridllm", kv_cache="dynamic", decode_on="device", context=131072, status="oom",
                 decode_tps=None, peak_device_bytes=None, peak_host_bytes=None)]
    text = report.paper_markdown(rows)
    assert text.splitlines()[0] == "| context | CPU decode | strategy | GPU mem | CPU mem | tokens/s |"
    assert "| 32K | yes | tiered | 1.0 GiB | 3.0 GiB | 12.5 |" in text
    assert "| 128K | no | dynamic | - | - | OOM |" in text


def test_plots_with_host_device_pairs(tmp_path):
    rows = []
    for context in (1024, 4096):
        for decode_on, tps in (("device", 40.0), ("host", 10.0)):
            rows.append(dict(engine="hybridllm", kv_cache="tiered", decode_on=decode_on, n_gpu_layers=None,
                             context=context, status="ok", decode_tps=tps, tpot_p99_s=0.05,
                             peak_device_bytes=2**30, peak_host_bytes=2**31))
    assert host_device_ratios(rows) == {"tiered": [(1024, 0.25), (4096, 0.25)]}
    assert_png(write_plots(rows, tmp_path / "plots" / "p.png"))


# ---- random weights -----------------------------------------------------------------------------
def test_shipped_configs_have_the_published_shapes():
    from hybridllm.loading.hf_config import read_config, read_hf_config

    llama = read_config(REPO / "configs" / "llama-3.2-1b.json")
    assert (llama.n_layers, llama.hidden_size, llama.intermediate_size, llama.n_heads, llama.n_kv_heads,
            llama.vocab_size, llama.max_position_embeddings) == (16, 2048, 8192, 32, 8, 128256, 131072)
    assert llama.tie_word_embeddings and llama.rope_scaling.kind == "llama3"
    assert round(llama.parameter_count() / 1e9, 2) == 1.24
    mistral = read_hf_config(REPO / "configs" / "mistral-7b.json")
    assert mistral == {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
    }
    assert round(read_config(REPO / "configs" / "mistral-7b.json").parameter_count() / 1e9, 2) == 7.24


def test_random_weights_are_a_checkpoint_source(tiny_config_json, tiny_gguf):
    from hybridllm.loading.checkpoint import Checkpoint
    from hybridllm.loading.random_checkpoint import RandomCheckpoint
    from hybridllm.loading.registry import open_checkpoint

    random = BenchConfig(random_weights=tiny_config_json, dtype="bfloat16", seed=3).checkpoint()
    assert isinstance(random, RandomCheckpoint) and random.dtype == torch.bfloat16 and random.seed == 3
    assert open_checkpoint(random) is random  # an opened checkpoint passes through unchanged
    gguf = open_checkpoint(tiny_gguf)
    hf_folder = open_checkpoint(Path(tiny_gguf).parent / "llama")
    for checkpoint in (random, gguf, hf_folder):
        assert isinstance(checkpoint, Checkpoint)
    assert (gguf.file_format, hf_folder.file_format, random.file_format) == ("gguf", "safetensors", "random")
    assert random.read("model.norm.weight").dtype == torch.bfloat16
    assert random.nbytes("model.embed_tokens.weight") == TINY_CONFIG["vocab_size"] * TINY_CONFIG["hidden_size"] * 2


@pytest.mark.slow
def test_random_weights_model_generates_and_matches_transformers(tiny_config_json):
    from hybridllm.bench.random_weights import random_hf_model, random_llm
    from hybridllm.config import SamplingParams

    llm = random_llm(tiny_config_json)
    result = llm.generate(list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 3
    hf = random_hf_model(tiny_config_json)
    ids = torch.tensor([list(range(10, 30))])
    with torch.inference_mode():
        ours = llm.model(ids, llm.new_cache(), 0)  # (1, 1, vocab)
        theirs = hf(ids).logits[:, -1:]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_memory_precheck_turns_a_huge_model_into_an_oom_row():
    row = measure_row(BenchConfig(random_weights=str(REPO / "configs" / "mistral-7b.json"), context=32000,
                                  new_tokens=8, dtype="float32"))
    if row["status"] != "oom":  # a machine with > 35 GB free would try to build it: do not
        pytest.skip("this machine has enough RAM for a float32 Mistral-7B")
    assert row["error"].startswith("predicted (not run)")


# ---- peers, measured in this process -------------------------------------------------------------
@pytest.mark.slow
def test_transformers_peer_same_method(tiny_gguf):
    row = measure_row(BenchConfig(engine="transformers", model=tiny_gguf, context=12, new_tokens=3))
    assert row["status"] == "ok", row["error"]
    assert row["prompt_tokens"] == 12 and row["generated_tokens"] == 3
    assert row["decode_tps"] > 0 and row["kv_bytes"]["device"] > 0
    assert row["variant"].startswith("DynamicCache")
    offloaded = measure_row(BenchConfig(engine="transformers", model=tiny_gguf, context=12, new_tokens=3,
                                        kv_cache="offloaded"))
    if not torch.cuda.is_available():
        assert offloaded["status"] == "skipped" and "CUDA" in offloaded["error"]


@pytest.mark.slow
def test_llama_cpp_peer_same_method(tiny_gguf, tiny_config_json):
    skipped = measure_row(BenchConfig(engine="llama.cpp", random_weights=tiny_config_json, context=8, new_tokens=2))
    assert skipped["status"] == "skipped" and "GGUF" in skipped["error"]
    hf_folder = str(Path(tiny_gguf).parent / "llama")
    skipped = measure_row(BenchConfig(engine="llama.cpp", model=hf_folder, context=8, new_tokens=2))
    assert skipped["status"] == "skipped" and "Hugging Face folder" in skipped["error"]
    pytest.importorskip("llama_cpp")
    row = measure_row(BenchConfig(engine="llama.cpp", model=tiny_gguf, context=12, new_tokens=3))
    assert row["status"] == "ok", row["error"]
    assert row["prompt_tokens"] == 12 and row["generated_tokens"] == 3
    assert row["decode_tps"] > 0


def test_speed_preset_and_ratio_and_bandwidth_columns():
    settings = resolve("speed")
    assert settings["contexts"] == [16, 512, 2048, 8064]
    assert settings["kv_options"] == {"kv_dtype": "float16"}  # llama.cpp's default KV precision
    assert settings["baselines"] == ["llama.cpp", "transformers"]
    assert settings["new_tokens"] == 128 and settings["weights"] == "auto"
    assert resolve("speed", contexts=[64])["contexts"] == [64]  # flags still override the preset
    ours = dict(engine="hybridllm", context=512, status="ok", decode_tps=60.0, prefill_tps=900.0,
                weights_format="int4", weight_bytes={"device": 90_000_000, "host": 0},
                kv_bytes={"device": 10_000_000, "host": None})
    peer = dict(engine="llama.cpp", context=512, status="ok", decode_tps=120.0, prefill_tps=300.0,
                weight_bytes={"device": None, "host": None}, kv_bytes={"device": None, "host": None})
    failed = dict(engine="transformers", context=512, status="oom", decode_tps=None, prefill_tps=None)
    records = report.speed_records([peer, failed, ours], bandwidth_gbs=20.0)
    assert [r["engine"] for r in records] == ["hybridllm", "llama.cpp"]  # ok rows only, ours first
    mine, theirs = records
    assert mine["decode_ratio"] == pytest.approx(0.5) and mine["prefill_ratio"] == pytest.approx(3.0)
    assert mine["bytes_per_token"] == 100_000_000
    assert mine["limit_tps"] == pytest.approx(200.0)  # 20e9 B/s / 1e8 B per token
    assert mine["limit_fraction"] == pytest.approx(0.3)
    assert theirs["decode_ratio"] == pytest.approx(1.0) and theirs["limit_fraction"] is None
    text = report.speed_markdown([peer, ours], bandwidth_gbs=20.0)
    assert "| 512 | hybridllm (int4) | 900.0 | 60.0 | 0.50x | 3.00x | " in text
    assert "30 %" in text
    assert report.speed_records([ours], bandwidth_gbs=None)[0]["limit_fraction"] is None
    half = {**ours, "kv_options": {"kv_dtype": "float16"}}
    assert "| 512 | hybridllm (int4, KV float16) | " in report.speed_markdown([peer, half], bandwidth_gbs=None)


# ---- the presets that replace the former bench/ scripts ---------------------------------------------
def test_kv_preset_runs_every_variant_and_a_random_twin_past_the_window(tmp_path):
    from hybridllm.bench import kv_strategies
    from hybridllm.bench.presets import build_preset_grid

    settings = resolve("kv", contexts=[1024, 16384])
    grid = build_preset_grid(settings, new_tokens=16, kv_options={"vram_budget": "1GB"})
    names = [kv_strategies.variant_name(c.kv_cache, c.kv_options) for c in grid]
    assert names == list(kv_strategies.KV_VARIANTS) * 2
    assert all(c.kv_options["vram_budget"] == "1GB" for c in grid)
    short, long = grid[0], grid[-1]
    assert (short.context, short.random_weights) == (1024, None)
    assert long.context == 16384 and long.random_weights is not None
    twin = json.loads(Path(long.random_weights).read_text())
    assert twin["max_position_embeddings"] == 16384 + 16 and twin["hidden_size"] == 576  # the default model's shape
    only_tiered = build_preset_grid(resolve("kv", kv_caches=["tiered"], contexts=[512]), new_tokens=4)
    assert [kv_strategies.variant_name(c.kv_cache, c.kv_options) for c in only_tiered] == ["tiered", "tiered-cold4"]


def test_kv_table_shows_variants_bus_directions_and_pages():
    from hybridllm.bench import kv_strategies

    row = {**_row(), "kv_cache": "quantized", "kv_options": {"kv_bits": 4}, "context": 4096,
           "bus_bytes_detail": {"h2d": 2048, "d2h": 1024}, "kv_pages_moved": 7, "kv_bytes": {"device": 1, "host": 0}}
    failed = {**_row(), "kv_cache": "tiered", "kv_options": {"kv_cold_bits": 4}, "status": "oom", "error": "no RAM"}
    (ok, bad) = kv_strategies.records([row, failed])
    assert ok[:3] == ["4K", "tiny", "quantized-int4"] and ok[9:12] == ["2.0 KiB", "1.0 KiB", "7"]
    assert bad[2] == "tiered-cold4" and bad[-1] == "oom: no RAM"
    assert kv_strategies.kv_markdown([row], {"threads": 2, "new_tokens": 16}).count("| 4K |") == 1


def test_kv_table_puts_decode_next_to_dynamic_and_llama_cpps_kv_of_the_same_bits():
    from hybridllm.bench import kv_strategies

    rows = [{**_row(), "decode_tps": 100.0},
            {**_row(), "kv_cache": "quantized", "kv_options": {"kv_bits": 8}, "decode_tps": 120.0},
            {**_row(), "engine": "llama.cpp", "kv_cache": "q8_0", "decode_tps": 80.0},
            {**_row(), "engine": "llama.cpp", "kv_cache": "f16", "decode_tps": 50.0}]
    cells = kv_strategies.records(rows)
    assert [c[2] for c in cells] == ["dynamic", "quantized-int8", "llama.cpp q8_0", "llama.cpp f16"]
    assert [c[5] for c in cells] == ["1.00x", "1.20x", "-", "-"]  # vs our dynamic cache
    assert [c[6] for c in cells] == ["2.00x", "1.50x", "-", "-"]  # vs llama.cpp's f16 / q8_0 KV


def test_kv_table_names_a_strategy_attended_through_pytorch():
    from hybridllm.bench import kv_strategies

    rows = [{**_row(), "kv_attention": "native"}, {**_row(), "kv_cache": "quantized", "kv_options": {"kv_bits": 8},
                                                  "kv_attention": "PyTorch"}]
    assert [c[2] for c in kv_strategies.records(rows)] == ["dynamic", "quantized-int8 (PyTorch attention)"]


def test_peers_table_ratio_to_llama_cpp_and_section():
    from hybridllm.bench import peers_report

    rows = [{**_row(), "engine": "llama.cpp", "decode_tps": 20.0}, {**_row(), "decode_tps": 10.0},
            {**_row(), "engine": "transformers", "status": "skipped", "error": "not installed"}]
    cells, notes = peers_report.records(rows)
    assert [c[1] for c in cells] == ["hybridllm", "llama.cpp", "transformers"]
    assert [c[5] for c in cells] == ["0.50x", "1.00x", "-"]
    assert cells[2][-1] == "skipped [1]" and "not installed" in notes[0]
    machine = {"cpu": "CPU", "cores": 2, "ram_bytes": 2**33, "gpu": None, "os": "Linux", "python": "3.11",
               "torch": "2", "transformers": None, "llama-cpp-python": None}
    text = peers_report.section(rows, machine, {"command": "hybridllm bench --preset peers", "threads": 2,
                                                "started": "2026-01-01T10:00:00", "load_average": [1.0, 2.0],
                                                "new_tokens": 128, "repeat": 3})
    assert text.startswith("## Foundation:") and "hybridllm bench --preset peers" in text
    assert "1.00 at the start, 2.00 at the end" in text and "median of 3 run(s)" in text


def test_planner_table_and_tolerance():
    from hybridllm.bench import planner_accuracy

    rows = [{"context": 512, "predicted_decode_tps": 20.0, "measured_decode_tps": 19.0, "error": 1 / 19,
             "cpu_utilisation": 0.98, "predicted_ttft_s": 0.6, "measured_ttft_s": 0.8}]
    assert planner_accuracy.records(rows) == [["512", "20.0", "19.0", "+5%", "0.98", "0.60 s", "0.80 s"]]
    assert planner_accuracy.within_tolerance(rows)
    assert not planner_accuracy.within_tolerance([{**rows[0], "error": -0.31}])
    assert resolve("planner")["contexts"] == [512, 4096] and resolve("planner")["new_tokens"] == 64


@pytest.mark.slow
def test_cli_kv_preset_writes_its_table(tiny_gguf, tmp_path):
    from hybridllm.cli import app

    out = tmp_path / "kv.md"
    result = CliRunner().invoke(app, [
        "bench", "--preset", "kv", "--model", tiny_gguf, "--prompt-tokens", "16", "--new-tokens", "2", "--kv-cache",
        "quantized", "--threads", "1", "--no-warmup", "--markdown", str(out), "--timeout", "300",
    ])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "| 16 | llama | quantized-int8 |" in text and "| 16 | llama | quantized-int4 |" in text


def _row() -> dict:
    config = BenchConfig(model="tiny.gguf", context=512)
    from hybridllm.bench.sweep import base_row

    return {**base_row(config), "status": "ok", "prefill_tps": 100.0, "decode_tps": 10.0}


def test_kv_preset_runs_llama_cpps_kv_types_beside_ours():
    from hybridllm.bench import presets

    settings = presets.resolve("kv", contexts=[512], baselines=["llama.cpp"], kv_caches=["dynamic", "quantized"])
    grid = presets.build_preset_grid(settings, new_tokens=4, model="m.gguf")
    peers = [(c.engine, c.kv_cache) for c in grid if c.engine == "llama.cpp"]
    assert peers == [("llama.cpp", "f16"), ("llama.cpp", "q8_0"), ("llama.cpp", "q4_0")]


def test_models_preset_runs_transformers_at_512_only_and_puts_ratios_in_its_table(tiny_gguf):
    from pathlib import Path

    from hybridllm.bench import models_preset
    from hybridllm.bench.sweep import base_row
    from hybridllm.loading.gguf import GGUFFile

    files = {"tiny": Path(tiny_gguf)}
    grid = models_preset.models_grid(files, new_tokens=64, threads=2)
    contexts = {engine: sorted(c.context for c in grid if c.engine == engine)
                for engine in ("hybridllm", "llama.cpp", "transformers")}
    long = models_preset.long_context(Path(tiny_gguf), 64)
    assert long == GGUFFile(tiny_gguf).config.max_position_embeddings - 64  # the window, less the new tokens
    assert contexts["hybridllm"] == contexts["llama.cpp"] == sorted({512, 2048, long})
    assert contexts["transformers"] == [512]
    file_bytes = sum(t.nbytes for t in GGUFFile(tiny_gguf).tensors.values())
    ours = {"decode_tps": 12.0, "prefill_tps": 300.0, "peak_host_bytes": 150,
            "weight_bytes": {"device": 0, "host": file_bytes}}
    peer = {"decode_tps": 8.0, "prefill_tps": 100.0, "peak_host_bytes": 100}
    rows = [{**base_row(c), "status": "ok", **(ours if c.engine == "hybridllm" else peer)} for c in grid]
    cells = models_preset.records(rows, files)[0]
    assert cells[2] == "1.50x (12.0 vs 8.0)" and cells[3] == f"@{long}: 1.50x (12.0 vs 8.0)"
    assert cells[4] == "3.00x (300.0 vs 100.0)" and cells[5] == "1.50x (12.0 vs 8.0)"
    assert cells[6] == "1.000" and cells[7] == "1.50x"


def test_models_preset_takes_each_cells_best_speed_and_worst_peak_rss_over_rounds(tiny_gguf):
    from pathlib import Path

    from hybridllm.bench import models_preset
    from hybridllm.bench.sweep import base_row

    files = {"tiny": Path(tiny_gguf)}
    grid = models_preset.models_grid(files, baselines=["llama.cpp"], new_tokens=64, threads=2)
    # round 1: ours slow at decode, fast at prefill; round 2 the other way, with a larger peak;
    # round 3: ours failed (its error row must not hide the ok rounds)
    figures = {1: {"decode_tps": 10.0, "prefill_tps": 300.0, "peak_host_bytes": 150},
               2: {"decode_tps": 12.0, "prefill_tps": 250.0, "peak_host_bytes": 180}}
    peer = {1: {"decode_tps": 8.0, "prefill_tps": 100.0, "peak_host_bytes": 100},
            2: {"decode_tps": 6.0, "prefill_tps": 120.0, "peak_host_bytes": 90}}
    weights = {"weight_bytes": {"device": 0, "host": 1}}
    rows = [{**base_row(c), "status": "ok", "round": n, **weights, **(figures if c.engine == "hybridllm" else peer)[n]}
            for n in (1, 2) for c in grid]
    rows += [{**base_row(c), "status": "error", "round": 3} for c in grid if c.engine == "hybridllm"]
    best = models_preset.best_of_rounds(rows)
    assert len(best) == len(grid)  # one row per configuration
    cells = models_preset.records(rows, files)[0]
    assert cells[2] == "1.50x (12.0 vs 8.0)"  # each engine's best decode
    assert cells[4] == "2.50x (300.0 vs 120.0)"  # and best prefill, from other rounds
    assert cells[7] == "1.80x"  # the worst peak of each: 180 vs 100
    only_failed = [{**base_row(c), "status": "error", "round": 1} for c in grid]
    assert [r["status"] for r in models_preset.best_of_rounds(only_failed)] == ["error"] * len(grid)


def test_models_preset_header_gives_the_memorys_read_rate_around_the_rows():
    from hybridllm.bench import models_preset

    rows = [{"memory_read_gbs": [71.6, 44.8]}, {"memory_read_gbs": [44.8, 46.2]}, {"status": "error"}]
    assert models_preset.memory_note(rows) == "the memory read 45-72 GB/s between the rows"
    assert models_preset.memory_note([{"status": "ok"}]) == ""  # rows of a run before the probe


def test_the_read_rate_alone_is_the_bandwidth_probes_read(monkeypatch):
    from hybridllm import hardware

    monkeypatch.setattr(hardware, "best_time", lambda fn, repeats, sync=None: 0.5)  # every timing: 0.5 s
    nbytes = 1 << 20
    assert hardware.measure_host_read(nbytes, repeats=1) == nbytes / 0.5 / 1e9
    assert hardware.measure_host_bandwidth(nbytes, repeats=1)["read"] == hardware.measure_host_read(nbytes, repeats=1)
