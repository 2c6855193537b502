"""The native kernels' C ABI: the structs ``decode.cpp`` reads, its exported functions' argument
types, and the weight layout its int4 products read.

    library = kernels()            # the built library, argument types declared
    blocks = pack_int4_blocks(codes, scales_and_zeros)
    codes, scales_and_zeros = unpack_int4_blocks(blocks, n, k)

The ctypes structures mirror ``decode.cpp``'s ``extern "C"`` structs field for field
(``ABI_VERSION`` in ``hybridllm.kernels.build`` guards the pairing).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hybridllm.kernels.build import load_decode_library

GROUP = 32
Q4_ROWS = 16  # rows per Q4 block (q4_blocks.h)
Q4_PARAM_BYTES = Q4_ROWS * 2 * 2  # a block's bfloat16 scales, then its zeros (its codes follow)
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
    library.hl_prefill_uses_panels.argtypes = [ctypes.POINTER(HLLinear), i64]
    library.hl_prefill_uses_panels.restype = i32
    library.hl_amx.argtypes = []
    library.hl_amx.restype = i32
    library.hl_set_amx.argtypes = [i32]
    library.hl_set_amx.restype = i32
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
                                         ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.POINTER(HLLinear), ptr, i32, i32]
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


def amx_tiles() -> bool:
    """Whether the native products of many rows (batched decode, prefill chunks) of int4 and
    grouped int8 weights run on AMX tiles (built for them, and granted by the OS)."""
    return bool(kernels().hl_amx())


def prefill_precision() -> str:
    """How the native prefill products on int4 weights compute: "int8 (AMX)" (the decode
    products' exact integer dots over two int8 digits per activation, on AMX tiles), or in
    dequantized panels of "bfloat16" (bf16 pair dots, AVX512-BF16) or "float32" (float32
    weights always use float32 panels)."""
    return "int8 (AMX)" if amx_tiles() else kernels().hl_prefill_precision().decode()


# ---- weights as the kernels read them ------------------------------------------------------
def pack_int4_blocks(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """int4 rows in the kernels' block layout (q4_blocks.h): (ceil(N/16), K/32, 320) bytes.

    Args:
        codes: (N, K) codes 0..15.
        scales_and_zeros: (K/32, N, 2) scale and zero per group (value = (q - 8) * scale + zero).
    Each 320-byte block holds one group of 16 consecutive rows (rows past N are zeros): their
    scales (16 bfloat16), their zeros (16 bfloat16), then 4 chunks of 64 code bytes; chunk j's
    byte 4n + t holds row n's code for input 4j + t (low nibble) and 16 + 4j + t (high nibble),
    the operand layout of the kernels' integer dots.
    """
    n, k = codes.shape
    groups = k // GROUP
    padded = -(-n // Q4_ROWS) * Q4_ROWS
    blocks = padded // Q4_ROWS
    q = codes.to(torch.uint8).reshape(n, groups, GROUP)
    sz = scales_and_zeros.to(torch.bfloat16).transpose(0, 1).contiguous()  # (N, G, 2)
    if padded != n:
        q = torch.cat((q, q.new_zeros(padded - n, groups, GROUP)))
        sz = torch.cat((sz, sz.new_zeros(padded - n, groups, 2)))
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # (N, G, 16): byte 4j + t = inputs 4j + t and 16 + 4j + t
    nibbles = nibbles.reshape(blocks, Q4_ROWS, groups, 4, 4)  # (blocks, row n, G, chunk j, t)
    chunks = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 4 * Q4_ROWS * 4)  # (blocks, G, [j][n][t])
    params = sz.reshape(blocks, Q4_ROWS, groups, 2).permute(0, 2, 3, 1)  # (blocks, G, scale|zero, row n)
    params = params.contiguous().view(torch.uint8).reshape(blocks, groups, Q4_PARAM_BYTES)
    return torch.cat((params, chunks), dim=-1).contiguous()  # (blocks, G, 64 + 256)


def unpack_int4_blocks(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4_blocks`: (N, K) uint8 codes and (K/32, N, 2) bfloat16
    scale/zero."""
    groups = k // GROUP
    count = blocks.shape[0]
    params = blocks[..., :Q4_PARAM_BYTES].contiguous().view(torch.bfloat16).reshape(count, groups, 2, Q4_ROWS)
    sz = params.permute(0, 3, 1, 2).reshape(count * Q4_ROWS, groups, 2)[:n]  # (N, G, 2)
    chunks = blocks[..., Q4_PARAM_BYTES:].reshape(count, groups, 4, Q4_ROWS, 4).permute(0, 3, 1, 2, 4)  # (blocks, n, G, j, t)
    nibbles = chunks.reshape(count * Q4_ROWS, groups, 16)[:n]  # (N, G, 16)
    codes = torch.cat((nibbles & 15, nibbles >> 4), dim=-1)  # (N, G, 32): q[j], then q[j + 16]
    return codes.reshape(n, k).contiguous(), sz.transpose(0, 1).contiguous()
