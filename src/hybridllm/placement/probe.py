"""Measure the machine the planner plans for: bandwidths, FLOP rates, per-layer overheads, memory.

Every measurement is one small function that returns plain numbers (or None when it cannot be
taken here, e.g. CUDA figures on a machine without a GPU), and :func:`probe_machine` gathers them
into a :class:`MachineProfile`. Nothing is cached globally: each call measures again, because a
busy machine (other processes, thermal state) changes the figures.

What is measured, and how:

- host memory bandwidth: the best of a few repeats of (a) a reduction (``sum``) over a large
  float32 tensor (read bandwidth), (b) a tensor copy (read + write, both counted), and (c) a
  matrix-vector product over a large float32 matrix (``W @ x``). Decode is a chain of
  matrix-vector products, so (c), ``host_gemv_gbs``, is the figure the planner uses for bytes
  read on the host; (a) and (b) are reported for comparison. The tensors are larger than any
  last-level cache and use the thread count the engine will use.
- decode bandwidth at a model's shapes (when the probe is given a ``ModelConfig``): the same
  single-token ``F.linear`` chain the decoder runs, over distinct matrices of the model's layer
  shapes (cycled until the chain is larger than the caches) and of its output head. A CPU's
  matrix-vector kernels stream memory at a rate that depends on the row length (on the 2-core
  EPYC this project is measured on: about 12 GB/s for 576-wide rows, 16 for 1536, 21 for 4096,
  whatever the row count), so this figure, ``model_gemv_gbs``, is what the planner uses when
  present; the generic figures are a fallback.
- host FLOP rate: a square float32 matmul (1024^3 multiply-adds), best of a few repeats; given
  a model, also the rate of a 512-token prefill chunk through its layers' matrices, which the
  planner prefers.
- per-layer and per-token overhead: the fixed cost of one decode step that does not scale with
  bytes (Python, op dispatch, thread wake-ups, kernel launches). It is measured by running the
  project's own decoder (``LlamaForCausalLM``) with tiny dimensions, so its bytes and FLOPs are
  negligible, with 2 and 8 layers, one token per step against a ``DynamicCache``:
  ``per_layer = (t8 - t2) / 6`` and ``per_token = t2 - 2 * per_layer`` (embedding, rotary
  tables, final norm, head dispatch, the logits' copy to the host).
- GPU (only when ``torch.cuda.is_available()``): device memory bandwidth (device-to-device copy,
  read + write counted, timed with CUDA events), host->device and device->host bandwidth with
  pinned and pageable host buffers, an fp16 matmul FLOP rate, the per-layer overhead on the
  device (as above, on CUDA), total and free VRAM, and the GPU's NUMA node.
- disk: sequential read speed of a model file, read with ``O_DIRECT`` (bypassing the page
  cache); where the file system refuses ``O_DIRECT`` (tmpfs, some overlay file systems) the
  file's cached pages are dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first, and where
  that is unavailable too the read is buffered and the profile says it may come from the cache.
- RAM total and available (psutil), and the container's cgroup memory limit when there is one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
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


def _best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
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


# ---- host measurements ----------------------------------------------------------------------
def measure_host_bandwidth(nbytes: int = DEFAULT_BANDWIDTH_BYTES, repeats: int = 5,
                           threads: int | None = None) -> dict[str, float]:
    """Host memory bandwidth in GB/s: ``read`` (reduction), ``copy`` (read + write), ``gemv``.

    ``gemv`` is a float32 matrix-vector product over a matrix of ``nbytes``: the access pattern
    of decode.
    """
    with torch_threads(threads):
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        read_s = _best_time(lambda: src.sum(), repeats)
        copy_s = _copy_time(src, repeats)
        cols = 4096
        matrix = src[: (src.numel() // cols) * cols].view(-1, cols)  # (rows, cols)
        vector = torch.ones(cols, 1)
        gemv_s = _best_time(lambda: torch.mm(matrix, vector), repeats)
    return {
        "read": nbytes / read_s / GB,
        "copy": 2 * nbytes / copy_s / GB,
        "gemv": matrix.numel() * 4 / gemv_s / GB,
    }


def _copy_time(src: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(src)  # freed on return
    return _best_time(lambda: dst.copy_(src), repeats)


def _native_products(matrices: list[torch.Tensor], vectors: dict[int, torch.Tensor]) -> Callable[[], None] | None:
    """One native single-row product per matrix (the decode kernels' float32 path), or None when
    the kernels cannot be built."""
    import ctypes

    from hybridllm.kernels import native

    try:
        library = native.kernels()
    except native.KernelBuildError:
        return None
    out = torch.empty(max(m.shape[0] for m in matrices))
    calls = [(native.float32_view(m), vectors[m.shape[1]].data_ptr()) for m in matrices]
    threads = torch.get_num_threads()

    def run() -> None:
        for view, x in calls:
            library.hl_linear(ctypes.byref(view.struct), x, out.data_ptr(), 1, threads)

    return run


def measure_matvec_bandwidth(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32,
                             device: torch.device | str = "cpu", threads: int | None = None,
                             min_bytes: int = DEFAULT_BANDWIDTH_BYTES, repeats: int = 3) -> float:
    """GB/s of single-token products over distinct matrices of ``shapes`` (rows, cols).

    The shapes are cycled until the matrices hold ``min_bytes`` (more than any cache). A matrix
    larger than ``min_bytes / len(shapes)`` keeps its row length and loses rows, so that every
    shape takes part: the rate depends on the row length, not on the row count. The product is
    the one the engine's decode step runs: the native kernels' (``hl_linear``) for float32 on the
    CPU when they can be built, else ``F.linear``.
    """
    import torch.nn.functional as F

    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    with torch_threads(threads if device.type == "cpu" else None):
        matrices: list[torch.Tensor] = []
        total = 0
        while total < min_bytes and len(matrices) < 100_000:
            rows, cols = shapes[len(matrices) % len(shapes)]
            rows = max(1, min(rows, min_bytes // len(shapes) // (cols * element)))
            matrices.append(torch.full((rows, cols), 1e-3, dtype=dtype, device=device))
            total += rows * cols * element
        vectors = {cols: torch.full((1, 1, cols), 1e-3, dtype=dtype, device=device) for _, cols in shapes}
        native = _native_products(matrices, vectors) if device.type == "cpu" and dtype == torch.float32 else None

        def run() -> None:
            if native is not None:
                native()
                return
            for matrix in matrices:
                F.linear(vectors[matrix.shape[1]], matrix)  # (1, 1, rows): one decode token

        seconds = _cuda_time(run, repeats, device) if device.type == "cuda" else _best_time(run, repeats)
    return total / seconds / GB


def measure_matmul_flops_at(shapes: list[tuple[int, int]], tokens: int = 512, dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu", threads: int | None = None,
                            max_bytes: int = QUICK_BANDWIDTH_BYTES, repeats: int = 3) -> float:
    """FLOP/s of ``F.linear`` of ``tokens`` rows through matrices of ``shapes``: a prefill chunk.

    Each matrix keeps its row length and at most ``max_bytes / len(shapes)`` bytes.
    """
    import torch.nn.functional as F

    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    with torch_threads(threads if device.type == "cpu" else None):
        matrices = []
        for rows, cols in shapes:
            rows = max(1, min(rows, max_bytes // len(shapes) // (cols * element)))
            matrices.append(torch.full((rows, cols), 1e-3, dtype=dtype, device=device))
        inputs = {cols: torch.full((tokens, cols), 1e-3, dtype=dtype, device=device) for _, cols in shapes}
        flops = sum(2 * tokens * m.shape[0] * m.shape[1] for m in matrices)

        def run() -> None:
            for matrix in matrices:
                F.linear(inputs[matrix.shape[1]], matrix)  # (tokens, rows)

        seconds = _cuda_time(run, repeats, device) if device.type == "cuda" else _best_time(run, repeats)
    return flops / seconds


def measure_model_decode_bandwidth(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                                   threads: int | None = None, min_bytes: int = DEFAULT_BANDWIDTH_BYTES,
                                   repeats: int = 3) -> dict[str, float]:
    """Decode bandwidth at ``config``'s shapes: its layers' matrices and its head, combined in the
    proportion one decode step reads them (GB/s; keys ``layers``, ``head``, ``effective``), and
    the FLOP rate of a 512-token prefill chunk through its layers' matrices (``prefill_flops``)."""
    from hybridllm.placement.plan import layer_matrix_shapes

    shapes = layer_matrix_shapes(config)
    layers = measure_matvec_bandwidth(shapes, dtype, device, threads, min_bytes, repeats)
    head_shape = (config.vocab_size, config.hidden_size)
    head = measure_matvec_bandwidth([head_shape], dtype, device, threads, min(min_bytes, config.vocab_size
                                    * config.hidden_size * torch.empty((), dtype=dtype).element_size()), repeats)
    layer_bytes = config.n_layers * sum(r * c for r, c in shapes)
    head_bytes = head_shape[0] * head_shape[1]
    effective = (layer_bytes + head_bytes) / (layer_bytes / layers + head_bytes / head)
    flops = measure_matmul_flops_at(shapes, 512, dtype, device, threads, min(min_bytes, QUICK_BANDWIDTH_BYTES),
                                    repeats)
    return {"layers": layers, "head": head, "effective": effective, "prefill_flops": flops}


def measure_host_flops(size: int = 1024, repeats: int = 5, threads: int | None = None,
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square matmul of ``size`` on the CPU (2 * size^3 FLOPs per product)."""
    with torch_threads(threads):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        seconds = _best_time(lambda: a @ b, repeats)
    return 2 * size**3 / seconds


def _tiny_decoder(n_layers: int, device: torch.device, dtype: torch.dtype):
    """A tiny Llama-family model and a fresh cache factory: bytes and FLOPs are negligible."""
    from hybridllm.config import ModelConfig
    from hybridllm.kvcache.base import KVSpec
    from hybridllm.kvcache.dynamic import DynamicCache
    from hybridllm.models.layers import RotaryEmbedding
    from hybridllm.models.llama import LlamaForCausalLM

    config = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=n_layers,
                         n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.rotary = RotaryEmbedding(config)
    spec = KVSpec(n_layers=n_layers, n_kv_heads=2, head_dim=16, dtype=dtype, device=device, max_tokens=4096)
    return model, lambda: DynamicCache(spec)


def _decode_step_time(n_layers: int, device: torch.device, dtype: torch.dtype, steps: int, repeats: int) -> float:
    """Seconds of one single-token decode step of a tiny model with ``n_layers`` layers, through
    the runner ``LLM`` builds by default (stacked projections, the "auto" decode backend: native
    decode on the CPU)."""
    from hybridllm.placement.apply import TierDevices
    from hybridllm.placement.placement import Placement
    from hybridllm.runtime.runner import build_runner

    model, new_cache = _tiny_decoder(n_layers, device, dtype)
    runner = build_runner(model, Placement.all_on_device(n_layers), TierDevices(device))
    token = torch.tensor([[1]], device=device)

    def run() -> None:
        cache = new_cache()
        cache.reserve(steps + 1)
        for _ in range(steps):
            runner(token, cache, start_pos=cache.seq_length).cpu()  # .cpu(): the generator's sync point

    with torch.inference_mode():
        return _best_time(run, repeats) / steps


def measure_layer_overhead(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                           threads: int | None = None, steps: int = 32, repeats: int = 5) -> tuple[float, float]:
    """(per-layer, per-token) fixed seconds of a decode step on ``device`` (see the module doc)."""
    device = torch.device(device)
    with torch_threads(threads):
        t2 = _decode_step_time(2, device, dtype, steps, repeats)
        t8 = _decode_step_time(8, device, dtype, steps, repeats)
    per_layer = max(0.0, (t8 - t2) / 6)
    per_token = max(0.0, t2 - 2 * per_layer)
    return per_layer, per_token


# ---- GPU measurements ------------------------------------------------------------------------
def gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _cuda_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
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


def measure_gpu(index: int = 0, nbytes: int = 512 * 2**20, repeats: int = 5,
                overhead: bool = True, model_config: Any = None) -> GPUProfile | None:
    """Figures of CUDA device ``index``; None when there is no GPU.

    Transfer sizes shrink to a quarter of the free VRAM when that is smaller than ``nbytes``.
    With ``model_config``, also the fp16 decode bandwidth at that model's matrix shapes.
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
    if model_config is not None:
        detail = measure_model_decode_bandwidth(model_config, torch.float16, device,
                                                min_bytes=min(nbytes, free // 4), repeats=repeats)
        profile.model_gemv_gbs, profile.model_flops = detail["effective"], detail["prefill_flops"]
    if overhead:
        profile.layer_overhead_s, profile.token_overhead_s = measure_layer_overhead(device, torch.float16)
    torch.cuda.empty_cache()
    return profile


def _cuda_copy_time(device: torch.device, size: int, repeats: int) -> float:
    """Seconds of a device-to-device copy of ``size`` bytes (buffers freed on return)."""
    src = torch.empty(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _cuda_time(lambda: dst.copy_(src), repeats, device)


def _cuda_transfer_times(device: torch.device, size: int, repeats: int) -> dict[str, float]:
    """Seconds of ``size``-byte copies: h2d/d2h, pageable and (when pinning works) pinned."""
    n = size // 4
    on_device = torch.empty(n, dtype=torch.float32, device=device)
    pageable = torch.empty(n, dtype=torch.float32)
    out = {
        "h2d_pageable": _cuda_time(lambda: on_device.copy_(pageable), repeats, device),
        "d2h_pageable": _cuda_time(lambda: pageable.copy_(on_device), repeats, device),
    }
    try:
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    except RuntimeError:  # pinning can fail (locked-memory limits): the pinned figures stay None
        return out
    out["h2d_pinned"] = _cuda_time(lambda: on_device.copy_(pinned, non_blocking=True), repeats, device)
    out["d2h_pinned"] = _cuda_time(lambda: pinned.copy_(on_device, non_blocking=True), repeats, device)
    return out


def _cuda_matmul_flops(device: torch.device, repeats: int, m: int = 4096) -> float:
    """FLOP/s of an fp16 ``m x m`` matmul on ``device``."""
    a = torch.randn(m, m, device=device, dtype=torch.float16)
    b = torch.randn(m, m, device=device, dtype=torch.float16)
    return 2 * m**3 / _cuda_time(lambda: a @ b, repeats, device)


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
def probe_machine(threads: int | None = None, model_path: str | os.PathLike | None = None,
                  gpu: bool = True, quick: bool = False, model_config: Any = None,
                  dtype: torch.dtype = torch.float32) -> MachineProfile:
    """Measure this machine (a few seconds; ``quick`` uses smaller sizes and fewer repeats).

    Args:
        threads: CPU threads for the host measurements (None: PyTorch's current count).
        model_path: a model file whose read speed to measure (None: no disk measurement).
        gpu: measure CUDA device 0 when one is present.
        quick: smaller tensors and fewer repeats (for tests and ``doctor --quick``).
        model_config: a ``ModelConfig`` whose matrix shapes to measure decode bandwidth at.
        dtype: the host's compute dtype for that measurement.
    """
    repeats = 3 if quick else 5
    notes: list[str] = []
    total, available = memory_totals()
    if not total:
        notes.append("RAM total/available unknown (psutil could not read /proc/meminfo): give plan --ram")
    used_threads = threads or torch.get_num_threads()
    bandwidth = measure_host_bandwidth(QUICK_BANDWIDTH_BYTES if quick else DEFAULT_BANDWIDTH_BYTES, repeats, threads)
    flops = measure_host_flops(512 if quick else 1024, repeats, threads)
    layer_s, token_s = measure_layer_overhead("cpu", torch.float32, threads, steps=16 if quick else 32,
                                              repeats=repeats)
    model_gemv = model_detail = None
    if model_config is not None:
        detail = measure_model_decode_bandwidth(model_config, dtype, "cpu", threads,
                                                QUICK_BANDWIDTH_BYTES if quick else DEFAULT_BANDWIDTH_BYTES, repeats)
        model_gemv = detail["effective"]
        model_detail = {**detail, "dtype": str(dtype).removeprefix("torch."), "model": model_config.name or
                        model_config.arch}
    gpu_profile = None
    if gpu and gpu_available():
        try:
            gpu_profile = measure_gpu(0, repeats=repeats, model_config=model_config)
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
        threads=used_threads,
        ram_total_bytes=total,
        ram_available_bytes=available,
        cgroup_memory_limit_bytes=cgroup_memory_limit(),
        host_read_gbs=bandwidth["read"],
        host_copy_gbs=bandwidth["copy"],
        host_gemv_gbs=bandwidth["gemv"],
        host_flops=flops,
        host_layer_overhead_s=layer_s,
        host_token_overhead_s=token_s,
        gpu=gpu_profile,
        disk=disk,
        notes=notes,
        model_gemv_gbs=model_gemv,
        model_gemv_detail=model_detail,
    )
