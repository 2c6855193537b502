"""Fused projections: q/k/v into one matrix and gate/up into one, per layer, after loading.

A decode step multiplies one token by every projection, so each separate projection is one
more operator call (and, for the quantized kernels, one more cast of the activations to the
kernel dtype and one more pass of the thread pool). Stacking the output rows of projections
that read the same input turns 5 calls per layer into 2 with the same arithmetic:

- ``nn.Linear``: the weights (and biases) are concatenated along the output rows.
- :class:`~hybridllm.models.quantized.Int4Linear`: each layer's codes are read back exactly
  (``unpack_codes``), concatenated, and packed again; the group-wise scales and zeros are
  concatenated along the output axis. Group-wise int4 has no per-matrix state, so the fused
  product equals the separate ones (up to the kernel's own summation order).
- :class:`~hybridllm.models.quantized.Int8Linear`: codes and per-row scales are concatenated.

Fusion runs per layer on the device that layer's weights are on, so it works after a
placement moved layers to different devices. Projections whose types or kernel settings
differ are left unfused. ``Attention.forward`` and ``SwiGLU.forward`` use ``qkv_proj`` /
``gate_up_proj`` when present.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridllm.models.quantized import Int4Linear, Int8Linear, _int4_pack

logger = logging.getLogger(__name__)


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every decoder layer of a Llama-family ``model`` in place.

    Returns the model. Idempotent: layers already fused are skipped.
    """
    fused_attn = fused_mlp = 0
    for layer in model.model.layers:
        fused_attn += fuse_attention(layer.self_attn)
        fused_mlp += fuse_mlp(layer.mlp)
    logger.info("fused q/k/v in %d layers and gate/up in %d layers", fused_attn, fused_mlp)
    return model


def fuse_attention(attn: nn.Module) -> bool:
    """Replace ``q_proj``, ``k_proj``, ``v_proj`` by one ``qkv_proj``; True when fused."""
    if hasattr(attn, "qkv_proj"):
        return False
    fused = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    if fused is None:
        return False
    attn.qkv_proj = fused
    del attn.q_proj, attn.k_proj, attn.v_proj
    return True


def fuse_mlp(mlp: nn.Module) -> bool:
    """Replace ``gate_proj`` and ``up_proj`` by one ``gate_up_proj``; True when fused."""
    if hasattr(mlp, "gate_up_proj"):
        return False
    fused = concat_linears([mlp.gate_proj, mlp.up_proj])
    if fused is None:
        return False
    mlp.gate_up_proj = fused
    del mlp.gate_proj, mlp.up_proj
    return True


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([p(x) for p in parts], -1)``, or None when they cannot be stacked."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
        return None
    kind = kinds.pop()
    if kind is nn.Linear:
        return _concat_float(parts)
    if kind is Int4Linear:
        return _concat_int4(parts)
    if kind is Int8Linear:
        return _concat_int8(parts)
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


def _concat_int4(parts: list[Int4Linear]) -> Int4Linear | None:
    device = _same_device(parts)
    settings = {(p.group_size, p.kernel_dtype) for p in parts}
    if device is None or len(settings) != 1:
        return None
    group_size, _ = settings.pop()
    codes = torch.cat([p.unpack_codes() for p in parts], dim=0)  # (N_total, K) uint8, exact
    scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1).contiguous()  # (G, N_total, 2)
    bias = _concat_bias(parts, device)
    return Int4Linear(codes.shape[1], codes.shape[0], _int4_pack(codes, device), scales_and_zeros, group_size, bias)


def _concat_int8(parts: list[Int8Linear]) -> Int8Linear | None:
    device = _same_device(parts)
    if device is None or len({p.kernel_dtype for p in parts}) != 1:
        return None
    weight = torch.cat([p.weight for p in parts], dim=0).contiguous()  # (N_total, K) int8
    scales = torch.cat([p.scales for p in parts], dim=0).contiguous()  # (N_total,)
    return Int8Linear(weight, scales, _concat_bias(parts, device))
