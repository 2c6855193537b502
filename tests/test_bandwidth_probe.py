"""tools/bandwidth_probe.py: a row of read rates per round, one per buffer; one-line errors for bad sizes."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import TOOLS, tool_module

from hybridllm.host_pages import collapse_tensor

TOOL = TOOLS / "bandwidth_probe.py"


def test_each_buffer_gets_its_own_positive_rate():
    probe = tool_module("bandwidth_probe")
    rates = probe.read_rates([torch.ones(1 << 16), torch.ones(1 << 17)])
    assert len(rates) == 2 and all(rate > 0 for rate in rates)


def test_the_command_prints_a_row_per_round_and_refuses_empty_sizes():
    done = subprocess.run([sys.executable, str(TOOL), "--buffers", "3", "--mib", "1", "--rounds", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.strip().splitlines()
    assert "3 buffers of 1 MiB" in header and len(rows) == 2
    assert all(len(row.split()) == 1 + 3 and all(float(rate) > 0 for rate in row.split()[1:]) for row in rows)
    refused = subprocess.run([sys.executable, str(TOOL), "--mib", "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "must be at least 1" in refused.stderr and "Traceback" not in refused.stderr
    too_big = subprocess.run([sys.executable, str(TOOL), "--buffers", "1", "--mib", str(1 << 27)],  # 128 TiB
                             capture_output=True, text=True, timeout=120)
    assert too_big.returncode == 1 and "cannot allocate" in too_big.stderr and "Traceback" not in too_big.stderr


def test_huge_pages_odd_names_each_buffers_pages():
    done = subprocess.run([sys.executable, str(TOOL), "--buffers", "2", "--mib", "6", "--rounds", "1", "--threads", "1",
                           "--huge-pages", "odd"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.strip().splitlines()
    # where the kernel collapses pages the header says which buffer is which; elsewhere it says nothing
    can_collapse = collapse_tensor(torch.ones(6 << 20, dtype=torch.uint8)) > 0
    assert header.endswith("(4K 2M pages)" if can_collapse else "1 threads"), header
    assert len(row.split()) == 1 + 2
