"""The kernels' headers (``src/hybridllm/kernels/*.h``): each compiles on its own, for every
instruction set the build may target (each header includes what it uses, as ggml-cpu's do)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hybridllm.kernels import build

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

KERNELS = build.KERNEL_DIR
HEADERS = sorted(path.name for path in KERNELS.glob("*.h"))
TARGETS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}


def _includes(path: Path) -> set[str]:
    return {line.split('"')[1] for line in path.read_text().splitlines() if line.startswith("#include \"")}


def test_the_build_reads_every_header():
    assert set(HEADERS) <= {path.name for path in build.sources()}  # an edit to any header rebuilds
    reached, frontier = set(), set().union(*(_includes(unit) for unit in build.UNITS))
    while frontier:  # what the translation units include, directly or through another header
        name = frontier.pop()
        reached.add(name)
        frontier |= _includes(KERNELS / name) - reached
    assert reached == set(HEADERS)  # every header is used, and nothing else of ours is included


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("header", HEADERS)
def test_each_header_compiles_alone(header, target):
    import platform

    if target != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    source = f'#include "{header}"\nint main() {{ return 0; }}\n'
    done = subprocess.run([build.find_compiler(), "-std=c++17", "-fsyntax-only", TARGETS[target], "-I", str(KERNELS),
                           "-x", "c++", "-"], input=source, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
