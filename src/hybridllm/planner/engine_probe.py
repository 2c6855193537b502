"""The engine's own figures on this machine, and the whole probe the planner and ``doctor`` read.

:mod:`hybridllm.hardware` measures the machine; this module adds what depends on the engine:

- decode bandwidth at a model's shapes (when given a ``ModelConfig``): the same single-token
  product chain the decoder runs, over distinct matrices of the model's layer shapes (cycled
  until the chain is larger than the caches) and of its output head. A CPU's matrix-vector
  kernels stream memory at a rate that depends on the row length (on the 2-core EPYC this
  project is measured on: about 12 GB/s for 576-wide rows, 16 for 1536, 21 for 4096, whatever the
  row count), so this figure, ``model_gemv_gbs``, is what the planner uses when present; the
  generic figures are a fallback. Also the rate of a 512-token prefill chunk through the layers'
  matrices, which the planner prefers to the generic matmul rate.
- per-layer and per-token overhead: the fixed cost of one decode step that does not scale with
  bytes (Python, op dispatch, thread wake-ups, kernel launches). It is measured by running the
  project's own decoder (``LlamaForCausalLM``) with tiny dimensions, so its bytes and FLOPs are
  negligible, with 2 and 8 layers, one token per step against a ``DynamicCache``:
  ``per_layer = (t8 - t2) / 6`` and ``per_token = t2 - 2 * per_layer`` (embedding, rotary
  tables, final norm, head dispatch, the logits' copy to the host); on the GPU too when present.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from hybridllm.hardware import (
    DEFAULT_BANDWIDTH_BYTES,
    GB,
    QUICK_BANDWIDTH_BYTES,
    GPUProfile,
    MachineProfile,
    best_time,
    cuda_time,
    probe_hardware,
    torch_threads,
)
from hybridllm.planner.memory import layer_matrix_shapes


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

        seconds = cuda_time(run, repeats, device) if device.type == "cuda" else best_time(run, repeats)
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

        seconds = cuda_time(run, repeats, device) if device.type == "cuda" else best_time(run, repeats)
    return flops / seconds


def measure_model_decode_bandwidth(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                                   threads: int | None = None, min_bytes: int = DEFAULT_BANDWIDTH_BYTES,
                                   repeats: int = 3) -> dict[str, float]:
    """Decode bandwidth at ``config``'s shapes: its layers' matrices and its head, combined in the
    proportion one decode step reads them (GB/s; keys ``layers``, ``head``, ``effective``), and
    the FLOP rate of a 512-token prefill chunk through its layers' matrices (``prefill_flops``)."""
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




def _tiny_runtime(n_layers: int, device: torch.device, dtype: torch.dtype):
    """A tiny Llama-family model with random weights, built as ``LLM`` builds (fused projections,
    the default decode backend): bytes and FLOPs are negligible, the fixed costs are the engine's."""
    from hybridllm.config import EngineConfig, ModelConfig
    from hybridllm.loading.random_checkpoint import RandomCheckpoint
    from hybridllm.placement.placement import Placement
    from hybridllm.runtime.build import build_runtime

    config = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=n_layers,
                         n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    engine = EngineConfig(device=str(device), dtype=str(dtype).removeprefix("torch."))
    return build_runtime(RandomCheckpoint.of_config(config, dtype), engine,
                         Placement.all_on_device(n_layers, weights="float"))


def _decode_step_time(n_layers: int, device: torch.device, dtype: torch.dtype, steps: int, repeats: int) -> float:
    """Seconds of one single-token decode step of a tiny model with ``n_layers`` layers through
    the engine's own runner."""
    runtime = _tiny_runtime(n_layers, device, dtype)
    token = torch.tensor([[1]])  # (1, 1)

    def run() -> None:
        cache = runtime.new_cache()
        cache.reserve(steps + 1)
        try:
            for _ in range(steps):
                runtime.runner(token, cache, start_pos=cache.seq_length).cpu()  # .cpu(): the loop's sync point
        finally:
            cache.reset()

    with torch.inference_mode():
        return best_time(run, repeats) / steps


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


def probe_machine(threads: int | None = None, model_path: str | os.PathLike | None = None,
                  gpu: bool = True, quick: bool = False, model_config: Any = None,
                  dtype: torch.dtype = torch.float32) -> MachineProfile:
    """The machine (:func:`hybridllm.hardware.probe_hardware`) with the engine's figures on it.

    Args:
        threads: CPU threads for the host measurements (None: PyTorch's current count).
        model_path: a model file whose read speed to measure (None: no disk measurement).
        gpu: measure CUDA device 0 when one is present.
        quick: smaller tensors and fewer repeats (for tests and ``doctor --quick``).
        model_config: a ``ModelConfig`` whose matrix shapes to measure decode bandwidth at.
        dtype: the host's compute dtype for that measurement.
    """
    profile = probe_hardware(threads, model_path, gpu, quick)
    repeats = 3 if quick else 5
    min_bytes = QUICK_BANDWIDTH_BYTES if quick else DEFAULT_BANDWIDTH_BYTES
    profile.host_layer_overhead_s, profile.host_token_overhead_s = measure_layer_overhead(
        "cpu", torch.float32, threads, steps=16 if quick else 32, repeats=repeats)
    if model_config is not None:
        detail = measure_model_decode_bandwidth(model_config, dtype, "cpu", threads, min_bytes, repeats)
        profile.model_gemv_gbs = detail["effective"]
        profile.model_gemv_detail = {**detail, "dtype": str(dtype).removeprefix("torch."),
                                     "model": model_config.name or model_config.arch}
    if profile.gpu is not None:
        try:
            _probe_gpu_engine(profile.gpu, model_config, repeats)
        except RuntimeError as exc:  # a broken driver must not stop the rest of the report
            profile.notes.append(f"GPU measurement failed: {str(exc).splitlines()[0]}")
    return profile


def _probe_gpu_engine(gpu: GPUProfile, model_config: Any, repeats: int) -> None:
    """The fp16 decode bandwidth at the model's shapes and the per-layer overhead on the GPU."""
    device = torch.device("cuda", gpu.index)
    if model_config is not None:
        detail = measure_model_decode_bandwidth(model_config, torch.float16, device,
                                                min_bytes=min(512 * 2**20, gpu.vram_free_bytes // 4), repeats=repeats)
        gpu.model_gemv_gbs, gpu.model_flops = detail["effective"], detail["prefill_flops"]
    gpu.layer_overhead_s, gpu.token_overhead_s = measure_layer_overhead(device, torch.float16)
    torch.cuda.empty_cache()
