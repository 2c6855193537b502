"""Load a checkpoint with quantized weights kept quantized (``--weights auto|int8|int4``).

The float path (``loader.load_model``) dequantizes every tensor. This one builds ``Int4Linear``
/ ``Int8Linear`` / ``Int8Embedding`` modules straight from the file's blocks, one tensor at a
time, so no float copy of a quantized matrix is ever made:

- Q4_0, Q4_1, Q4_K -> int4 (group 32, exact mapping of each group's scale and offset);
- Q8_0 -> int8 per output channel (requantized from the blocks, in row chunks); the output
  head and the token embedding keep Q8_0's scale per 32 values exactly (``Int8GroupedLinear``);
- ``--weights int4`` / ``int8`` requantize other types (from float, one matrix at a time);
- with ``auto``, Q5_0/Q5_1 -> int8 per output channel (requantized from the blocks); Q5_K/Q6_K
  -> int8 with a scale per 32 values (``Int8GroupedLinear``, requantized from the blocks: their
  16/32-value sub-block scales need more than one scale per row); other types run in the
  compute dtype (one log line per type);
- parts of one stacked projection (q/k/v, gate/up) planned in different int formats (a Q6_K
  ``v_proj`` beside Q4_K ``q_proj``/``k_proj`` in a Q4_K_M file) all take the grouped int8
  format, so they stack into one matrix that the native decode kernels run;
- the token embedding is int8 (a lookup dequantizes only its rows); a tied head is the same
  table run through the int8 kernel.

Q/K rows of ``llama``-architecture GGUF files are un-permuted on the raw row blocks (rows are
independent, so the permutation commutes with block quantization). The separate q/k/v and
gate/up modules of a layer are stacked as soon as the last of them is read
(``hybridllm.loading.skeleton.ProjectionAssembler``): into one matrix where their types agree,
else kept side by side in a ``ConcatLinear``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from hybridllm.formats.gguf_blocks import INT4_TYPES, dequantize_rows, unpack_int4, unpack_q8_0
from hybridllm.formats.gguf_qk_permutation import PERMUTED_ARCHITECTURES, unpermute_rows
from hybridllm.loading.skeleton import HEAD, ProjectionAssembler, load_tensors, prepare_skeleton, progress
from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.models.quantized import (
    Int4Linear,
    Int8Embedding,
    Int8GroupedLinear,
    Int8Linear,
    check_weights_mode,
    PackedEmbedding,
    int4_unsupported_reason,
    int8_unsupported_reason,
    kernel_dtype_for,
    quantize_int8,
    quantize_int8_groups,
)
from hybridllm.timing import ColdStart, synchronize

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")
# 5-bit types kept quantized under ``auto`` as int8 codes per output channel (requantized from
# their blocks): the int8 kernels run them in ~1/4 of float32's memory with an error like our Q8_0
# path's (docs/benchmarks.md).
INT8_REQUANTIZED_TYPES = ("Q5_0", "Q5_1")
# K-quant 5/6-bit types: int8 with a scale per 32 values. One scale per row cannot hold their
# sub-block scales (a random-block Q6_K test lost 22% of the logits' norm that way); a scale per
# 32 values adds an error ~1/8 of their own quantization step (docs/benchmarks.md).
INT8_GROUPED_TYPES = ("Q5_K", "Q6_K")
FORMATS = ("float", "int4", "int8", "int8-groups")
EMBEDDING = "model.embed_tokens.weight"
ROW_CHUNK = 2048  # rows requantized at a time (bounds the float scratch of big matrices)


def _is_linear_weight(param_name: str) -> bool:
    return param_name == HEAD or (param_name.startswith("model.layers.") and param_name.endswith("_proj.weight"))


def file_type(checkpoint, file_name: str) -> str:
    """GGML type name of a tensor in the file ("Q4_1", "F32", ...); Hugging Face tensors are float."""
    if getattr(checkpoint, "file_format", None) == "gguf":
        return checkpoint.tensors[file_name].type_name
    return "F32"


def plan_format(weights: str, param_name: str, type_name: str) -> str:
    """One of ``FORMATS`` for one weight, before checking kernel shape constraints.

    The vocabulary-wide tables (token embedding, output head) are int8 with group scales
    whenever they are quantized ("int8-groups")."""
    if weights == "float" or not (_is_linear_weight(param_name) or param_name == EMBEDDING):
        return "float"
    if param_name == EMBEDDING:  # the lookup table (and a tied head)
        return "float" if weights == "auto" and type_name in FLOAT_TYPES else "int8-groups"
    if weights == "int8":
        return "int8-groups" if param_name == HEAD else "int8"
    if weights == "int4":
        return "int8-groups" if param_name == HEAD and type_name not in INT4_TYPES else "int4"
    # auto: keep the file's quantization where a kernel exists
    if type_name in INT4_TYPES:
        return "int4"
    if type_name == "Q8_0" or type_name in INT8_REQUANTIZED_TYPES:
        return "int8-groups" if param_name == HEAD else "int8"
    if type_name in INT8_GROUPED_TYPES:
        return "int8-groups"
    return "float"


def plan_formats(weights: str, types: dict[str, str], stacks: list[tuple[str, ...]]) -> dict[str, str]:
    """Every weight's format: :func:`plan_format` per weight (``types``: parameter name -> GGML
    type name), then the parts of each stacked projection (``stacks``: their module names)
    whose int formats differ all take "int8-groups", so they stack into one matrix."""
    formats = {name: plan_format(weights, name, type_name) for name, type_name in types.items()}
    for parts in stacks:
        names = [f"{part}.weight" for part in parts if f"{part}.weight" in formats]
        planned = {formats[name] for name in names}
        if len(planned) > 1 and "float" not in planned:
            for name in names:
                formats[name] = "int8-groups"
    return formats


class HostLayout(Protocol):
    """How host (CPU) weights are held when a kernel library reads them in place (the runtime
    passes the native kernels' ``NATIVE_LAYOUT``): its int4 class, and the GGUF types it keeps in
    the file's own format (``holds``), built from a tensor's raw rows ((N, bytes per row) uint8)."""

    int4_class: type[Int4Linear]

    def holds(self, type_name: str, in_features: int) -> bool: ...

    def linear(self, type_name: str, rows: torch.Tensor, in_features: int) -> nn.Module: ...

    def embedding(self, type_name: str, rows: torch.Tensor, in_features: int, out_dtype: torch.dtype) -> nn.Module: ...


def load_quantized_model(
    checkpoint,
    dtype: torch.dtype,
    device_for: Callable[[str], torch.device],
    cold_start: ColdStart | None = None,
    show_progress: bool | None = None,
    weights: str = "auto",
    fuse: bool = True,
    host_layout: HostLayout | None = None,
) -> LlamaForCausalLM:
    """Like :func:`hybridllm.loading.loader.load_model`, with weights kept quantized per ``weights``.

    With a ``host_layout`` (the native kernels run the host's layers), under ``auto`` every host
    matrix and embedding of a GGUF type it ``holds`` is built in that type as the file stores it
    (a tied head shares the embedding's table), and host int4 matrices as its ``int4_class``;
    matrices on other devices, and everything without a host layout, as below."""
    check_weights_mode(weights)
    cold_start = cold_start if cold_start is not None else ColdStart()
    config = checkpoint.config
    skeleton = prepare_skeleton(checkpoint, show_progress)

    state: dict[str, torch.Tensor] = {}
    modules: dict[str, nn.Module] = {}  # quantized modules by checkpoint module name
    fallbacks: Counter[tuple[str, str]] = Counter()
    types = {param_name: file_type(checkpoint, file_name) for file_name, param_name in skeleton.names.items()
             if param_name in skeleton.expected}
    formats = plan_formats(weights, types, [stacked.parts for stacked in skeleton.model.stacked_projections()])
    assembler = ProjectionAssembler(skeleton.model, skeleton.expected, fuse)
    with progress(skeleton.show_progress, skeleton.total, checkpoint.path.name) as advance:
        for file_name, param_name in skeleton.names.items():
            if param_name not in skeleton.expected:
                continue
            t0 = time.perf_counter()
            raw = checkpoint.read(file_name)
            t1 = time.perf_counter()
            device = device_for(param_name)
            type_name, fmt = types[param_name], formats[param_name]
            module = None
            host = host_layout if device.type == "cpu" else None
            if host is not None and weights == "auto" and _held_in_place(checkpoint, file_name, param_name, host):
                module = _build_in_place(checkpoint, file_name, param_name, raw, type_name, dtype, host)
            elif fmt != "float":
                int4 = host.int4_class if host is not None else Int4Linear
                module, why = _build(checkpoint, file_name, param_name, raw, fmt, type_name, dtype, device, int4)
                if module is None:
                    fallbacks[(f"{fmt} ({why})", type_name)] += 1
            elif weights == "auto" and _is_linear_weight(param_name) and type_name not in FLOAT_TYPES:
                fallbacks[("a quantized kernel (none for this type)", type_name)] += 1
            if module is None:
                tensor = checkpoint.dequantize(file_name, raw).to(dtype)
                t2 = time.perf_counter()
                state[param_name] = tensor.to(device)
            else:
                t2 = time.perf_counter()
                modules[param_name.removesuffix(".weight")] = module
            synchronize(device)
            t3 = time.perf_counter()
            cold_start.read_s += t1 - t0
            cold_start.dequantize_s += t2 - t1
            cold_start.to_device_s += t3 - t2
            nbytes = checkpoint.nbytes(file_name)
            cold_start.bytes_read += nbytes
            assembler.loaded(param_name, state, modules)
            advance(nbytes)
    for (what, type_name), count in sorted(fallbacks.items()):
        logger.warning("weights: %d %s tensor(s) without %s run as %s", count, type_name, what,
                       str(dtype).removeprefix("torch."))

    model = skeleton.model
    assembler.finish(state, modules)
    embed = model.model.embed_tokens
    packed_table = isinstance(embed, (Int8Embedding, PackedEmbedding))
    if config.tie_word_embeddings:
        if packed_table:
            model.lm_head = embed.tied_head()
        else:
            state[HEAD] = state[EMBEDDING]
    load_tensors(model, state)
    if config.tie_word_embeddings and not packed_table:
        model.lm_head.weight = model.model.embed_tokens.weight
    release_load_scratch()
    return model


def release_load_scratch() -> None:
    """Give the conversion's freed scratch memory back to the OS (best effort): the per-tensor
    copies and packing buffers interleave with the packed weights on the C heap, and glibc keeps
    freed pages between live blocks until ``malloc_trim`` returns them. (No garbage collection:
    the scratch is freed by reference counting, and a full collection costs ~0.1 s in a large
    process.)"""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _raw_rows(checkpoint, file_name: str, raw) -> torch.Tensor | None:
    """The tensor's bytes as (rows, bytes_per_row) uint8 with llama Q/K rows un-permuted; None if not GGUF."""
    if getattr(checkpoint, "file_format", None) != "gguf":
        return None
    info = checkpoint.tensors[file_name]
    data = raw if isinstance(raw, np.ndarray) else np.asarray(raw)
    rows = torch.from_numpy(data).reshape(info.shape[0], -1)  # (N, bytes per row)
    if checkpoint.metadata.get("general.architecture") in PERMUTED_ARCHITECTURES:
        if file_name.endswith("attn_q.weight"):
            rows = unpermute_rows(rows, checkpoint.config.n_heads).contiguous()
        elif file_name.endswith("attn_k.weight"):
            rows = unpermute_rows(rows, checkpoint.config.n_kv_heads).contiguous()
    return rows


def _held_in_place(checkpoint, file_name: str, param_name: str, host: HostLayout) -> bool:
    """Whether a GGUF matrix or embedding is held by ``host`` in the file's own type (float32
    tensors stay float32 ``nn`` modules, as the float path builds them)."""
    if getattr(checkpoint, "file_format", None) != "gguf" or not (_is_linear_weight(param_name) or param_name == EMBEDDING):
        return False
    info = checkpoint.tensors[file_name]
    return info.type_name != "F32" and host.holds(info.type_name, int(info.shape[-1]))


def _build_in_place(checkpoint, file_name: str, param_name: str, raw, type_name: str, dtype: torch.dtype,
                    host: HostLayout) -> nn.Module:
    rows = _raw_rows(checkpoint, file_name, raw)
    in_features = int(checkpoint.tensors[file_name].shape[-1])
    if param_name == EMBEDDING:
        return host.embedding(type_name, rows, in_features, dtype)
    return host.linear(type_name, rows, in_features)


def _float_matrix(checkpoint, file_name: str, raw, rows: torch.Tensor | None) -> torch.Tensor:
    if rows is None:  # Hugging Face: already a float tensor
        return checkpoint.dequantize(file_name, raw).float()
    info = checkpoint.tensors[file_name]
    return dequantize_rows(rows, info.type_name, info.shape[-1])


def _build(checkpoint, file_name: str, param_name: str, raw, fmt: str, type_name: str, dtype: torch.dtype,
           device: torch.device, int4: type[Int4Linear] = Int4Linear) -> tuple[nn.Module | None, str]:
    """The quantized module of one weight, or (None, why) when no kernel runs its shape on ``device``."""
    shape = checkpoint.tensors[file_name].shape if getattr(checkpoint, "file_format", None) == "gguf" else raw.shape
    n, k = int(shape[0]), int(shape[-1])
    reason = int4_unsupported_reason(device, n, k) if fmt == "int4" else int8_unsupported_reason(device, n, k)
    if reason:
        return None, reason
    rows = _raw_rows(checkpoint, file_name, raw)
    if fmt == "int4":
        if rows is not None and type_name in INT4_TYPES:
            return int4.from_int4_rows(unpack_int4(rows, type_name), device=device), ""
        return int4.from_float(_float_matrix(checkpoint, file_name, raw, rows), device=device), ""
    if fmt == "int8-groups":
        codes, scales = _int8_group_rows(checkpoint, file_name, raw, rows, type_name)
        if param_name == EMBEDDING:
            return Int8Embedding.from_codes(codes, scales, device, dtype), ""
        return Int8GroupedLinear.from_codes(codes, scales, device=device), ""
    codes, scales = _int8_channel_rows(checkpoint, file_name, raw, rows, type_name, kernel_dtype_for(device))
    return Int8Linear.from_codes(codes, scales, device=device), ""


def _chunks(checkpoint, file_name: str, rows: torch.Tensor, type_name: str):
    """Float32 values of ``ROW_CHUNK`` rows at a time."""
    n_values = checkpoint.tensors[file_name].shape[-1]
    for start in range(0, rows.shape[0], ROW_CHUNK):
        yield dequantize_rows(rows[start:start + ROW_CHUNK], type_name, n_values)


def _int8_channel_rows(checkpoint, file_name: str, raw, rows: torch.Tensor | None, type_name: str,
                       scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and float32 scales of a matrix, requantized ``ROW_CHUNK`` rows at a time."""
    if rows is None:
        return quantize_int8(checkpoint.dequantize(file_name, raw), scale_dtype)
    parts = [quantize_int8(values, scale_dtype) for values in _chunks(checkpoint, file_name, rows, type_name)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def _int8_group_rows(checkpoint, file_name: str, raw, rows: torch.Tensor | None,
                     type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes with a scale per 32 values: Q8_0 blocks as they are, other types requantized."""
    if rows is None:
        return quantize_int8_groups(checkpoint.dequantize(file_name, raw))
    if type_name == "Q8_0":
        return unpack_q8_0(rows)
    parts = [quantize_int8_groups(values) for values in _chunks(checkpoint, file_name, rows, type_name)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
