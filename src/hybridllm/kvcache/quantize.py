"""Group-wise asymmetric integer quantization of KV tensors (int8 and int4).

A group of ``group_size`` consecutive elements along one axis shares a scale and a zero point
(its minimum): ``x ~= code * scale + zero`` with ``code`` in ``0 .. 2**bits - 1``. Keys are
quantized per channel (groups run along the token axis), values per token (groups run along
the channel axis), as in KIVI. Codes are ``uint8``; two 4-bit codes share a byte along the
last axis. Scales and zeros are stored as float16, and the codes are computed against the
rounded float16 values so that their rounding does not add to the error.
"""

from __future__ import annotations

import math

import torch

SCALE_DTYPE = torch.float16
BITS = (4, 8)
_FP16_MAX = torch.finfo(torch.float16).max
_FP16_TINY = torch.finfo(torch.float16).tiny  # smallest normal: floor for a group's step


def packed_size(n: int, bits: int) -> int:
    """Bytes per row of ``n`` codes."""
    _check_bits(bits)
    if bits == 4 and n % 2:
        raise ValueError(f"4-bit codes pack in pairs; got an odd row length {n}")
    return n * bits // 8


def channel_group(head_dim: int, group_size: int) -> int:
    """Group length along the channel axis: ``group_size`` when it divides ``head_dim``, else a whole row."""
    return group_size if head_dim % group_size == 0 else head_dim


def token_group(page_size: int, group_size: int) -> int:
    """Group length along the token axis for pages of ``page_size`` tokens (must divide the page)."""
    return group_size if page_size % group_size == 0 else math.gcd(page_size, group_size)


def quantize(x: torch.Tensor, bits: int, group_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in groups of ``group_size`` consecutive elements along ``dim``.

    Args:
        x: any floating tensor; ``x.shape[dim]`` must be a multiple of ``group_size``.
        bits: 8 or 4.
        group_size: elements per group.
        dim: the grouped axis (non-negative).
    Returns:
        codes: uint8, ``x``'s shape with the last axis packed to ``packed_size(last, bits)``;
        scale, zero: float16, ``x``'s shape with ``dim`` shrunk to ``x.shape[dim] // group_size``.
    """
    _check_bits(bits)
    n = x.shape[dim]
    if n % group_size:
        raise ValueError(f"quantize: axis {dim} has {n} elements, not a multiple of the group size {group_size}")
    qmax = 2**bits - 1
    grouped = x.float().unflatten(dim, (n // group_size, group_size))  # (..., n/g, g, ...)
    lo = grouped.amin(dim=dim + 1)  # (..., n/g, ...)
    hi = grouped.amax(dim=dim + 1)
    scale = ((hi - lo) / qmax).clamp(_FP16_TINY, _FP16_MAX).to(SCALE_DTYPE)
    zero = lo.clamp(-_FP16_MAX, _FP16_MAX).to(SCALE_DTYPE)
    codes = (grouped - zero.float().unsqueeze(dim + 1)) / scale.float().unsqueeze(dim + 1)
    codes = codes.round_().clamp_(0, qmax).to(torch.uint8).flatten(dim, dim + 1)  # x's shape
    return (pack_int4(codes) if bits == 4 else codes), scale, zero


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``code * scale + zero`` in ``dtype``, in ``x``'s original shape."""
    _check_bits(bits)
    values = unpack_int4(codes) if bits == 4 else codes
    grouped = values.unflatten(dim, (-1, group_size)).float()  # (..., n/g, g, ...)
    out = torch.addcmul(zero.float().unsqueeze(dim + 1), grouped, scale.float().unsqueeze(dim + 1))
    return out.flatten(dim, dim + 1).to(dtype)  # (..., n, ...)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes < 16 -> (..., n) bytes: even elements in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) uint8 codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # (..., n, 2) -> (..., 2n)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"KV quantization supports {BITS} bits, got {bits}")
