"""Decode attention over a static KV buffer as two Triton kernels (flash-decoding), for a CUDA graph.

The cuda-graph backend's step attends one query per row over the rows of its static pool, each
row seeing its own number of keys (``lengths``, a device tensor). The PyTorch forms of that step
(:mod:`hybridllm.kvcache.attention`) either run few thread blocks (one SDPA call), copy the
chunked keys every step (the split form), or build the whole score matrix in float32 (the two
products): the second H100 run measured ~1.2 ms of attention per token at 4K for 134 MB of KV.
Here the keys are read where they lie, once:

- :func:`_split_partials`: one program per (row, KV head, split of the keys). It loads the
  row's ``GROUPS`` query heads that share the KV head (padded to ``BLOCK_G`` >= 16 rows, the
  least a tensor-core product takes), walks its split ``BLOCK_N`` keys at a time with an online
  softmax (base 2; a compile-time count of steps, ``TILES``, the keys past the row's length
  masked: Triton 3.6's interpreter cannot loop to a bound it holds as a tensor, under NumPy 2),
  and writes the split's normalized output and log-sum-exp. A split past the
  row's length writes a zero output and a log-sum-exp of -inf.
- :func:`_merge_splits`: one program per (row, query head): the splits' outputs weighted by
  ``exp2(lse - max lse)``.

The grid is fixed by the buffer's span (the graph's key span) and the batch, never by the
lengths: no host sync, no branch on data, so the two launches are captured and replayed.
Everything is float32 in registers: keys, values and queries are widened as they are loaded,
the scores, softmax and products are float32. The products of a bfloat16 or float16 buffer run
on TF32 tensor cores, which hold those values exactly (8 and 11 significant bits in TF32's 11),
so only the softmax weights are rounded (to TF32, finer than the other forms' bfloat16); a
float32 buffer's products run in IEEE float32, so a float32 model gives the other forms' tokens.
Triton's interpreter (NumPy) computes every product in float32: the tests there check the same
code for every dtype (its own bfloat16 products are not usable: NumPy multiplies the raw bits).

Triton is imported here, at the top: callers import this module only where it is used (a CUDA
device with Triton installed, or the interpreter, ``TRITON_INTERPRET=1``, in the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per step of a split's walk
MIN_BLOCK_G = 16  # query rows per program, padded: the least a tensor-core product takes
# splits are added until the grid has about this many programs: ~4 per SM of an H100/H200 (each
# split short, one or two tiles at 4K), or ~1 (longer splits whose loads the compiler pipelines);
# the cuda-graph backend captures both and keeps the faster ("triton", "triton-coarse")
TARGET_PROGRAMS = 512
COARSE_PROGRAMS = 128

LOG2_E = 1.4426950408889634


@triton.jit
def _split_partials(q_ptr, k_ptr, v_ptr, lengths_ptr, part_ptr, lse_ptr,
                    stride_q_row, stride_q_head,
                    stride_k_row, stride_k_head, stride_k_key,
                    stride_v_row, stride_v_head, stride_v_key,
                    stride_p_row, stride_p_head, stride_p_split,
                    stride_l_row, stride_l_head,
                    scale_log2, keys_per_split,
                    TILES: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + row)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < GROUPS, d < HEAD_DIM
    heads = kv_head * GROUPS + g  # (BLOCK_G,) the query heads of this KV head
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_D)
    k_base = k_ptr + row * stride_k_row + kv_head * stride_k_head
    v_base = v_ptr + row * stride_v_row + kv_head * stride_v_head
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(0, TILES):  # a fixed count (tiles past the row's length are masked out)
        n = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_k_key + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_G, BLOCK_N)
        scores = tl.where(n_ok[None, :], scores * scale_log2, float("-inf"))  # (BLOCK_G, BLOCK_N), base 2
        new_max = tl.maximum(running_max, tl.max(scores, 1))  # -inf while no key was visible
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(running_max - safe_max)
        weights = tl.exp2(scores - safe_max[:, None])  # 0 for keys past the length
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + n[:, None] * stride_v_key + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        running_max = new_max
    seen = running_sum > 0  # False for a split past the row's length
    out = acc / tl.where(seen, running_sum, 1.0)[:, None]
    lse = tl.where(seen, running_max + tl.log2(tl.where(seen, running_sum, 1.0)), float("-inf"))
    tl.store(part_ptr + row * stride_p_row + heads[:, None] * stride_p_head + split * stride_p_split + d[None, :],
             out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + row * stride_l_row + heads * stride_l_head + split, lse, mask=g_ok)


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, n_splits,
                  stride_p_row, stride_p_head, stride_p_split,
                  stride_l_row, stride_l_head,
                  stride_o_row, stride_o_head,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < n_splits, d < HEAD_DIM
    lse = tl.load(lse_ptr + row * stride_l_row + head * stride_l_head + s, mask=s_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # (BLOCK_S,): split 0 always sees key 0, so the max is finite
    parts = tl.load(part_ptr + row * stride_p_row + head * stride_p_head + s[:, None] * stride_p_split + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """The products' precision for a buffer of ``dtype``: TF32 holds bfloat16 and float16 values
    exactly; float32 takes IEEE."""
    return "ieee" if dtype == torch.float32 else "tf32"


def split_count(span: int, rows: int, kv_heads: int, programs: int = TARGET_PROGRAMS) -> int:
    """Splits of a ``span``-key buffer: enough for ~``programs`` programs over the (row, KV head)
    pairs, at most one per :data:`BLOCK_N` keys."""
    wanted = math.ceil(programs / max(1, rows * kv_heads))
    return max(1, min(wanted, math.ceil(span / BLOCK_N)))


def triton_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            lengths: torch.Tensor, programs: int = TARGET_PROGRAMS) -> torch.Tensor:
    """:func:`~hybridllm.kvcache.attention.length_masked_decode_attention` in two Triton kernels.

    Args:
        q: (B, H, 1, D); k, v: (B, Hkv, S, D) views of the buffer (their last dimension dense);
            lengths: (B,) int64 in 1..S (keys 0 .. length - 1 are visible).
        programs: about how many programs the first kernel runs (see :data:`TARGET_PROGRAMS`).
    Returns:
        (B, H, 1, D) in q's dtype.
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, span = k.shape[1], k.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("triton_decode_attention reads keys and values whose last dimension is dense")
    groups = n_heads // n_kv_heads
    q3 = q.reshape(batch, n_heads, head_dim)  # (B, H, D): q_len 1 dropped (a view of a dense q)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    n_splits = split_count(span, batch, n_kv_heads, programs)
    keys_per_split = math.ceil(math.ceil(span / n_splits) / BLOCK_N) * BLOCK_N
    parts = torch.empty(batch, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)  # (B, H, splits, D)
    lse = torch.empty(batch, n_heads, n_splits, dtype=torch.float32, device=q.device)  # (B, H, splits), base 2
    block_d = max(16, triton.next_power_of_2(head_dim))
    _split_partials[(batch, n_kv_heads, n_splits)](
        q3, k, v, lengths, parts, lse,
        q3.stride(0), q3.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        LOG2_E / math.sqrt(head_dim), keys_per_split,
        TILES=keys_per_split // BLOCK_N, GROUPS=groups, HEAD_DIM=head_dim, BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(groups)),
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, PRECISION=dot_precision(q.dtype))
    out = torch.empty(batch, n_heads, 1, head_dim, dtype=q.dtype, device=q.device)  # (B, H, 1, D)
    _merge_splits[(batch, n_heads)](
        parts, lse, out, n_splits,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_D=block_d)
    return out
