"""Decode threads and wait policy picked at run time (``hybridllm.kernels.threads``): the choice
function on plain numbers, the CPU-time bookkeeping on a fake /proc/stat, and decode with a busy
loop pinned to one core giving the same tokens as on an idle machine. No wall-time assertions
(the busy-core speed ratio is a benchmark: docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridllm.kernels import threads
from hybridllm.kernels.threads import (
    FREE_MARGIN,
    SPIN_FREE,
    SPIN_SHARED,
    CpuSample,
    MachineLoad,
    TeamChoice,
    ThreadPolicy,
    busy_elsewhere,
    choose_team,
    read_sample,
)

from conftest import NEEDS_COMPILER


@pytest.mark.parametrize("requested, cpus, busy, expected", [
    (2, 2, 0.0, TeamChoice(2, SPIN_FREE)),      # idle: every thread asked for, spinning waits
    (2, 2, 0.2, TeamChoice(2, SPIN_FREE)),      # a little other work: still both cores
    (2, 2, 1.0, TeamChoice(1, SPIN_SHARED)),    # a core taken: one thread (barriers would wait on it)
    (2, 2, 0.8, TeamChoice(1, SPIN_SHARED)),    # most of a core taken
    (2, 2, 2.0, TeamChoice(1, SPIN_SHARED)),    # everything taken: never fewer than one
    (8, 2, 0.0, TeamChoice(2, SPIN_FREE)),      # never more than the usable CPUs
    (1, 16, 0.0, TeamChoice(1, SPIN_FREE)),     # never more than asked for
    (16, 16, 3.0, TeamChoice(13, SPIN_SHARED)),  # three cores' worth of other work
    (4, 4, -0.5, TeamChoice(4, SPIN_FREE)),     # a negative estimate (clock skew) counts as idle
])
def test_choose_team(requested, cpus, busy, expected):
    assert choose_team(requested, cpus, busy) == expected


def test_busy_elsewhere_subtracts_this_process():
    before = CpuSample(seconds=10.0, busy=100.0, own=5.0)
    after = CpuSample(seconds=12.0, busy=104.0, own=7.0)  # 4 busy CPU seconds in 2 s, 2 of them ours
    assert busy_elsewhere(before, after) == pytest.approx(1.0)
    assert busy_elsewhere(after, after) == 0.0
    assert busy_elsewhere(before, CpuSample(12.0, 101.0, 8.0)) == 0.0  # never negative


def _fake_stat(tmp_path, cpu1_busy: int):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 900 9000 0 0 0 0 0 0\n"
                    "cpu0 400 0 400 4000 0 0 0 0 0 0\n"
                    f"cpu1 {cpu1_busy} 0 100 4000 0 10 10 30 0 0\n"
                    "intr 12345\n")
    return stat


def test_read_sample_counts_only_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "_PROC_STAT", _fake_stat(tmp_path, 500))
    tick = os.sysconf("SC_CLK_TCK")
    assert read_sample({1}).busy == pytest.approx((500 + 100 + 10 + 10 + 30) / tick)  # steal counts as busy
    assert read_sample({0, 1}).busy == pytest.approx((800 + 650) / tick)
    monkeypatch.setattr(threads, "_PROC_STAT", tmp_path / "missing")
    assert read_sample({0}) is None


def test_policy_follows_the_load_between_decisions(monkeypatch):
    samples = iter([CpuSample(0.0, 0.0, 0.0),   # at construction
                    CpuSample(1.0, 2.0, 1.0),   # one core's worth of other work
                    CpuSample(2.0, 4.0, 3.0)])  # only ours
    monkeypatch.setattr(threads, "read_sample", lambda cpus: next(samples))
    policy = ThreadPolicy(every_s=0.0, cpus={0, 1})
    assert policy.team(2) == TeamChoice(1, SPIN_SHARED)
    assert policy.team(2) == TeamChoice(2, SPIN_FREE)


def test_machine_load_line_says_when_it_is_loaded():
    idle, loaded = MachineLoad(2, 0.05, 0.3), MachineLoad(2, 1.0, 4.0)
    assert not idle.loaded and "not loaded" in idle.line()
    assert loaded.loaded and loaded.decode_threads == 1
    assert "loaded: decode runs 1 thread" in loaded.line() and "load average 4.00" in loaded.line()
    assert MachineLoad(2, FREE_MARGIN, None).loaded


# ---- decode beside a busy core --------------------------------------------------------------------


@NEEDS_COMPILER
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_decode_beside_a_busy_core_gives_the_same_tokens(tiny_models):
    from hybridllm import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"][1]), threads=2)
    assert llm.runner.report.build.whole_step
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    idle = llm.generate("The sky is", params).token_ids
    core = max(threads.usable_cpus())
    busy = subprocess.Popen([sys.executable, "-c",
                             f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"])
    try:
        team = llm.runner.backend.steps.team
        team.policy.every_s = 0.0  # decide at every step: the busy loop is seen from the second one
        loaded = [llm.generate("The sky is", params).token_ids for _ in range(2)]
        assert busy.poll() is None  # the loop ran all along
    finally:
        busy.kill()
        busy.wait()
    assert loaded == [idle, idle]
    assert torch.get_num_threads() == 2  # the process's own setting is left alone


def test_a_fixed_team_uses_the_requested_threads():
    assert threads.FixedTeam().team(3) == TeamChoice(3, SPIN_FREE)
    assert threads.FixedTeam().team(0) == TeamChoice(1, SPIN_FREE)
