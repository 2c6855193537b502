"""``hybridllm doctor`` and the probe: it runs, its JSON has the promised shape, and missing
/proc or /sys files give "unknown" instead of a traceback."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridllm.doctor import (
    OK,
    UNKNOWN,
    WARN,
    check_cgroup_memory,
    check_cpu_governor,
    check_memlock,
    check_numa,
    check_swappiness,
    check_transparent_hugepages,
    run_checks,
)
from hybridllm.hardware import MachineProfile, measure_disk_read, measure_gpu
from hybridllm.planner.engine_probe import probe_machine

STATUSES = {OK, WARN, UNKNOWN}
CHECK_NAMES = {"vm.swappiness", "transparent hugepages", "NUMA", "locked memory (ulimit -l)", "CPU governor",
               "container memory limit"}


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_missing_files_give_unknown_not_a_traceback(tmp_path):
    checks = run_checks(root=tmp_path, memlock=(resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert {c.name for c in checks} == CHECK_NAMES
    by_name = {c.name: c for c in checks}
    for name in CHECK_NAMES - {"locked memory (ulimit -l)"}:
        assert by_name[name].status == UNKNOWN, by_name[name]
        assert by_name[name].recommendation
    assert by_name["locked memory (ulimit -l)"].status == OK


def test_probe_without_meminfo(monkeypatch):
    import psutil

    from hybridllm import hardware

    def broken():
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    assert hardware.memory_totals() == (0, 0)


def test_unreadable_and_garbage_files(tmp_path):
    write(tmp_path, "proc/sys/vm/swappiness", "not a number")
    write(tmp_path, "sys/kernel/mm/transparent_hugepage/enabled", "???")
    (tmp_path / "sys/devices/system/node").mkdir(parents=True)
    write(tmp_path, "sys/fs/cgroup/memory.max", "garbage")
    (tmp_path / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").mkdir(parents=True)  # a dir, not a file
    checks = {c.name: c for c in run_checks(root=tmp_path)}
    for name in ("vm.swappiness", "transparent hugepages", "NUMA", "CPU governor"):
        assert checks[name].status == UNKNOWN, checks[name]


def test_swappiness(tmp_path):
    write(tmp_path, "proc/sys/vm/swappiness", "60\n")
    write(tmp_path, "proc/meminfo", "MemTotal: 1000 kB\nSwapTotal: 2048 kB\n")
    check = check_swappiness(tmp_path)
    assert check.status == WARN and "vm.swappiness=10" in check.recommendation
    write(tmp_path, "proc/meminfo", "MemTotal: 1000 kB\nSwapTotal: 0 kB\n")
    assert check_swappiness(tmp_path).status == OK  # no swap: swappiness has no effect
    write(tmp_path, "proc/sys/vm/swappiness", "10\n")
    assert check_swappiness(tmp_path).status == OK


def test_transparent_hugepages(tmp_path):
    rel = "sys/kernel/mm/transparent_hugepage/enabled"
    write(tmp_path, rel, "always [madvise] never\n")
    assert check_transparent_hugepages(tmp_path).status == OK
    write(tmp_path, rel, "[always] madvise never\n")
    assert check_transparent_hugepages(tmp_path).value == "always"
    write(tmp_path, rel, "always madvise [never]\n")
    assert check_transparent_hugepages(tmp_path).status == WARN


def test_numa(tmp_path):
    write(tmp_path, "sys/devices/system/node/node0/cpulist", "0-3\n")
    assert check_numa(tmp_path).status == OK  # one node
    write(tmp_path, "sys/devices/system/node/node1/cpulist", "4-7\n")
    spread = check_numa(tmp_path, gpu_node=1, has_gpu=True, allowed_cpus=set(range(8)))
    assert spread.status == WARN and "--cpunodebind=1" in spread.recommendation
    assert check_numa(tmp_path, gpu_node=1, has_gpu=True, allowed_cpus={4, 5}).status == OK
    assert check_numa(tmp_path, gpu_node=None, has_gpu=True, allowed_cpus={4}).status == UNKNOWN
    assert check_numa(tmp_path, allowed_cpus={0, 1}).status == OK  # no GPU, bound to one node


def test_memlock():
    inf = resource.RLIM_INFINITY
    assert check_memlock(True, (inf, inf)).status == OK
    limited = check_memlock(True, (64 * 1024, 64 * 1024))
    assert limited.status == WARN and limited.value == "64 KiB" and "ulimit -l" in limited.recommendation
    assert check_memlock(False, (64 * 1024, 64 * 1024)).status == OK  # no GPU: no pinned buffers


def test_cpu_governor(tmp_path):
    for cpu, gov in (("cpu0", "performance"), ("cpu1", "performance")):
        write(tmp_path, f"sys/devices/system/cpu/{cpu}/cpufreq/scaling_governor", gov + "\n")
    assert check_cpu_governor(tmp_path).status == OK
    write(tmp_path, "sys/devices/system/cpu/cpu1/cpufreq/scaling_governor", "powersave\n")
    check = check_cpu_governor(tmp_path)
    assert check.status == WARN and check.value == "performance,powersave"


def test_cgroup_memory(tmp_path):
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    assert check_cgroup_memory(tmp_path, 2**34).status == OK
    write(tmp_path, "sys/fs/cgroup/memory.max", str(2**33))
    assert check_cgroup_memory(tmp_path, 2**34).status == WARN


def test_disk_read_of_a_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (3 * 2**20 + 123))
    disk = measure_disk_read(path)
    assert disk.bytes_read == path.stat().st_size
    assert disk.method in ("O_DIRECT", "posix_fadvise(DONTNEED)", "buffered")
    assert disk.read_gbs is None or disk.read_gbs > 0
    assert "small reads" in disk.note


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_no_gpu_means_no_cuda_figures():
    assert measure_gpu() is None


@pytest.mark.cuda
def test_gpu_figures():
    gpu = measure_gpu(repeats=2, nbytes=64 * 2**20)
    assert gpu is not None and gpu.vram_total_bytes > 0
    for figure in (gpu.bandwidth_gbs, gpu.h2d_pageable_gbs, gpu.d2h_pageable_gbs, gpu.flops):
        assert figure is not None and figure > 0
    assert gpu.pcie_gbs is None or gpu.pcie_gbs > 0


def test_profile_round_trips_through_json():
    from hybridllm.planner.inputs import load_model_config

    cfg, _, _ = load_model_config(Path(__file__).resolve().parents[1] / "configs" / "mistral-7b.json")
    profile = probe_machine(threads=1, quick=True, model_config=cfg)
    data = json.loads(json.dumps(profile.to_dict()))
    assert MachineProfile.from_dict(data) == profile
    assert profile.host_bandwidth_gbs == profile.model_gemv_gbs > 0 and profile.host_flops > 0
    assert set(profile.model_gemv_detail) >= {"layers", "head", "effective", "dtype"}
    assert profile.host_layer_overhead_s >= 0 and profile.host_token_overhead_s >= 0
    assert profile.ram_available_bytes <= profile.ram_total_bytes


@pytest.mark.slow
def test_cli_doctor_json_schema():
    proc = subprocess.run([sys.executable, "-m", "hybridllm.cli", "doctor", "--json", "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert {"profile", "checks", "summary"} <= set(report)
    profile = report["profile"]
    for key in ("cpu_model", "logical_cpus", "threads", "ram_total_bytes", "ram_available_bytes", "host_read_gbs",
                "host_copy_gbs", "host_gemv_gbs", "host_bandwidth_gbs", "host_flops", "host_layer_overhead_s",
                "host_token_overhead_s", "gpu", "disk", "notes"):
        assert key in profile, key
    if not torch.cuda.is_available():
        assert profile["gpu"] is None and any("no GPU" in n for n in profile["notes"])
    assert {c["name"] for c in report["checks"]} == CHECK_NAMES
    kernels = report["kernels"]
    assert kernels["march"] == "native" and (kernels["isa"] in {"avx512-vnni", "avx2-vnni", "avx2", "portable"}
                                             or kernels["error"])
    assert kernels["prefill_precision"] in {"int8 (AMX)", "int8"} or kernels["error"]  # the decode products
    assert kernels["amx_tiles"] == (kernels["prefill_precision"] == "int8 (AMX)")
    from hybridllm.kvcache.registry import STRATEGIES

    assert set(kernels["kv_strategies"]) == set(STRATEGIES) and all(kernels["kv_strategies"].values())
    for check in report["checks"]:
        assert set(check) == {"name", "status", "value", "recommendation"}
        assert check["status"] in STATUSES and check["recommendation"]
    assert sum(report["summary"].values()) == len(report["checks"])
    disk = profile["disk"]  # the default model's file
    assert disk is None or disk["bytes_read"] > 0


@pytest.mark.slow
def test_cli_doctor_table_and_bad_model():
    proc = subprocess.run([sys.executable, "-m", "hybridllm.cli", "doctor", "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "vm.swappiness" in proc.stdout and "host memory bandwidth" in proc.stdout
    assert "KV caches the kernels read" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "hybridllm.cli", "doctor", "--model", "/nonexistent.gguf"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
