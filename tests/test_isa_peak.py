"""tools/isa_peak.py: the vector peaks it builds and measures, and the prefill arithmetic it costs."""

from __future__ import annotations

import platform

import pytest
from conftest import NEEDS_COMPILER, tool_module

from hybridllm.config import ModelConfig
from hybridllm.hardware import cpu_flags


@pytest.fixture(scope="module")
def isa_peak():
    return tool_module("isa_peak")


@NEEDS_COMPILER
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the peak kernels are x86 intrinsics")
def test_the_peak_kernels_build_for_the_kernels_march_and_run_on_this_cpu(isa_peak, tmp_path):
    binary = isa_peak.build("native", tmp_path)
    measured = isa_peak.rates(binary, threads=2, iterations=20_000, best_of=1)
    flags = set(cpu_flags())
    expected = {"vfmadd_ymm", "vpmaddubsw_vpaddw_ymm"} if {"avx2", "fma"} <= flags else set()
    expected |= {"vfmadd_zmm"} if "avx512f" in flags else set()
    expected |= {"vpdpbusd_zmm"} if "avx512_vnni" in flags else set()
    assert set(measured) == expected  # -march=native: every kernel the CPU has, no other
    assert all(rate > 0 for rate in measured.values())
    avx2_only = isa_peak.rates(isa_peak.build("x86-64-v3", tmp_path), threads=1, iterations=20_000, best_of=1)
    assert set(avx2_only) == {"vfmadd_ymm", "vpmaddubsw_vpaddw_ymm"}  # the AVX2 build's instructions only


def test_peaks_take_the_widest_instructions_and_halve_the_dots_for_two_digits(isa_peak):
    rate = {"vpdpbusd_zmm": 10.0, "vfmadd_zmm": 4.0, "vfmadd_ymm": 5.0, "vpmaddubsw_vpaddw_ymm": 7.0}
    assert isa_peak.peaks(rate) == {"int8_macs": 640.0, "exact_macs": 320.0, "fmas": 64.0}
    avx2 = {"vfmadd_ymm": 5.0, "vpmaddubsw_vpaddw_ymm": 7.0}
    assert isa_peak.peaks(avx2) == {"int8_macs": 224.0, "exact_macs": 112.0, "fmas": 40.0}


def test_prefill_work_counts_the_weights_once_and_each_layers_keys_within_its_window(isa_peak):
    assert isa_peak.mean_keys(4, None) == 2.5  # 1 + 2 + 3 + 4 keys
    assert isa_peak.mean_keys(4, 2) == 1.75  # 1 + 2 + 2 + 2
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=2,
                         sliding_layers=(True, False))
    products, attention = isa_peak.prefill_work(config, 4)
    assert products == 2 * (32 * 8 * (2 * 4 + 2 * 2) + 3 * 32 * 48)
    assert attention == 2 * 4 * 8 * (1.75 + 2.5)  # q.k and p.v, per head: the windowed layer, the global one
