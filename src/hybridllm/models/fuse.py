"""Stacked projections: q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` per layer.

A decode step multiplies one token by every projection, so each separate projection is one
more operator call (and, for the quantized kernels, one more cast of the activations to the
kernel dtype and one more pass of the thread pool). The model has one layout: the loaders read
the checkpoint's separate projections and stack the output rows of those that read the same
input (:func:`stack_projections`), turning 5 calls per layer into 2 with the same arithmetic:

- ``nn.Linear``: the weights (and biases) are concatenated along the output rows.
- :class:`~hybridllm.models.quantized.Int4Linear` (and its layouts: the stacked layer is built by
  the parts' own class, ``from_codes``): each part's codes are read back exactly
  (``unpack_codes``), concatenated, and packed again; the group-wise scales and zeros are
  concatenated along the output axis. Group-wise int4 has no per-matrix state, so the stacked
  product equals the separate ones (up to the kernel's own summation order).
- :class:`~hybridllm.models.quantized.Int8Linear`: codes and per-row scales are concatenated.
- :class:`~hybridllm.models.quantized.Int8GroupedLinear`: codes and group scales are
  concatenated along the output axis of their group-major slabs.
- :class:`~hybridllm.models.quantized.PackedLinear` (a kernel's own format, e.g. the native
  kernels' GGUF tiles): its class's ``concat`` (same format, whole tiles of rows).

Parts that cannot be stacked (different types or kernel settings, e.g. a Q6_K ``v_proj`` in a
Q4_K_M file), or a load asked not to (``fuse=False``), become a :class:`ConcatLinear`: the same
interface, the parts kept separate, their outputs concatenated.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridllm.models.quantized import Int4Linear, Int8GroupedLinear, Int8Linear, PackedLinear


class ConcatLinear(nn.Module):
    """Separate projections of one input seen as one: ``cat([p(x) for p in parts], -1)``."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)  # (..., sum of out_features)


def stack_projections(parts: list[nn.Module], fuse: bool = True) -> nn.Module:
    """One module computing ``cat([p(x) for p in parts], -1)``: a single stacked matrix when
    ``fuse`` and the parts can be stacked, else a :class:`ConcatLinear` of the parts. One part
    (a checkpoint that stores the projection stacked, Phi-3) is already the module."""
    if len(parts) == 1:
        return parts[0]
    stacked = concat_linears(parts) if fuse else None
    return stacked if stacked is not None else ConcatLinear(parts)


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([p(x) for p in parts], -1)``, or None when they cannot be stacked."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
        return None
    kind = kinds.pop()
    if kind is nn.Linear:
        return _concat_float(parts)
    if issubclass(kind, Int4Linear):  # PyTorch's packed layout or another (the native blocks)
        return _concat_int4(kind, parts)
    if kind is Int8Linear:
        return _concat_int8(parts)
    if kind is Int8GroupedLinear:
        return _concat_int8_groups(parts)
    if issubclass(kind, PackedLinear):  # a kernel's own format: its class knows when its parts stack
        return kind.concat(parts)
    return None


def _same_device(parts: list[nn.Module]) -> torch.device | None:
    devices = {p.weight.device for p in parts}
    return devices.pop() if len(devices) == 1 else None


def _concat_bias(parts: list[nn.Module], device: torch.device) -> torch.Tensor | None:
    """The stacked biases (N_total,), zeros for parts without one; None when no part has one."""
    biases = [p.bias for p in parts if p.bias is not None]
    if not biases:
        return None
    dtype = biases[0].dtype
    return torch.cat([
        p.bias.detach().to(dtype) if p.bias is not None else torch.zeros(p.out_features, dtype=dtype, device=device)
        for p in parts
    ])


def _concat_float(parts: list[nn.Linear]) -> nn.Linear | None:
    device = _same_device(parts)
    if device is None or len({p.weight.dtype for p in parts}) != 1:
        return None
    dtype = parts[0].weight.dtype
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)  # (N_total, K)
    bias = _concat_bias(parts, device)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def _concat_int4(kind: type[Int4Linear], parts: list[Int4Linear]) -> Int4Linear | None:
    device = _same_device(parts)
    settings = {(p.group_size, p.kernel_dtype) for p in parts}
    if device is None or len(settings) != 1:
        return None
    group_size, _ = settings.pop()
    codes = torch.cat([p.unpack_codes() for p in parts], dim=0)  # (N_total, K) uint8, exact
    scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1).contiguous()  # (G, N_total, 2)
    return kind.from_codes(codes, scales_and_zeros, group_size, _concat_bias(parts, device), device)


def _concat_int8(parts: list[Int8Linear]) -> Int8Linear | None:
    device = _same_device(parts)
    if device is None or len({p.kernel_dtype for p in parts}) != 1:
        return None
    weight = torch.cat([p.weight for p in parts], dim=0).contiguous()  # (N_total, K) int8
    scales = torch.cat([p.scales for p in parts], dim=0).contiguous()  # (N_total,)
    return Int8Linear(weight, scales, _concat_bias(parts, device))


def _concat_int8_groups(parts: list[Int8GroupedLinear]) -> Int8GroupedLinear | None:
    device = _same_device(parts)
    if device is None or len({(p.group_size, p.kernel_dtype) for p in parts}) != 1:
        return None
    weight = torch.cat([p.weight for p in parts], dim=1).contiguous()  # (G, N_total, group) int8
    scales = torch.cat([p.scales for p in parts], dim=1).contiguous()  # (G, N_total)
    return Int8GroupedLinear(weight, scales, parts[0].kernel_dtype, _concat_bias(parts, device))
