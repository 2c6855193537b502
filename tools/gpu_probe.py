#!/usr/bin/env python
"""What the GPU run stands on: the imports it needs and the versions, as JSON.

    python tools/gpu_probe.py $OUT/setup.json

Imports ``hybridllm.cli`` (everything a command needs at start), then records Python, PyTorch,
its CUDA, the GPU's name and memory, Triton's version, the host's CPU model and core count (every
table names the machine) and where ``hybridllm`` was imported from.
A missing dependency fails here, in the set-up stage, with its name, before any measurement.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

import hybridllm
import hybridllm.cli  # noqa: F401  (the import is the check)


def cpu_model() -> str | None:
    """The host CPU's model name (/proc/cpuinfo), None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def probe() -> dict:
    gpu = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if gpu else None,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
            "triton": triton_version, "cpu": cpu_model(), "cpu_cores": os.cpu_count(), "hybridllm": hybridllm.__file__}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/gpu_probe.py OUT.json")
    record = probe()
    print(json.dumps(record))
    Path(sys.argv[1]).write_text(json.dumps(record, indent=2) + "\n")
