"""The machine: what it has and how fast it is, measured once per call, shared by ``doctor``, the
planner and the benchmark.

Every probe is one small function that returns plain numbers (or None when it cannot be taken
here, e.g. CUDA figures on a machine without a GPU). Nothing is cached globally: each call
measures again, because a busy machine (other processes, thermal state) changes the figures.
The engine's own figures at a model's shapes (decode bandwidth, per-layer overhead) are measured
by :mod:`hybridllm.planner.engine_probe`, which completes a :class:`MachineProfile`.

What is measured, and how:

- facts: the CPU's model name and instruction-set extensions (/proc/cpuinfo), logical CPUs and
  the threads PyTorch uses, RAM total and available (psutil), the container's cgroup memory
  limit, the NUMA nodes and their CPUs (sysfs), the GPU's name, memory and NUMA node.
- host memory bandwidth: the best of a few repeats of (a) a reduction (``sum``) over a large
  float32 tensor (read bandwidth), (b) a tensor copy (read + write, both counted), and (c) a
  matrix-vector product over a large float32 matrix (``W @ x``). Decode is a chain of
  matrix-vector products, so (c), ``host_gemv_gbs``, is the generic figure the planner uses for
  bytes read on the host; (a) and (b) are reported for comparison. The tensors are larger than
  any last-level cache and use the thread count the engine will use.
- host FLOP rate: a square float32 matmul (1024^3 multiply-adds), best of a few repeats.
- GPU (only when ``torch.cuda.is_available()``): device memory bandwidth (device-to-device copy,
  read + write counted, timed with CUDA events), host->device and device->host bandwidth with
  pinned and pageable host buffers (PCIe), an fp16 matmul FLOP rate, total and free VRAM.
- disk: sequential read speed of a model file, read with ``O_DIRECT`` (bypassing the page
  cache); where the file system refuses ``O_DIRECT`` (tmpfs, some overlay file systems) the
  file's cached pages are dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first, and where
  that is unavailable too the read is buffered and the profile says it may come from the cache.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

GB = 1e9
DEFAULT_BANDWIDTH_BYTES = 256 * 2**20  # larger than any CPU's last-level cache
QUICK_BANDWIDTH_BYTES = 64 * 2**20
DISK_READ_BYTES = 256 * 2**20  # read at most this much of a model file
_DISK_CHUNK = 8 * 2**20
_ALIGN = 4096  # O_DIRECT alignment of buffer, offset and size


@dataclass
class GPUProfile:
    """Figures of one CUDA device. Bandwidths in GB/s (1e9 bytes/s), FLOP rate in FLOP/s."""

    index: int
    name: str
    vram_total_bytes: int
    vram_free_bytes: int
    bandwidth_gbs: float | None = None  # device memory, copy (read + write counted)
    h2d_pinned_gbs: float | None = None
    h2d_pageable_gbs: float | None = None
    d2h_pinned_gbs: float | None = None
    d2h_pageable_gbs: float | None = None
    flops: float | None = None  # fp16 matmul
    layer_overhead_s: float | None = None
    token_overhead_s: float | None = None
    model_gemv_gbs: float | None = None  # decode bandwidth at a model's matrix shapes (fp16)
    model_flops: float | None = None  # prefill-chunk matmul rate at a model's matrix shapes (fp16)
    pci_bus_id: str | None = None
    numa_node: int | None = None

    @property
    def pcie_gbs(self) -> float | None:
        """The host<->device figure the planner uses: pinned, the slower direction."""
        figures = [x for x in (self.h2d_pinned_gbs, self.d2h_pinned_gbs) if x]
        return min(figures) if figures else None


@dataclass
class DiskProfile:
    """Sequential read of (part of) a model file."""

    path: str
    bytes_read: int
    read_gbs: float | None
    method: str  # "O_DIRECT", "posix_fadvise(DONTNEED)" or "buffered"
    note: str = ""


@dataclass
class MachineProfile:
    """What the planner knows about a machine. JSON-serialisable through :meth:`to_dict`."""

    cpu_model: str
    logical_cpus: int
    threads: int
    ram_total_bytes: int
    ram_available_bytes: int
    cgroup_memory_limit_bytes: int | None
    host_read_gbs: float | None
    host_copy_gbs: float | None
    host_gemv_gbs: float | None
    host_flops: float | None
    host_layer_overhead_s: float | None
    host_token_overhead_s: float | None
    gpu: GPUProfile | None = None
    disk: DiskProfile | None = None
    notes: list[str] = field(default_factory=list)
    model_gemv_gbs: float | None = None  # decode bandwidth at a model's matrix shapes
    model_gemv_detail: dict[str, Any] | None = None  # layers / head figures, prefill FLOP rate, dtype, model
    cpu_flags: list[str] = field(default_factory=list)  # instruction-set extensions (avx2, avx512f, ...)

    @property
    def model_flops(self) -> float | None:
        """Prefill-chunk matmul rate at the model's shapes, when measured."""
        return (self.model_gemv_detail or {}).get("prefill_flops")

    @property
    def host_bandwidth_gbs(self) -> float | None:
        """Decode-relevant host bandwidth: at the model's shapes when measured, else the generic
        matrix-vector figure (else the read figure)."""
        return self.model_gemv_gbs or self.host_gemv_gbs or self.host_read_gbs

    @property
    def ram_budget_bytes(self) -> int:
        """RAM a plan may use: what is available now, within the container's limit."""
        budget = self.ram_available_bytes
        if self.cgroup_memory_limit_bytes is not None:
            budget = min(budget, self.cgroup_memory_limit_bytes)
        return budget

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["host_bandwidth_gbs"] = self.host_bandwidth_gbs
        if self.gpu is not None:
            out["gpu"]["pcie_gbs"] = self.gpu.pcie_gbs
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineProfile:
        data = dict(data)
        data.pop("host_bandwidth_gbs", None)
        gpu = data.pop("gpu", None)
        disk = data.pop("disk", None)
        if gpu is not None:
            gpu = dict(gpu)
            gpu.pop("pcie_gbs", None)
            gpu = GPUProfile(**gpu)
        return cls(**data, gpu=gpu, disk=DiskProfile(**disk) if disk is not None else None)


# ---- helpers ------------------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run with ``torch.set_num_threads(threads)`` and restore the previous count afterwards."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Shortest wall time of ``fn`` over ``repeats`` runs after one warm-up run.

    The shortest run is the machine's capability; a transient burst of other work only
    lengthens some runs (the usual practice of bandwidth benchmarks such as STREAM).
    """
    fn()
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The container's memory limit in bytes (cgroup v2 or v1), or None when unlimited/unknown."""
    for rel in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = (root / rel).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return value if value < 2**60 else None  # v1 reports "unlimited" as a huge number
    return None


def memory_totals() -> tuple[int, int]:
    """(total, available) host RAM in bytes; (0, 0) where the OS does not say (no /proc/meminfo)."""
    try:
        vm = psutil.virtual_memory()
    except Exception:  # noqa: BLE001 - psutil raises several kinds when /proc is incomplete
        return 0, 0
    return int(vm.total), int(vm.available)




def cpu_flags() -> list[str]:
    """The CPU's instruction-set extensions that decode kernels care about (from /proc/cpuinfo)."""
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_bf16", "neon", "asimd", "sve")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return cpus


def numa_nodes(root: Path = Path("/")) -> dict[int, set[int]] | None:
    """NUMA node -> its CPUs, or None when sysfs does not say."""
    base = root / "sys/devices/system/node"
    try:
        names = [p.name for p in base.iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return None
    nodes: dict[int, set[int]] = {}
    for name in names:
        try:
            text = (base / name / "cpulist").read_text().strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        try:
            nodes[int(name[4:])] = parse_cpulist(text) if text else set()
        except ValueError:
            nodes[int(name[4:])] = set()
    return nodes or None

# ---- host measurements ----------------------------------------------------------------------
def measure_host_bandwidth(nbytes: int = DEFAULT_BANDWIDTH_BYTES, repeats: int = 5,
                           threads: int | None = None) -> dict[str, float]:
    """Host memory bandwidth in GB/s: ``read`` (reduction), ``copy`` (read + write), ``gemv``.

    ``gemv`` is a float32 matrix-vector product over a matrix of ``nbytes``: the access pattern
    of decode.
    """
    with torch_threads(threads):
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        read = _read_gbs(src, repeats)
        copy_s = _copy_time(src, repeats)
        cols = 4096
        matrix = src[: (src.numel() // cols) * cols].view(-1, cols)  # (rows, cols)
        vector = torch.ones(cols, 1)
        gemv_s = best_time(lambda: torch.mm(matrix, vector), repeats)
    return {
        "read": read,
        "copy": 2 * nbytes / copy_s / GB,
        "gemv": matrix.numel() * 4 / gemv_s / GB,
    }


def measure_host_read(nbytes: int = DEFAULT_BANDWIDTH_BYTES, repeats: int = 5, threads: int | None = None) -> float:
    """Host memory read bandwidth in GB/s (:func:`measure_host_bandwidth`'s ``read`` alone: a
    reduction over ``nbytes``, the best of ``repeats``)."""
    with torch_threads(threads):
        return _read_gbs(torch.ones(nbytes // 4, dtype=torch.float32), repeats)


def _read_gbs(src: torch.Tensor, repeats: int) -> float:
    return src.numel() * src.element_size() / best_time(lambda: src.sum(), repeats) / GB


def _copy_time(src: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(src)  # freed on return
    return best_time(lambda: dst.copy_(src), repeats)


def measure_host_flops(size: int = 1024, repeats: int = 5, threads: int | None = None,
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square matmul of ``size`` on the CPU (2 * size^3 FLOPs per product)."""
    with torch_threads(threads):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        seconds = best_time(lambda: a @ b, repeats)
    return 2 * size**3 / seconds



# ---- GPU measurements ------------------------------------------------------------------------
def gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def cuda_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Shortest seconds of ``fn`` timed with CUDA events (after one warm-up)."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(max(1, repeats)):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return min(times)


def gpu_numa_node(pci_bus_id: str | None, root: Path = Path("/")) -> int | None:
    """NUMA node of a PCI device from sysfs (None when unknown; the kernel reports -1 for "none")."""
    if not pci_bus_id:
        return None
    try:
        node = int((root / "sys/bus/pci/devices" / pci_bus_id.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _pci_bus_id(props: Any) -> str | None:
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return f"{int(domain or 0):04x}:{int(bus):02x}:{int(dev):02x}.0"


def measure_gpu(index: int = 0, nbytes: int = 512 * 2**20, repeats: int = 5) -> GPUProfile | None:
    """Figures of CUDA device ``index``; None when there is no GPU.

    Transfer sizes shrink to a quarter of the free VRAM when that is smaller than ``nbytes``.
    The engine's figures on it (decode bandwidth at a model's shapes, per-layer overhead) are
    :mod:`hybridllm.planner.engine_probe`'s.
    """
    if not gpu_available():
        return None
    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    profile = GPUProfile(index=index, name=props.name, vram_total_bytes=int(total), vram_free_bytes=int(free))
    profile.pci_bus_id = _pci_bus_id(props)
    profile.numa_node = gpu_numa_node(profile.pci_bus_id)
    size = max(2**20, min(nbytes, free // 4)) // 4 * 4
    profile.bandwidth_gbs = 2 * size / _cuda_copy_time(device, size, repeats) / GB
    transfers = _cuda_transfer_times(device, size, repeats)
    for key, seconds in transfers.items():
        setattr(profile, f"{key}_gbs", size / seconds / GB)
    profile.flops = _cuda_matmul_flops(device, repeats)
    torch.cuda.empty_cache()
    return profile


def _cuda_copy_time(device: torch.device, size: int, repeats: int) -> float:
    """Seconds of a device-to-device copy of ``size`` bytes (buffers freed on return)."""
    src = torch.empty(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), repeats, device)


def _cuda_transfer_times(device: torch.device, size: int, repeats: int) -> dict[str, float]:
    """Seconds of ``size``-byte copies: h2d/d2h, pageable and (when pinning works) pinned."""
    n = size // 4
    on_device = torch.empty(n, dtype=torch.float32, device=device)
    pageable = torch.empty(n, dtype=torch.float32)
    out = {
        "h2d_pageable": cuda_time(lambda: on_device.copy_(pageable), repeats, device),
        "d2h_pageable": cuda_time(lambda: pageable.copy_(on_device), repeats, device),
    }
    try:
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    except RuntimeError:  # pinning can fail (locked-memory limits): the pinned figures stay None
        return out
    out["h2d_pinned"] = cuda_time(lambda: on_device.copy_(pinned, non_blocking=True), repeats, device)
    out["d2h_pinned"] = cuda_time(lambda: pinned.copy_(on_device, non_blocking=True), repeats, device)
    return out


def _cuda_matmul_flops(device: torch.device, repeats: int, m: int = 4096) -> float:
    """FLOP/s of an fp16 ``m x m`` matmul on ``device``."""
    a = torch.randn(m, m, device=device, dtype=torch.float16)
    b = torch.randn(m, m, device=device, dtype=torch.float16)
    return 2 * m**3 / cuda_time(lambda: a @ b, repeats, device)


# ---- disk ----------------------------------------------------------------------------------
def measure_disk_read(path: str | os.PathLike, max_bytes: int = DISK_READ_BYTES) -> DiskProfile:
    """Sequential read speed of ``path`` without the page cache's help where the OS allows."""
    path = Path(path)
    size = path.stat().st_size
    want = min(size, max_bytes)
    note = ""
    if want < 16 * 2**20:
        note = f"only {want} bytes read: small reads under-report the disk's speed"
    o_direct = getattr(os, "O_DIRECT", None)
    if o_direct is not None:
        try:
            seconds, got = _read_direct(path, want, o_direct)
            return DiskProfile(str(path), got, got / seconds / GB if seconds > 0 else None, "O_DIRECT", note)
        except OSError as exc:
            note = _join(note, f"O_DIRECT refused ({exc.strerror or exc})")
    method = "buffered"
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                method = "posix_fadvise(DONTNEED)"
                note = _join(note, "cached pages dropped first; pages another process maps stay cached")
            except OSError as exc:
                note = _join(note, f"posix_fadvise failed ({exc.strerror or exc})")
        if method == "buffered":
            note = _join(note, "the read may be served from the page cache: the figure can overstate the disk")
        t0 = time.perf_counter()
        got = 0
        while got < want:
            chunk = os.read(fd, min(_DISK_CHUNK, want - got))
            if not chunk:
                break
            got += len(chunk)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return DiskProfile(str(path), got, got / seconds / GB if seconds > 0 else None, method, note)


def _read_direct(path: Path, want: int, flag: int) -> tuple[float, int]:
    """Read ``want`` bytes (rounded up to the alignment) with O_DIRECT into an aligned buffer."""
    fd = os.open(path, os.O_RDONLY | flag)
    buf = mmap.mmap(-1, _DISK_CHUNK)  # page-aligned, as O_DIRECT requires
    try:
        view = memoryview(buf)
        got = 0
        t0 = time.perf_counter()
        while got < want:
            n = os.preadv(fd, [view], got)  # offset and length are multiples of the alignment
            if n <= 0:
                break
            got += n
            if n < _DISK_CHUNK:
                break  # end of file
        seconds = time.perf_counter() - t0
        view.release()
    finally:
        buf.close()
        os.close(fd)
    return seconds, got  # whole chunks: can pass ``want`` by less than one chunk


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


# ---- all together --------------------------------------------------------------------------
def probe_hardware(threads: int | None = None, model_path: str | os.PathLike | None = None, gpu: bool = True,
                   quick: bool = False) -> MachineProfile:
    """Measure this machine (a few seconds; ``quick`` uses smaller sizes and fewer repeats).

    The engine's figures (per-layer overheads, decode bandwidth at a model's shapes) stay None:
    :func:`hybridllm.planner.engine_probe.probe_machine` adds them.

    Args:
        threads: CPU threads for the host measurements (None: PyTorch's current count).
        model_path: a model file whose read speed to measure (None: no disk measurement).
        gpu: measure CUDA device 0 when one is present.
        quick: smaller tensors and fewer repeats (for tests and ``doctor --quick``).
    """
    repeats = 3 if quick else 5
    notes: list[str] = []
    total, available = memory_totals()
    if not total:
        notes.append("RAM total/available unknown (psutil could not read /proc/meminfo): give plan --ram")
    bandwidth = measure_host_bandwidth(QUICK_BANDWIDTH_BYTES if quick else DEFAULT_BANDWIDTH_BYTES, repeats, threads)
    gpu_profile = None
    if gpu and gpu_available():
        try:
            gpu_profile = measure_gpu(0, repeats=repeats)
        except RuntimeError as exc:  # a broken driver must not stop the rest of the report
            notes.append(f"GPU measurement failed: {str(exc).splitlines()[0]}")
    elif gpu:
        notes.append("no GPU: CUDA figures not measured; the CPU stands in for the device")
    disk = None
    if model_path is not None:
        try:
            disk = measure_disk_read(model_path, 64 * 2**20 if quick else DISK_READ_BYTES)
        except OSError as exc:
            notes.append(f"disk read of {model_path} failed: {exc.strerror or exc}")
    return MachineProfile(
        cpu_model=cpu_model_name(),
        logical_cpus=os.cpu_count() or 1,
        threads=threads or torch.get_num_threads(),
        ram_total_bytes=total,
        ram_available_bytes=available,
        cgroup_memory_limit_bytes=cgroup_memory_limit(),
        host_read_gbs=bandwidth["read"],
        host_copy_gbs=bandwidth["copy"],
        host_gemv_gbs=bandwidth["gemv"],
        host_flops=measure_host_flops(512 if quick else 1024, repeats, threads),
        host_layer_overhead_s=None,
        host_token_overhead_s=None,
        gpu=gpu_profile,
        disk=disk,
        notes=notes,
        cpu_flags=cpu_flags(),
    )
