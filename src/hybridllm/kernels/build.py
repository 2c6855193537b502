"""Build and load the native decode kernels (``decode.cpp``, ``attention.cpp``) with the host's C++ compiler.

    library = load_decode_library()   # ctypes.CDLL, built once per machine and source version

The translation units compile side by side (one compiler process each), then link into one
shared library. It is compiled with ``-O3 -march=native -fopenmp-simd -pthread`` (its vector
loops; its threads are its own team, no OpenMP runtime; ``$HYBRIDLLM_KERNEL_MARCH`` replaces
``native``, e.g. ``x86-64-v3`` builds the AVX2 path on an AVX-512 machine) into a cache directory
(``$HYBRIDLLM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/hybridllm/kernels``, else
``~/.cache/hybridllm/kernels``) under a name that hashes the source, the compiler, the flags
and the CPU model, so an edit, another compiler or another machine sharing the home directory
each get their own build. The compiler is ``$CXX`` or the first of ``c++``/``g++``/``clang++``
on the PATH. Failures raise :class:`KernelBuildError` with a one-line reason; callers fall back
to the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridllm.errors import HybridLLMError

KERNEL_DIR = Path(__file__).parent
# The translation units (each includes the headers beside it): the exports, products and layers;
# the attention entry points (the block arithmetic's many instantiations, compiled in parallel).
UNITS = (KERNEL_DIR / "decode.cpp", KERNEL_DIR / "attention.cpp")


def sources() -> list[Path]:
    """Every file the build reads: the translation units and the headers they include."""
    return [*UNITS, *sorted(KERNEL_DIR.glob("*.h"))]

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-pthread", "-fno-math-errno", "-fvisibility=hidden", "-shared", "-fPIC",
         "-std=c++17")
MARCH_ENV = "HYBRIDLLM_KERNEL_MARCH"  # the -march the kernels are built for (default: native)
ABI_VERSION = 10  # must equal ABI_VERSION in abi.h


class KernelBuildError(HybridLLMError, RuntimeError):
    """The native kernels could not be built or loaded (no compiler, compile error, ...)."""


@dataclass(frozen=True)
class LoadedLibrary:
    """The loaded kernels and what loading them cost (``build_seconds`` is 0 on a cache hit)."""

    library: ctypes.CDLL
    path: Path
    build_seconds: float


def cache_dir() -> Path:
    if os.environ.get("HYBRIDLLM_KERNEL_CACHE"):
        return Path(os.environ["HYBRIDLLM_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hybridllm" / "kernels"


def find_compiler() -> str:
    """The C++ compiler to use: ``$CXX`` or the first one found on the PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise KernelBuildError(f"no C++ compiler found (tried {', '.join(candidates)}); install g++ or set CXX")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {compiler}: {exc}") from exc
    return done.stdout.splitlines()[0] if done.stdout else ""


def library_path(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the build for this source, compiler, flags and CPU lives."""
    key = hashlib.sha256()
    parts = [path.read_bytes() for path in sources()]
    for part in (*parts, _compiler_version(compiler).encode(), " ".join(flags).encode(), _cpu_model().encode(),
                 platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"decode-{key.hexdigest()[:16]}.so"


def default_flags(march: str | None = None) -> tuple[str, ...]:
    """:data:`FLAGS`, with ``-march=`` ``march`` (default: ``$HYBRIDLLM_KERNEL_MARCH``) where set."""
    march = (os.environ.get(MARCH_ENV, "") if march is None else march).strip()
    if not march:
        return FLAGS
    if not all(c.isalnum() or c in "-_." for c in march):
        raise KernelBuildError(f"{MARCH_ENV}={march!r} is not an architecture name (e.g. x86-64-v3, native)")
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)


def _first_error(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if "error" in line), stderr.strip()[:300])


def _compile(compiler: str, target: Path, flags: tuple[str, ...]) -> None:
    """Compile every unit to an object (in parallel), link them into ``target``."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build under private names, then rename: concurrent builds never load a half-written file.
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel cache {target.parent} ({exc.strerror}); "
                               "set HYBRIDLLM_KERNEL_CACHE to a writable folder") from exc
    step, running = f"compiling {UNITS[0].name}", []
    try:
        objects = [work / f"{unit.stem}.o" for unit in UNITS]
        running = [(unit, subprocess.Popen([compiler, *flags, "-c", str(unit), "-o", str(obj)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                   for unit, obj in zip(UNITS, objects)]
        for unit, process in running:  # the first failure ends the build (the others are killed below)
            _, stderr = process.communicate(timeout=600)
            if process.returncode != 0:
                raise KernelBuildError(f"compiling {unit.name} failed: {_first_error(stderr)}")
        step = f"linking {target.name}"
        linked = work / "linked.so"
        done = subprocess.run([compiler, *flags, *map(str, objects), "-o", str(linked)], capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            raise KernelBuildError(f"{step} failed: {_first_error(done.stderr)}")
        os.replace(linked, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{step} failed: {exc}") from exc
    finally:
        for _, process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(work, ignore_errors=True)


def build_library(extra_flags: tuple[str, ...] = (), march: str | None = None) -> LoadedLibrary:
    """Build (if not cached) and load the kernels with ``extra_flags`` after the default flags
    (e.g. ``("-mno-avx2",)`` builds the portable path on an AVX2 machine, as the tests do), for
    ``march`` (default: ``$HYBRIDLLM_KERNEL_MARCH``, else native): ``march="x86-64-v3"`` is the
    very build a process started with ``HYBRIDLLM_KERNEL_MARCH=x86-64-v3`` loads (one cached copy)."""
    compiler = find_compiler()
    flags = (*default_flags(march), *extra_flags)
    target = library_path(compiler, flags)
    t0 = time.perf_counter()
    built = not target.exists()
    if built:
        _compile(compiler, target, flags)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {target}: {exc}") from exc
    version = library.hl_abi_version()
    if version != ABI_VERSION:
        raise KernelBuildError(f"{target.name} has ABI version {version}, expected {ABI_VERSION}")
    return LoadedLibrary(library, target, time.perf_counter() - t0 if built else 0.0)


@functools.cache
def load_decode_library() -> LoadedLibrary:
    """The kernels every model uses, built on first use and shared by the whole process."""
    return build_library()
