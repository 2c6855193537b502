"""The planner's arithmetic on plain numbers: weight and KV bytes, the predictor, the search, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridllm.config import ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.placement.placement import Placement
from hybridllm.planner.inputs import hardware_from, load_model_config
from hybridllm.planner.memory import (
    HOST_RUNTIME_BYTES,
    KV_DTYPES,
    WEIGHT_FORMATS,
    kv_bytes_per_token,
    layer_matrix_params,
    matrix_bytes,
    scratch_bytes,
    weight_bytes,
)
from hybridllm.planner.roofline import Candidate, Hardware, predict, prefill_flops
from hybridllm.planner.search import PlanError, candidates, device_only_max_context, plan

ROOT = Path(__file__).resolve().parents[1]
MISTRAL_JSON = ROOT / "configs" / "mistral-7b.json"
GiB = 2**30
GB = 1e9

# Mistral-7B-v0.1's published numbers (the same as configs/mistral-7b.json).
MISTRAL = ModelConfig(arch="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, n_layers=32,
                      n_heads=32, n_kv_heads=8, head_dim=128, max_position_embeddings=32768)


def gpu_8gib(ram: int = 32 * GiB) -> Hardware:
    return Hardware(has_device=True, device_budget=8 * GiB, host_budget=ram, device_bandwidth=256 * GB,
                    host_bandwidth=40 * GB, pcie_bandwidth=12 * GB, device_flops=20e12, host_flops=200e9,
                    device_layer_overhead_s=100e-6, host_layer_overhead_s=150e-6, device_token_overhead_s=500e-6,
                    host_token_overhead_s=1e-3)


# ---- weight bytes ------------------------------------------------------------------------
def test_matrix_bytes_per_format():
    rows, cols = 4096, 4096
    n = rows * cols
    assert matrix_bytes(rows, cols, "float32") == 4 * n
    assert matrix_bytes(rows, cols, "float16") == matrix_bytes(rows, cols, "bfloat16") == 2 * n
    assert matrix_bytes(rows, cols, "int8") == n + 2 * rows  # + one fp16 scale per output channel
    assert matrix_bytes(rows, cols, "int4") == n * 5 // 8  # 4 bits + fp16 scale and offset per 32 = 5 bits
    assert matrix_bytes(rows, cols, "q4_k_m") == math.ceil(n * 4.85 / 8)
    with pytest.raises(ConfigError, match="unknown weight format"):
        matrix_bytes(2, 2, "int3")


def test_mistral_weight_bytes():
    assert layer_matrix_params(MISTRAL) == 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336
    fp16 = weight_bytes(MISTRAL, "float16")
    assert fp16.total == 2 * MISTRAL.parameter_count() == 14_483_464_192  # ~14.5 GB
    assert weight_bytes(MISTRAL, "float32").total == 2 * fp16.total
    assert weight_bytes(MISTRAL, "bfloat16").total == fp16.total
    q4 = weight_bytes(MISTRAL, "q4_k_m").total
    assert 4.3e9 < q4 < 4.5e9  # ~4.85 bits per weight
    assert q4 < weight_bytes(MISTRAL, "int4").total < weight_bytes(MISTRAL, "int8").total < fp16.total
    # the head is read by every decode step; untied: its own matrix
    assert fp16.head == fp16.embed == 2 * 32000 * 4096


def test_tied_embedding_counted_once():
    tied = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30,
                       n_heads=9, n_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    wb = weight_bytes(tied, "float32")
    assert wb.head == 0 and wb.head_read == wb.embed + wb.final_norm
    assert wb.total == 4 * tied.parameter_count()


# ---- KV bytes ------------------------------------------------------------------------------
def test_kv_bytes_per_token_mistral():
    assert kv_bytes_per_token(MISTRAL, "float16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(MISTRAL, "bfloat16") == 131072
    assert kv_bytes_per_token(MISTRAL, "float32") == 262144
    assert kv_bytes_per_token(MISTRAL, "float16") == MISTRAL.kv_bytes_per_token(2)
    # codes + an fp16 scale and zero point per group of 64 elements
    assert kv_bytes_per_token(MISTRAL, "int8") == 65536 * (1 + 4 / 64) == 69632
    assert kv_bytes_per_token(MISTRAL, "int4") == 65536 * (0.5 + 4 / 64) == 36864


def test_kv_is_linear_in_head_dim_not_quadratic():
    small = kv_bytes_per_token(MISTRAL, "float16")
    import dataclasses

    double = dataclasses.replace(MISTRAL, head_dim=256)
    assert kv_bytes_per_token(double, "float16") == 2 * small


# ---- device-only context ------------------------------------------------------------------------
def test_device_only_max_context():
    hw = gpu_8gib()
    free = 8 * GiB - weight_bytes(MISTRAL, "q4_k_m").total - scratch_bytes(MISTRAL, 2, 512)
    expected = int(0.95 * free // 131072)  # the ledger evicts at 95% of what the weights leave
    assert device_only_max_context(MISTRAL, "q4_k_m", hw, "float16") == expected
    assert 29_000 < expected < 32_768
    assert device_only_max_context(MISTRAL, "float16", hw, "float16") == 0  # 14.5 GB of weights do not fit


def test_device_only_max_context_is_capped_by_the_window_cpu_only():
    hw = Hardware.cpu_only(1000 * GiB, 10 * GB, 1e11, 0.0, 0.0)
    assert device_only_max_context(MISTRAL, "float16", hw, "float32") == MISTRAL.max_position_embeddings


# ---- the predictor --------------------------------------------------------------------------------
def test_decode_time_is_bytes_over_bandwidth_plus_overheads():
    hw = Hardware.cpu_only(64 * GiB, 10 * GB, 1e11, layer_overhead_s=1e-4, token_overhead_s=2e-3)
    ctx = 1000
    pred = predict(MISTRAL, Candidate("float16", 32), hw, ctx, "float32")
    wb = weight_bytes(MISTRAL, "float16")
    read = 32 * wb.layer + wb.head_read + kv_bytes_per_token(MISTRAL, "float32") * ctx
    expected = read / (10 * GB) + 2e-3 + 32 * 1e-4
    assert pred.decode_bytes == {"device": read, "host": 0, "bus": 0}
    assert 1 / pred.decode_tps == pytest.approx(expected)
    assert pred.decode_s["overhead"] == pytest.approx(2e-3 + 32e-4)


def test_split_reads_host_layers_at_host_bandwidth():
    hw = gpu_8gib()
    nd = 10
    pred = predict(MISTRAL, Candidate("float16", nd), hw, 1000, "float16")
    wb = weight_bytes(MISTRAL, "float16")
    kvl = 131072 // 32 * 1000
    assert pred.decode_bytes["device"] == nd * (wb.layer + kvl)
    assert pred.decode_bytes["host"] == (32 - nd) * (wb.layer + kvl) + wb.head_read
    assert pred.decode_bytes["bus"] == 2 * 4096 * 2  # the hidden state crosses twice per token
    assert pred.decode_s["host"] == pytest.approx(pred.decode_bytes["host"] / (40 * GB))


def test_prefill_is_compute_bound():
    hw = Hardware.cpu_only(64 * GiB, 10 * GB, 1e11, 0.0, 0.0)
    f = prefill_flops(MISTRAL, 1024, 512)
    assert f["chunks"] == 2
    assert f["layer"] == 2 * layer_matrix_params(MISTRAL) * 1024 + 2 * 32 * 128 * 1024 * 1025
    pred = predict(MISTRAL, Candidate("float16", 32), hw, 1024, "float32")
    assert pred.ttft_s == pytest.approx((32 * f["layer"] + f["head"]) / 1e11)
    # twice the FLOP rate halves TTFT; twice the bandwidth does not change it
    faster = Hardware.cpu_only(64 * GiB, 20 * GB, 2e11, 0.0, 0.0)
    assert predict(MISTRAL, Candidate("float16", 32), faster, 1024, "float32").ttft_s == pytest.approx(pred.ttft_s / 2)


def test_memory_per_tier_of_a_split():
    hw = gpu_8gib()
    pred = predict(MISTRAL, Candidate("float16", 10), hw, 2000, "float16")
    wb = weight_bytes(MISTRAL, "float16")
    kvl = 131072 // 32
    scratch = scratch_bytes(MISTRAL, 2, 512)
    assert pred.peak_device_bytes == 10 * wb.layer + 10 * kvl * 2000 + scratch
    outer = wb.embed + wb.head + wb.final_norm
    assert pred.peak_host_bytes == 22 * wb.layer + outer + 22 * kvl * 2000 + scratch + HOST_RUNTIME_BYTES


# ---- the search --------------------------------------------------------------------------------------
def test_plan_mistral_on_8gib_at_12000_tokens():
    result = plan(MISTRAL, gpu_8gib(), 12000, "float16")
    assert result.fits
    assert result.weight_format == "q4_k_m"
    assert result.placement.n_gpu_layers == 32 and result.placement.kv.kv_cache == "dynamic"
    assert result.prediction.peak_device_bytes <= 8 * GiB
    assert result.device_only_max_context > 12000
    assert "q4_k_m" in result.reason and "--weights float16" in result.reason


def test_plan_keeping_float16_offloads_layers():
    result = plan(MISTRAL, gpu_8gib(), 12000, "float16", formats=["float16"])
    assert result.fits and result.weight_format == "float16"
    assert 0 < result.placement.n_gpu_layers < 32
    assert result.placement.layer_tiers[:result.placement.n_gpu_layers] == ["device"] * result.placement.n_gpu_layers
    assert result.prediction.peak_device_bytes <= 8 * GiB
    assert result.prediction.peak_host_bytes <= 32 * GiB
    assert result.device_only_max_context == 0
    # the chosen candidate is the fastest fitting one
    hw = gpu_8gib()
    best = max(predict(MISTRAL, c, hw, 12000, "float16").decode_tps
               for c in candidates(MISTRAL, ["float16"], hw, 12000, "float16")
               if predict(MISTRAL, c, hw, 12000, "float16").fits)
    assert result.prediction.decode_tps == pytest.approx(best)


def test_plan_cpu_only_says_so():
    hw = Hardware.cpu_only(16 * GiB, 10 * GB, 1e11, 1e-4, 1e-3)
    result = plan(MISTRAL, hw, 4096, "float32", formats=["float16"])
    assert result.cpu_only and result.fits
    assert "CPU only" in result.reason
    assert result.placement.layer_tiers == ["device"] * 32 and result.placement.decode_on == "device"
    assert result.placement.kv.vram_budget is None


def test_plan_context_that_does_not_fit_says_by_how_much():
    hw = Hardware.cpu_only(15 * GiB, 10 * GB, 1e11, 1e-4, 1e-3)  # the weights fit, no KV strategy does
    result = plan(MISTRAL, hw, 32768, "float32", formats=["float16"])
    assert not result.fits
    assert "no placement fits 32768 tokens" in result.reason and "more RAM" in result.reason


def test_impossible_plan_names_the_shortfall():
    hw = gpu_8gib(ram=2 * GiB)
    hw = Hardware(**{**hw.__dict__, "device_budget": 1 * GiB})
    need = weight_bytes(MISTRAL, "q4_k_m").total
    with pytest.raises(PlanError) as info:
        plan(MISTRAL, hw, 4096, "float16")
    message = str(info.value)
    assert f"short by {need - 3 * GiB} bytes" in message
    assert "q4_k_m" in message and "RAM + VRAM" in message
    with pytest.raises(PlanError, match=f"short by {weight_bytes(MISTRAL, 'float16').total - 3 * GiB} bytes"):
        plan(MISTRAL, hw, 4096, "float16", formats=["float16"])


def test_bad_inputs():
    hw = gpu_8gib()
    with pytest.raises(ConfigError, match="context window"):
        plan(MISTRAL, hw, 40000, "float16")
    with pytest.raises(ConfigError, match="unknown weight format"):
        plan(MISTRAL, hw, 100, "float16", formats=["fp8"])
    with pytest.raises(ConfigError, match="compute dtype"):
        plan(MISTRAL, hw, 100, "int8")
    with pytest.raises(ConfigError, match="--ram"):
        hardware_from(None)


def test_hardware_from_sources():
    hw, sources = hardware_from(None, vram=8 * GiB, ram=32 * GiB, device_bandwidth_gbs=300, pcie_gbs=10)
    assert hw.has_device and hw.device_bandwidth == 300 * GB and hw.pcie_bandwidth == 10 * GB
    assert sources["device_bandwidth"] == "given" and sources["device_flops"] == "assumed"
    cpu, sources = hardware_from(None, ram=8 * GiB, host_bandwidth_gbs=12)
    assert not cpu.has_device and cpu.device_bandwidth == cpu.host_bandwidth == 12 * GB
    assert "device_bandwidth" not in sources


def test_plan_to_dict_keys_and_placement_round_trip():
    result = plan(MISTRAL, gpu_8gib(), 12000, "float16")
    data = json.loads(json.dumps(result.to_dict()))
    assert {"weights_bytes", "kv_bytes_per_token", "device_only_max_context", "placement", "predicted", "fits",
            "reason"} <= set(data)
    assert set(data["weights_bytes"]) == set(WEIGHT_FORMATS)
    assert set(data["kv_bytes_per_token"]) == set(KV_DTYPES)
    assert set(data["predicted"]) == {"decode_tps", "ttft_s", "peak_device_bytes", "peak_host_bytes"}
    assert Placement.from_dict(data["placement"], n_layers=32) == result.placement


def test_load_model_config_from_config_json():
    cfg, name, has_weights = load_model_config(MISTRAL_JSON)
    assert not has_weights and name == "mistral-7b.json"
    _, default_name, default_has_weights = load_model_config(None)
    assert default_has_weights and default_name == "SmolLM2-135M-Instruct.Q4_1"  # the name `models` shows
    assert (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 32000)


# ---- the command line ------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridllm.cli", *args], capture_output=True, text=True, timeout=300,
                          check=False)


MISTRAL_ARGS = ("plan", "--model", str(MISTRAL_JSON), "--vram", "8GiB", "--ram", "32GiB", "--context", "12000",
                "--device-bandwidth", "256", "--pcie-bandwidth", "12", "--host-bandwidth", "40", "--no-probe")


@pytest.mark.slow
def test_cli_plan_json():
    proc = run_cli(*MISTRAL_ARGS, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kv_bytes_per_token"]["float16"] == 131072
    assert data["weights_bytes"]["float16"] == 14_483_464_192
    assert data["fits"] is True and data["placement"]["layer_tiers"] == ["device"] * 32
    assert data["predicted"]["decode_tps"] > 0 and data["predicted"]["ttft_s"] > 0


@pytest.mark.slow
def test_cli_plan_table_and_impossible_plan():
    proc = run_cli(*MISTRAL_ARGS)
    assert proc.returncode == 0, proc.stderr
    for needle in ("placement", "predicted decode", "predicted TTFT", "peak device", "reason", "131072"):
        assert needle in proc.stdout
    proc = run_cli("plan", "--model", str(MISTRAL_JSON), "--vram", "1GiB", "--ram", "2GiB", "--no-probe")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "short by" in lines[0] and "Traceback" not in proc.stderr
    proc = run_cli("plan", "--model", str(MISTRAL_JSON), "--ram", "32GiB", "--no-probe", "--apply")
    assert proc.returncode == 2 and "config.json" in proc.stderr


def _llm_takes_placement() -> bool:
    import inspect

    from hybridllm.llm import LLM

    return "placement" in inspect.signature(LLM.__init__).parameters


@pytest.mark.slow
def test_cli_plan_apply_reports_predicted_and_measured():
    proc = run_cli("plan", "--apply", "--json", "--no-probe", "--ram", "8GiB", "--max-tokens", "4", "--threads", "2")
    if not _llm_takes_placement():
        assert proc.returncode == 2 and "placement" in proc.stderr and "Traceback" not in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"predicted", "measured", "plan"} <= set(out)
    assert {"decode_tps", "ttft_s", "peak_device_bytes", "peak_host_bytes"} <= set(out["predicted"])
    assert out["measured"]["generated_tokens"] == 4


def test_capacity_divides_the_target_by_one_replicas_rate():
    from hybridllm.planner.capacity import Capacity

    assert Capacity(100, 25).replicas == 4  # exact: no extra replica
    assert Capacity(101, 25).replicas == 5
    assert Capacity(1, 25).replicas == 1
    assert Capacity(0.3, 0.1).replicas == 3  # float division that lands a hair above 3
    assert Capacity(90, 30).to_dict() == {"target_tokens_per_s": 90, "replica_decode_tps": 30, "replicas": 3}
    assert "--replicas 3" in Capacity(90, 30).describe()
    with pytest.raises(ConfigError, match="--target-tokens-per-s"):
        Capacity(0, 25)


@pytest.mark.slow
def test_cli_plan_target_tokens_per_s_gives_the_replica_count():
    proc = run_cli(*MISTRAL_ARGS, "--json", "--target-tokens-per-s", "100")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    per_replica = data["predicted"]["decode_tps"]
    assert data["capacity"] == {"target_tokens_per_s": 100.0, "replica_decode_tps": per_replica,
                                "replicas": math.ceil(100 / per_replica)}
    proc = run_cli(*MISTRAL_ARGS, "--target-tokens-per-s", "100")
    assert proc.returncode == 0 and f"serve --ray --replicas {math.ceil(100 / per_replica)}" in proc.stdout
    proc = run_cli(*MISTRAL_ARGS, "--target-tokens-per-s", "-1")
    assert proc.returncode == 2 and "--target-tokens-per-s must be > 0" in proc.stderr
