"""Measure the machine and check the OS settings that hurt hybrid inference (``hybridllm doctor``).

Each check reads one /proc or /sys file (or a resource limit) and returns a :class:`Check` with
status "ok", "warn" or "unknown" and a one-line recommendation. A missing or unreadable file
(containers, VMs, other kernels) gives "unknown", never an exception. Every path is read below
a ``root`` directory (default "/"), so tests run the checks against a fake tree.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from hybridllm.units import format_bytes

from hybridllm.hardware import cgroup_memory_limit, numa_nodes

OK, WARN, UNKNOWN = "ok", "warn", "unknown"
SWAPPINESS_MAX = 10


@dataclass
class Check:
    """One OS check: its value as read, a status and a one-line recommendation."""

    name: str
    status: str  # ok, warn, unknown
    value: str | None
    recommendation: str


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


# ---- the checks ---------------------------------------------------------------------------
def check_swappiness(root: Path = Path("/")) -> Check:
    text = _read(root, "proc/sys/vm/swappiness")
    if text is None or not text.isdigit():
        return Check("vm.swappiness", UNKNOWN, text, "cannot read /proc/sys/vm/swappiness; aim for 10 or less "
                     "so the kernel does not swap out host-resident weights and KV")
    value = int(text)
    swap_total = _meminfo(root).get("SwapTotal")
    if value <= SWAPPINESS_MAX:
        return Check("vm.swappiness", OK, text, "host-resident weights and KV stay in RAM")
    if swap_total == 0:
        return Check("vm.swappiness", OK, text, "no swap configured, so swappiness has no effect; "
                     f"set `sysctl -w vm.swappiness={SWAPPINESS_MAX}` before adding swap")
    return Check("vm.swappiness", WARN, text, f"run `sysctl -w vm.swappiness={SWAPPINESS_MAX}`: at {value} the "
                 "kernel swaps out idle weights and KV pages, and decode slows down over hours")


def _meminfo(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    text = _read(root, "proc/meminfo") or ""
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)", line)
        if match:
            out[match.group(1)] = int(match.group(2)) * 1024
    return out


def check_transparent_hugepages(root: Path = Path("/")) -> Check:
    text = _read(root, "sys/kernel/mm/transparent_hugepage/enabled")
    match = re.search(r"\[(\w+)\]", text or "")
    if match is None:
        return Check("transparent hugepages", UNKNOWN, text, "cannot read /sys/kernel/mm/transparent_hugepage/"
                     "enabled; 'madvise' or 'always' lets GB-sized weight buffers use 2 MiB pages")
    mode = match.group(1)
    if mode == "always":
        return Check("transparent hugepages", OK, mode, "large weight and KV buffers get 2 MiB pages (fewer TLB misses)")
    if mode == "madvise":
        return Check("transparent hugepages", OK, mode, "the engine asks for 2 MiB pages for its native weights "
                     "(madvise)")
    return Check("transparent hugepages", WARN, mode, "run `echo madvise > /sys/kernel/mm/transparent_hugepage/"
                 "enabled`: 4 KiB pages cost TLB misses when streaming GBs of weights")


def check_numa(root: Path = Path("/"), gpu_node: int | None = None, has_gpu: bool = False,
               allowed_cpus: set[int] | None = None) -> Check:
    nodes = numa_nodes(root)
    if nodes is None:
        return Check("NUMA", UNKNOWN, None, "cannot read /sys/devices/system/node; on a multi-socket machine bind "
                     "threads and memory to the GPU's node with numactl")
    if len(nodes) == 1:
        return Check("NUMA", OK, "1 node", "single NUMA node: all memory is local")
    if allowed_cpus is None:
        try:
            allowed_cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            allowed_cpus = None
    value = f"{len(nodes)} nodes" + (f", GPU on node {gpu_node}" if gpu_node is not None else "")
    if has_gpu and gpu_node is None:
        return Check("NUMA", UNKNOWN, value, "cannot tell the GPU's NUMA node; check `nvidia-smi topo -m` and bind "
                     "with `numactl --cpunodebind=N --membind=N` to the GPU's node")
    target = gpu_node if gpu_node is not None else None
    if allowed_cpus:
        spanned = {n for n, cpus in nodes.items() if cpus & allowed_cpus}
        if target is not None and spanned == {target}:
            return Check("NUMA", OK, value, f"threads are bound to node {target}, the GPU's node")
        if target is None and len(spanned) == 1:
            return Check("NUMA", OK, value, f"threads are bound to node {next(iter(spanned))}")
    node = target if target is not None else 0
    why = "the GPU's node, so pinned copies and host decode read local memory" if target is not None else \
        "one node, so decode reads local memory at full bandwidth"
    return Check("NUMA", WARN, value, f"run under `numactl --cpunodebind={node} --membind={node}`: binds to {why}")


def check_memlock(has_gpu: bool = False, limits: tuple[int, int] | None = None) -> Check:
    try:
        soft, _hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError, AttributeError):
        return Check("locked memory (ulimit -l)", UNKNOWN, None, "cannot read RLIMIT_MEMLOCK; pinned host buffers "
                     "need `ulimit -l unlimited`")
    if soft == resource.RLIM_INFINITY:
        return Check("locked memory (ulimit -l)", OK, "unlimited", "pinned (page-locked) host buffers are not capped")
    value = format_bytes(soft, 0)
    advice = ("raise it with `ulimit -l unlimited` (Docker: --ulimit memlock=-1; systemd: LimitMEMLOCK=infinity): "
              "pinned host buffers above the limit fail or fall back to pageable copies at about half the bus speed")
    if not has_gpu:
        return Check("locked memory (ulimit -l)", OK, value, "no GPU, so no pinned buffers are needed; with a GPU, "
                     + advice)
    return Check("locked memory (ulimit -l)", WARN, value, advice)


def check_cpu_governor(root: Path = Path("/")) -> Check:
    base = root / "sys/devices/system/cpu"
    governors: set[str] = set()
    try:
        for cpu in base.iterdir():
            if re.fullmatch(r"cpu\d+", cpu.name):
                text = _read(root, f"sys/devices/system/cpu/{cpu.name}/cpufreq/scaling_governor")
                if text:
                    governors.add(text)
    except OSError:
        pass
    if not governors:
        return Check("CPU governor", UNKNOWN, None, "no cpufreq interface (usual in VMs and containers); on bare "
                     "metal use `cpupower frequency-set -g performance`")
    value = ",".join(sorted(governors))
    if governors == {"performance"}:
        return Check("CPU governor", OK, value, "cores run at full clock during decode")
    return Check("CPU governor", WARN, value, "run `cpupower frequency-set -g performance`: other governors lower "
                 "the clock between decode steps and add latency")


def check_cgroup_memory(root: Path = Path("/"), ram_total: int | None = None) -> Check:
    limit = cgroup_memory_limit(root)
    if limit is None:
        present = any((root / rel).exists() for rel in ("sys/fs/cgroup/memory.max",
                                                         "sys/fs/cgroup/memory/memory.limit_in_bytes"))
        if present:
            return Check("container memory limit", OK, "none", "no cgroup memory limit")
        return Check("container memory limit", UNKNOWN, None, "cannot read the cgroup memory limit; if this is a "
                     "container, plan with --ram set to its limit")
    value = format_bytes(limit)
    if ram_total is not None and limit < ram_total:
        return Check("container memory limit", WARN, value, f"the container may use {value} of "
                     f"{format_bytes(ram_total)} RAM; the planner budgets for the limit (or pass --ram)")
    return Check("container memory limit", OK, value, "the limit is not below the machine's RAM")


def run_checks(root: Path = Path("/"), gpu_node: int | None = None, has_gpu: bool = False,
               ram_total: int | None = None, memlock: tuple[int, int] | None = None) -> list[Check]:
    """All OS checks. Never raises: a failing check becomes "unknown"."""
    checks = []
    for name, fn in (
        ("vm.swappiness", lambda: check_swappiness(root)),
        ("transparent hugepages", lambda: check_transparent_hugepages(root)),
        ("NUMA", lambda: check_numa(root, gpu_node, has_gpu)),
        ("locked memory (ulimit -l)", lambda: check_memlock(has_gpu, memlock)),
        ("CPU governor", lambda: check_cpu_governor(root)),
        ("container memory limit", lambda: check_cgroup_memory(root, ram_total)),
    ):
        try:
            checks.append(fn())
        except Exception as exc:  # noqa: BLE001 - a doctor must report, not crash
            checks.append(Check(name, UNKNOWN, None, f"check failed ({type(exc).__name__}: {exc})"))
    return checks


# ---- the report ---------------------------------------------------------------------------------
def diagnose(model: Path | None = None, threads: int | None = None, quick: bool = False,
             root: Path = Path("/")) -> dict[str, Any]:
    """Measure the machine, run the checks, and (with a model) say whether its weights fit."""
    from hybridllm.planner.engine_probe import probe_machine

    from hybridllm.kernels.threads import measure_machine_load

    load = measure_machine_load()  # before the probe loads the CPUs itself
    model_path, model_info, cfg = _model_file(model)
    profile = probe_machine(threads=threads, model_path=model_path, quick=quick, model_config=cfg)
    gpu = profile.gpu
    checks = run_checks(root, gpu.numa_node if gpu else None, gpu is not None, profile.ram_total_bytes)
    report: dict[str, Any] = {
        "profile": profile.to_dict(),
        "checks": [asdict(c) for c in checks],
        "summary": {s: sum(c.status == s for c in checks) for s in (OK, WARN, UNKNOWN)},
        "cpu_load": {**asdict(load), "loaded": load.loaded, "decode_threads": load.decode_threads,
                     "line": load.line()},
        "kernels": native_kernels(),
    }
    if model_info is not None:
        report["model"] = model_info
    return report


def native_kernels() -> dict[str, Any]:
    """Which instruction set the native kernels run on (building them on first use), whether
    batches and prefill chunks run on AMX tiles, and the precision of their prefill products on
    quantized weights, or why they are unavailable (decode and prefill then run through PyTorch)."""
    import os

    from hybridllm.kernels.abi import amx_tiles, kernel_isa, prefill_precision
    from hybridllm.kernels.build import MARCH_ENV, KernelBuildError

    from hybridllm.kvcache.registry import STRATEGIES

    march = os.environ.get(MARCH_ENV) or "native"
    kv = {name: strategy.native for name, strategy in STRATEGIES.items()}  # "" where the kernels cannot read it
    try:
        return {"isa": kernel_isa(), "amx_tiles": amx_tiles(), "prefill_precision": prefill_precision(),
                "march": march, "kv_strategies": kv, "error": None}
    except KernelBuildError as exc:
        return {"isa": None, "amx_tiles": False, "prefill_precision": None, "march": march, "kv_strategies": kv,
                "error": str(exc)}


def _model_file(model: Path | None) -> tuple[Path | None, dict[str, Any] | None, Any]:
    """The file whose read speed to measure, what we know about the model, and its config."""
    from hybridllm.errors import HybridLLMError
    from hybridllm.planner.inputs import load_model_config
    from hybridllm.planner.memory import weights_bytes_by_format

    try:
        if model is None:
            from hybridllm.loading.registry import default_model_path

            model = default_model_path()
        cfg, name, has_weights = load_model_config(model)
    except HybridLLMError as exc:
        if model is None:
            return None, {"error": str(exc)}, None
        raise
    path = Path(model)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
        file = files[0] if files else None
    else:
        file = path if has_weights else None
    info = {"name": name, "path": str(path), "n_layers": cfg.n_layers, "parameters": cfg.parameter_count(),
            "file_bytes": file.stat().st_size if file is not None else None,
            "weights_bytes": weights_bytes_by_format(cfg)}
    return file, info, cfg


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    p = report["profile"]
    meas = Table(title="hybridllm doctor: measurements", show_header=False)
    meas.add_column("what", style="bold")
    meas.add_column("figure")

    def gbs(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} GB/s"

    flags = f" ({' '.join(p['cpu_flags'])})" if p.get("cpu_flags") else ""
    meas.add_row("CPU", f"{p['cpu_model']}{flags}, {p['logical_cpus']} logical CPUs, measured with {p['threads']} "
                 "threads")
    meas.add_row("RAM", f"{format_bytes(p['ram_total_bytes'])} total, {format_bytes(p['ram_available_bytes'])} "
                 "available" + (f", container limit {format_bytes(p['cgroup_memory_limit_bytes'])}"
                                if p["cgroup_memory_limit_bytes"] else ""))
    meas.add_row("host memory bandwidth", f"read {gbs(p['host_read_gbs'])}, copy {gbs(p['host_copy_gbs'])}, "
                 f"matrix-vector {gbs(p['host_gemv_gbs'])}")
    if p.get("model_gemv_gbs"):
        d = p["model_gemv_detail"]
        meas.add_row("decode bandwidth (model)", f"{p['model_gemv_gbs']:.1f} GB/s at {d['model']}'s matrix shapes "
                     f"in {d['dtype']} (layers {d['layers']:.1f}, head {d['head']:.1f}); 512-token prefill chunk "
                     f"{d['prefill_flops'] / 1e9:.1f} GFLOP/s; the planner uses these")
    if report.get("cpu_load"):
        meas.add_row("CPU load", report["cpu_load"]["line"])
    k = report.get("kernels")
    if k:
        tiles = ", AMX tiles for batches and prefill" if k["amx_tiles"] else ""
        meas.add_row("native kernels", f"{k['isa']} (-march={k['march']}){tiles}, prefill products in "
                     f"{k['prefill_precision']}" if k["isa"]
                     else f"unavailable, decode and prefill run through PyTorch: {k['error']}")
    if k and k["isa"]:
        read = [name for name, native in k["kv_strategies"].items() if native]
        unread = [name for name, native in k["kv_strategies"].items() if not native]
        meas.add_row("KV caches the kernels read", ", ".join(read) + (
            f"; attended through PyTorch (slower): {', '.join(unread)}" if unread else ""))
    meas.add_row("host matmul", f"{p['host_flops'] / 1e9:.1f} GFLOP/s")
    meas.add_row("decode overhead (CPU)", f"{p['host_layer_overhead_s'] * 1e6:.0f} us per layer, "
                 f"{p['host_token_overhead_s'] * 1e6:.0f} us per token")
    g = p.get("gpu")
    if g:
        meas.add_row("GPU", f"{g['name']}: {format_bytes(g['vram_total_bytes'])} VRAM, "
                     f"{format_bytes(g['vram_free_bytes'])} free, NUMA node {g['numa_node']}")
        meas.add_row("device memory bandwidth", gbs(g["bandwidth_gbs"]))
        meas.add_row("host->device", f"pinned {gbs(g['h2d_pinned_gbs'])}, pageable {gbs(g['h2d_pageable_gbs'])}")
        meas.add_row("device->host", f"pinned {gbs(g['d2h_pinned_gbs'])}, pageable {gbs(g['d2h_pageable_gbs'])}")
        meas.add_row("device matmul (fp16)", "-" if g["flops"] is None else f"{g['flops'] / 1e12:.1f} TFLOP/s")
    else:
        meas.add_row("GPU", "no GPU: CUDA figures not measured; the CPU stands in for the device")
    d = p.get("disk")
    if d:
        note = f"; {d['note']}" if d["note"] else ""
        meas.add_row("disk read", f"{gbs(d['read_gbs'])} over {format_bytes(d['bytes_read'], 0)} of "
                     f"{Path(d['path']).name} ({d['method']}{note})")
    m = report.get("model")
    if m and "error" not in m:
        w = m["weights_bytes"]
        float16, q4_k_m = (format_bytes(w[fmt], 2, decimal=True) for fmt in ("float16", "q4_k_m"))
        meas.add_row("model", f"{m['name']}: {m['parameters'] / 1e6:.0f}M parameters, float16 {float16}, "
                     f"q4_k_m {q4_k_m} (see `hybridllm plan`)")
    for note in p.get("notes", []):
        meas.add_row("note", note)
    console.print(meas)
    checks = Table(title="hybridllm doctor: OS settings", show_header=True, header_style="bold")
    checks.add_column("check")
    checks.add_column("status")
    checks.add_column("value")
    checks.add_column("recommendation")
    colour = {OK: "green", WARN: "yellow", UNKNOWN: "dim"}
    for c in report["checks"]:
        checks.add_row(c["name"], f"[{colour[c['status']]}]{c['status']}[/]", c["value"] or "-", c["recommendation"])
    console.print(checks)

