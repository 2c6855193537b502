"""The native kernels' C ABI: the structs ``decode.cpp`` reads, its exported functions' argument
types, and the weight layout its int4 products read.

    library = kernels()            # the built library, argument types declared
    blocks = pack_int4_blocks(codes, scales_and_zeros)

The ctypes structures mirror ``decode.cpp``'s ``extern "C"`` structs field for field
(``ABI_VERSION`` in ``hybridllm.kernels.build`` guards the pairing).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hybridllm.kernels.build import load_decode_library

GROUP = 32
ROWS = 4  # rows per Q4 block (decode.cpp's ROWS)
FORMAT_F32, FORMAT_Q4, FORMAT_Q8_ROWS, FORMAT_Q8_GROUPS = 0, 1, 2, 3
KV_DTYPES = {torch.float32: 0, torch.float16: 1}  # decode.cpp's KVDtype: the KV the kernels read as stored
MAX_HEAD_DIM = 512  # decode.cpp's rotary scratch


class HLLinear(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("has_bias", ctypes.c_int32),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class HLDecoderLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", HLLinear),
        ("o", HLLinear),
        ("gate_up", HLLinear),
        ("down", HLLinear),
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
    ]


class HLLayerCache(ctypes.Structure):
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("capacity", ctypes.c_int64),
        ("start", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int32),
        ("window", ctypes.c_int32),  # the layer's sliding window (0: none)
    ]


_SLOT_BYTES = ctypes.sizeof(HLLayerCache)


@functools.cache
def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types of the exported functions (ctypes then converts ints and pointers)."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    library.hl_linear.argtypes = [ctypes.POINTER(HLLinear), ptr, ptr, i64, i32]
    library.hl_linear.restype = None
    library.hl_prefill_linear.argtypes = [ctypes.POINTER(HLLinear), ptr, ptr, i64, i32]
    library.hl_prefill_linear.restype = None
    library.hl_prefill_precision.argtypes = []
    library.hl_prefill_precision.restype = ctypes.c_char_p
    library.hl_attention.argtypes = [ptr, ptr, ptr, i32, i64, i64, i32, i32, i32, ptr, i32]
    library.hl_attention.restype = None
    library.hl_prefill_attention.argtypes = [ptr, ptr, ptr, i32, i64, i64, i64, i32, i32, i32, i32, ptr, i32]
    library.hl_prefill_attention.restype = None
    library.hl_decode_layer.argtypes = [ctypes.POINTER(HLDecoderLayer), ptr, ptr, ctypes.POINTER(HLLayerCache), i64,
                                        ptr, ptr, i32]
    library.hl_decode_layer.restype = None
    library.hl_decode_model.argtypes = [ctypes.POINTER(HLDecoderLayer), ctypes.POINTER(HLLayerCache), i64, i64, ptr,
                                        ptr, ptr, ptr, ctypes.c_float, ctypes.POINTER(HLLinear), ptr, i32]
    library.hl_decode_model.restype = None
    library.hl_prefill_model.argtypes = [ctypes.POINTER(HLDecoderLayer), ctypes.POINTER(HLLayerCache), i64, i64, ptr,
                                         ptr, ptr, ptr, ctypes.c_float, ctypes.POINTER(HLLinear), ptr, i64, i32]
    library.hl_prefill_model.restype = None
    library.hl_set_spin_wait.argtypes = [i32]
    library.hl_set_spin_wait.restype = None
    library.hl_spin_wait.argtypes = []
    library.hl_spin_wait.restype = i32
    library.hl_kernel_isa.argtypes = []
    library.hl_kernel_isa.restype = ctypes.c_char_p
    return library


def kernels() -> ctypes.CDLL:
    """The loaded kernel library with its argument types declared (built on first use)."""
    return _declare(load_decode_library().library)


def kernel_isa() -> str:
    """The instruction set the native kernels were built for: avx512-vnni, avx2-vnni, avx2 or
    portable (``$HYBRIDLLM_KERNEL_MARCH`` picks another than the host's)."""
    return kernels().hl_kernel_isa().decode()


def prefill_precision() -> str:
    """The element type of the native prefill products on quantized weights: "bfloat16" (bf16
    pair dots, AVX512-BF16) or "float32" (float32 weights always use float32)."""
    return kernels().hl_prefill_precision().decode()


# ---- weights as the kernels read them ------------------------------------------------------
def pack_int4_blocks(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """int4 rows in decode.cpp's streaming layout: (ceil(N/4), K/32, 80) bytes.

    Args:
        codes: (N, K) codes 0..15.
        scales_and_zeros: (K/32, N, 2) scale and zero per group (value = (q - 8) * scale + zero).
    Each 80-byte block holds one group of 4 consecutive rows: their (scale, zero) as bfloat16
    pairs (16 bytes), then their codes (16 bytes each; byte j = q[j] | q[j + 16] << 4), so a
    thread reads its rows as one sequential stream.
    """
    n, k = codes.shape
    groups = k // GROUP
    padded = -(-n // ROWS) * ROWS
    q = codes.to(torch.uint8).reshape(n, groups, GROUP)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # (N, G, 16)
    sz = scales_and_zeros.to(torch.bfloat16).transpose(0, 1).contiguous().view(torch.uint8)  # (N, G, 4)
    if padded != n:
        nibbles = torch.cat((nibbles, nibbles.new_zeros(padded - n, groups, 16)))
        sz = torch.cat((sz, sz.new_zeros(padded - n, groups, 4)))
    nibbles = nibbles.reshape(padded // ROWS, ROWS, groups, 16).transpose(1, 2).reshape(padded // ROWS, groups, -1)
    sz = sz.reshape(padded // ROWS, ROWS, groups, 4).transpose(1, 2).reshape(padded // ROWS, groups, -1)
    return torch.cat((sz, nibbles), dim=-1).contiguous()  # (N/4, G, 16 + 64)
