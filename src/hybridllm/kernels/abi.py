"""The native kernels' C ABI: the structs ``abi.h`` declares, the exported functions' argument
types (``decode.cpp``), and the weight formats they read.

    library = kernels()            # the built library, argument types declared
    blocks = pack_int4_blocks(codes, scales_and_zeros)
    codes, scales_and_zeros = unpack_int4_blocks(blocks, n, k)

The ctypes structures mirror ``abi.h``'s ``extern "C"`` structs field for field
(``ABI_VERSION`` in ``hybridllm.kernels.build`` guards the pairing).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hybridllm.kernels.build import load_decode_library

GROUP = 32
Q4_ROWS = 16  # rows per tile of every quantized format (qtypes.h)
Q4_PARAM_BYTES = Q4_ROWS * 2 * 2  # a Q4 tile's bfloat16 scales, then its zeros (its codes follow)
# abi.h's WeightFormat
FORMAT_F32, FORMAT_Q4, FORMAT_I8_ROWS, FORMAT_I8_GROUPS, FORMAT_F16, FORMAT_BF16 = 0, 1, 2, 3, 4, 5
# The GGUF types the kernels read in their own format (tiles of 16 rows, the file's scales kept),
# and the GGUF float types they read as rows.
GGUF_FORMATS = {"Q4_0": 6, "Q4_1": 7, "Q5_0": 8, "Q5_1": 9, "Q8_0": 10, "Q4_K": 11, "Q5_K": 12, "Q6_K": 13,
                "IQ4_NL": 14, "IQ4_XS": 15, "F16": FORMAT_F16, "BF16": FORMAT_BF16, "F32": FORMAT_F32}
FLOAT_FORMATS = {FORMAT_F32: torch.float32, FORMAT_F16: torch.float16, FORMAT_BF16: torch.bfloat16}
SUPER_BLOCK = {name: 1 if code in FLOAT_FORMATS else 256 if name.endswith("_K") or name == "IQ4_XS" else 32
               for name, code in GGUF_FORMATS.items()}
ACT_SILU, ACT_GELU_TANH = 0, 1  # abi.h's MlpActivation
KV_DTYPES = {torch.float32: 0, torch.float16: 1}  # dense KV the kernels read as stored (abi.h's KVFormat F32, F16)
MAX_HEAD_DIM = 512  # layer.h's rotary scratch
MAX_GROUP = 16  # attention.h: query heads per KV head
# activations.h: int8 digits per input value of the quantized products, by ``--activations`` name:
# "exact" two (~15 bits; a model's logits within ~1e-6 nats of float32's), "int8" one (llama.cpp's
# Q8_0 rounding, half the integer work)
ACTIVATION_DIGITS = {"exact": 2, "int8": 1}
EXACT_DIGITS = ACTIVATION_DIGITS["exact"]


class HLLinear(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("has_bias", ctypes.c_int32),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("activation_digits", ctypes.c_int32),
    ]


class HLProjection(ctypes.Structure):
    _fields_ = [("parts", HLLinear * 3), ("n_parts", ctypes.c_int32)]


class HLDecoderLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", HLProjection),
        ("o", HLLinear),
        ("gate_up", HLProjection),
        ("down", HLLinear),
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_mlp_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("attn_softcap", ctypes.c_float),
        ("activation", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("rotary_dim", ctypes.c_int32),
        ("rope_table", ctypes.c_int32),
        ("n_rope_tables", ctypes.c_int32),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
    ]


class HLKVSegment(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("key_group", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("position", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("row0", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("k_zero", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("v_zero", ctypes.c_void_p),
    ]


MAX_KV_SEGMENTS = 3  # abi.h


class HLLayerCache(ctypes.Structure):
    _fields_ = [
        ("segments", HLKVSegment * MAX_KV_SEGMENTS),
        ("n_segments", ctypes.c_int32),
        ("write", ctypes.c_int32),
        ("write_row", ctypes.c_int64),
        ("start", ctypes.c_int64),
        ("window", ctypes.c_int32),  # the layer's sliding window (0: none)
        ("settle", ctypes.c_int32),
        ("settle_row", ctypes.c_int64),
    ]


_SLOT_BYTES = ctypes.sizeof(HLLayerCache)


@functools.cache
def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types of the exported functions (ctypes then converts ints and pointers)."""
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    linear = ctypes.POINTER(HLLinear)
    signatures = {
        "hl_linear": ([linear, ptr, ptr, i64, i32], None),
        "hl_reference_linear": ([linear, ptr, ptr, i64], None),
        "hl_tiled_bytes": ([i32, i64, i64], i64),
        "hl_pack_gguf": ([i32, ptr, i64, i64, ptr, i32], i32),
        "hl_pack_int8": ([i32, ptr, ptr, i64, i64, ptr], i32),
        "hl_dequantize_rows": ([linear, ptr, i64, ptr], None),
        "hl_amx": ([], i32),
        "hl_set_amx": ([i32], i32),
        "hl_set_panels": ([i32], i32),
        "hl_attention": ([ptr, ptr, ptr, i32, i64, i64, i32, i32, i32, ptr, i32], None),
        "hl_partial_attention": ([ptr, i64, ctypes.POINTER(HLKVSegment), i32, i32, i32, f32, f32, ptr, ptr, i32], None),
        "hl_prefill_attention": ([ptr, ptr, ptr, i32, i64, i64, i64, i32, i32, i32, i32, ptr, i32], None),
        "hl_decode_layer": ([ctypes.POINTER(HLDecoderLayer), ptr, ptr, ctypes.POINTER(HLLayerCache), i64, ptr, ptr, i32],
                            None),
        "hl_decode_model": ([ctypes.POINTER(HLDecoderLayer), ctypes.POINTER(HLLayerCache), i64, i64, ptr, ptr, ptr, ptr,
                             f32, linear, f32, ptr, i32], None),
        "hl_prefill_model": ([ctypes.POINTER(HLDecoderLayer), ctypes.POINTER(HLLayerCache), i64, i64, ptr, ptr, ptr, ptr,
                              ptr, f32, linear, f32, ptr, i32, i32], None),
        "hl_set_spin_wait": ([i32], None),
        "hl_spin_wait": ([], i32),
        "hl_kernel_isa": ([], ctypes.c_char_p),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def kernels() -> ctypes.CDLL:
    """The loaded kernel library with its argument types declared (built on first use)."""
    return _declare(load_decode_library().library)


def kernel_isa() -> str:
    """The instruction set the native kernels were built for: avx512-vnni, avx2-vnni, avx2 or
    portable (``$HYBRIDLLM_KERNEL_MARCH`` picks another than the host's)."""
    return kernels().hl_kernel_isa().decode()


def amx_tiles() -> bool:
    """Whether the native products of many rows (batched decode, prefill chunks) of quantized
    weights run on AMX tiles (built for them, and granted by the OS; the same bits as the vector
    kernels)."""
    return bool(kernels().hl_amx())


def prefill_precision() -> str:
    """How the native prefill products compute: as decode steps do (one arithmetic per row), the
    quantized weights' exact integer dots over two int8 digits per activation, on AMX tiles where
    the CPU has them."""
    return "int8 (AMX)" if amx_tiles() else "int8"


def tiled_bytes(format_code: int, n: int, k: int) -> int:
    """Bytes of an (n, k) matrix in a quantized format's tiles (qtypes.h; 0 if it cannot hold k)."""
    return int(kernels().hl_tiled_bytes(format_code, n, k))


# ---- weights as the kernels read them ------------------------------------------------------
def pack_int4_blocks(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """int4 rows in the kernels' FORMAT_Q4 tiles (qtypes.h): (ceil(N/16), K/32, 320) bytes.

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
