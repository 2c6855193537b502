"""GGUF block layouts unpacked in PyTorch, without going through float weights.

Each decoder takes the raw bytes of whole rows, ``(rows, bytes_per_row)`` uint8, and returns
the integer codes with their per-group affine parameters, so a 4-bit row stays 4-bit:

- ``Q4_0`` (18-byte blocks of 32): fp16 ``d``, 16 bytes of nibbles; value = d * (q - 8).
- ``Q4_1`` (20-byte blocks of 32): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; value = d * q + m.
- ``Q4_K`` (144-byte super-blocks of 256): fp16 ``d``, fp16 ``dmin``, 12 bytes holding eight
  6-bit sub-block scales and eight 6-bit mins, 128 bytes of nibbles; value of sub-block j
  (32 values) = d * sc_j * q - dmin * m_j.
- ``Q8_0`` (34-byte blocks of 32): fp16 ``d``, 32 int8; value = d * q.

In every 4-bit layout a block of 32 stores element i in the low nibble of byte i and element
i + 16 in the high nibble (Q4_K: per 64 values, 32 bytes; the low nibbles are the first 32
values, the high nibbles the next 32). All three 4-bit types are therefore int4 codes
``q in 0..15`` with group size 32 and value = scale * q + offset per group: :class:`Int4Rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}
_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32}


@dataclass
class Int4Rows:
    """4-bit codes of some rows with group-wise affine parameters: value = scale * q + offset.

    Attributes:
        q: (rows, K) uint8 codes in 0..15.
        scale: (rows, K // 32) float32.
        offset: (rows, K // 32) float32.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """(rows, K) float32 values."""
        rows, k = self.q.shape
        groups = self.q.view(rows, k // GROUP_SIZE, GROUP_SIZE).float()  # (R, G, 32)
        return (groups * self.scale[..., None] + self.offset[..., None]).reshape(rows, k)


def _as_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        # the map is read-only; torch wants a writable buffer even though we never write it
        raw = torch.from_numpy(np.ascontiguousarray(raw)) if raw.flags.writeable else torch.from_numpy(raw.copy())
    return raw


def _blocks(raw: np.ndarray | torch.Tensor, type_name: str) -> torch.Tensor:
    """(rows, bytes_per_row) -> (rows, n_blocks, block_bytes) uint8."""
    data = _as_tensor(raw)
    if data.dtype != torch.uint8 or data.ndim != 2:
        raise ValueError(f"expected (rows, bytes) uint8 data, got {tuple(data.shape)} {data.dtype}")
    block = _BLOCK_BYTES[type_name]
    if data.shape[1] % block:
        raise ValueError(f"{type_name}: a row of {data.shape[1]} bytes is not a whole number of {block}-byte blocks")
    return data.reshape(data.shape[0], data.shape[1] // block, block)


def _f16(pairs: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian fp16 bytes -> (...) float32."""
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) codes: the n low nibbles, then the n high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def row_values(type_name: str) -> int:
    """Values per block of a block type (32 or 256)."""
    return _BLOCK_VALUES[type_name]


def unpack_int4(raw: np.ndarray | torch.Tensor, type_name: str) -> Int4Rows:
    """Codes and group parameters of Q4_0 / Q4_1 / Q4_K rows (exact: no rounding anywhere)."""
    b = _blocks(raw, type_name)
    rows, n_blocks, _ = b.shape
    if type_name == "Q4_0":
        d = _f16(b[..., 0:2])  # (R, nb)
        q = _nibbles(b[..., 2:18])  # (R, nb, 32)
        scale, offset = d, -8.0 * d
    elif type_name == "Q4_1":
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:20])  # (R, nb, 32)
        scale, offset = d, m
    elif type_name == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (R, nb)
        sc, mn = _q4k_scales_mins(b[..., 4:16])  # (R, nb, 8) each
        qs = b[..., 16:144].reshape(rows, n_blocks, 4, 32)  # 4 chunks of 64 values
        q = _nibbles(qs)  # (R, nb, 4, 64): sub-blocks 2c (low nibbles) and 2c+1 (high)
        scale = d[..., None] * sc  # (R, nb, 8)
        offset = -(dmin[..., None] * mn)
    else:
        raise ValueError(f"{type_name} is not a 4-bit block type ({', '.join(INT4_TYPES)})")
    return Int4Rows(
        q=q.reshape(rows, -1).contiguous(),
        scale=scale.reshape(rows, -1).contiguous(),
        offset=offset.reshape(rows, -1).contiguous(),
    )


def _q4k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (float32, (..., 8) each).

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low
    4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the
    top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    p = packed.to(torch.int32)
    lo, mid, hi = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def unpack_q8_0(raw: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (codes (R, K) int8, scales (R, K // 32) float32); value = scale * code."""
    b = _blocks(raw, "Q8_0")
    rows = b.shape[0]
    d = _f16(b[..., 0:2])  # (R, nb)
    q = b[..., 2:34].contiguous().view(torch.int8)  # (R, nb, 32)
    return q.reshape(rows, -1), d


def dequantize_rows(raw: np.ndarray | torch.Tensor, type_name: str, n_values: int) -> torch.Tensor:
    """Float32 values (rows, n_values) of raw rows of any type GGUF files hold.

    Q4_0/Q4_1/Q4_K/Q8_0 and the float types are decoded here; the other block types
    through gguf-py's reference implementation.
    """
    data = _as_tensor(raw)
    rows = data.shape[0]
    if type_name in INT4_TYPES:
        return unpack_int4(data, type_name).dequantize()
    if type_name == "Q8_0":
        q, d = unpack_q8_0(data)
        return (q.view(rows, -1, GROUP_SIZE).float() * d[..., None]).reshape(rows, n_values)
    if type_name == "F32":
        return data.contiguous().view(torch.float32).reshape(rows, n_values).clone()
    if type_name == "F16":
        return data.contiguous().view(torch.float16).reshape(rows, n_values).float()
    if type_name == "BF16":
        return data.contiguous().view(torch.bfloat16).reshape(rows, n_values).float()
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(data.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(rows, n_values)
