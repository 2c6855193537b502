"""Shared fixtures: tiny random models (HF folder + GGUF), the default model, and loaded
``LLM``s shared by configuration (``shared_llm``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_hf_model, save_as_gguf  # noqa: E402

ARCHS = ("llama", "llama3", "qwen2", "mistral")  # the Llama layout: every fast path runs them
# Families with pieces the native kernels lack (q/k norm, partial rotary, the Gemma block and its
# sliding-window / soft-capped attention) or a stacked checkpoint.
MORE_ARCHS = ("qwen3", "phi3", "phi3_partial", "gemma2", "gemma3")
ALL_ARCHS = ARCHS + MORE_ARCHS
# Packages of the optional extras that some test modules need at import: where one is missing (the
# lent GPU's image has neither), those modules skip, so `pytest -m cuda tests` still collects.
OPENAI_MISSING = "the openai client is in the dev extra (pip install -e '.[dev]')"
RAY_MISSING = "Ray is in the ray extra (pip install -e '.[ray]')"
SCHEMATHESIS_MISSING = "Schemathesis is in the dev extra (pip install -e '.[dev]')"


def import_extra(module: str, reason: str) -> Any:
    """``module``, or a skip of the calling test module where it is missing; in CI (``CI`` set,
    where `make test` installs every extra) a missing one is an error, never a silent skip."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool_module(name: str) -> Any:
    """tools/<name>.py loaded as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _have_compiler() -> bool:
    from hybridllm.kernels import build

    try:
        build.find_compiler()
    except build.KernelBuildError:
        return False
    return True


# The native kernels need a C++ compiler; without one their tests are skipped (like the CUDA
# ones) and the engine runs its PyTorch steps.
NEEDS_COMPILER = pytest.mark.skipif(not _have_compiler(), reason="needs a C++ compiler for the native kernels")


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where there is none)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and f" {flag}" in cpuinfo.read_text(errors="replace")


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def each_build(request):
    """The kernels of this machine's build, the AVX2 build and the portable build in turn (the tests
    of one arithmetic on every instruction set)."""
    if request.param == "native":
        from hybridllm.kernels.abi import kernels

        return kernels()
    return request.getfixturevalue(f"{request.param}_library")


@pytest.fixture(scope="session")
def portable_library():
    """The kernels built without x86 vector extensions (no AVX2, FMA or F16C): the path of other CPUs."""
    from hybridllm.kernels import build, native

    return native._declare(build.build_library(("-mno-avx2", "-mno-fma", "-mno-f16c")).library)


@pytest.fixture(scope="session")
def avx2_library():
    """The kernels built for x86-64-v3 (AVX2 + FMA, no AVX-512, no VNNI): the path of most laptops,
    also on an AVX-512 machine; the very build ``HYBRIDLLM_KERNEL_MARCH=x86-64-v3`` loads."""
    from hybridllm.kernels import build, native

    if not _cpu_has("avx2"):
        pytest.skip("needs an x86 CPU with AVX2")
    return native._declare(build.build_library(march="x86-64-v3").library)


@pytest.fixture(scope="session")
def narrow_vectors_library():
    """The native build with the compiler preferring 128-bit vectors: where a kernel left an order of
    float operations to the compiler's choice of vector width (an ``omp simd`` reduction), its bits
    differ from the default build's."""
    from hybridllm.kernels import build, native

    if not _cpu_has("avx2"):
        pytest.skip("needs an x86 CPU with AVX2")
    return native._declare(build.build_library(("-mprefer-vector-width=128",)).library)


@pytest.fixture(scope="session")
def avx2_vnni_library():
    """The kernels built for x86-64-v3 with AVX-VNNI (vpdpbusd on 256 bits: Alder Lake and later);
    None where the CPU has no AVX-VNNI."""
    from hybridllm.kernels import build, native

    if not _cpu_has("avx_vnni"):
        return None
    return native._declare(build.build_library(("-mavxvnni",), march="x86-64-v3").library)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, Path, torch.nn.Module]]:
    """arch -> (HF folder, GGUF file, the transformers model) for every tiny architecture."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ALL_ARCHS:
        folder = root / arch
        model = build_hf_model(folder, arch)
        out[arch] = (folder, save_as_gguf(folder, root / f"{arch}.gguf"), model)
    return out


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from hybridllm.loading.registry import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def shared_llm() -> Callable[..., Any]:
    """``shared_llm(**options)``: an ``LLM(**options)`` loaded once per distinct set of options
    for the whole session (paths count by their text). Only for tests that use the model as it
    is (generate, forward, read its figures): a test that transforms the model or changes the
    LLM's settings builds its own."""
    from hybridllm import LLM

    loaded: dict[frozenset, Any] = {}

    def get(**options: Any) -> Any:
        key = frozenset((name, os.fspath(value) if isinstance(value, os.PathLike) else value)
                        for name, value in options.items())
        if key not in loaded:
            loaded[key] = LLM(**options)
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def default_llm(shared_llm):
    """The default model dequantized to float32 on the CPU (the golden reference: transformers
    runs the same file in float32), loaded once for the session."""
    return shared_llm(weights="float")
