"""The decoder layer's elementwise chain as three Triton kernels, for a captured decode step.

On a GPU a decode step of a 1B model is a few matrix-vector products and, between them, a long
chain of small kernels: the second H100 run's graph step spent ~3.2 ms of CUDA time per token,
1.2 ms of it in the products and ~0.8 ms in small elementwise kernels (a layer was about 30
launches in all; RMSNorm alone is eight: cast, square, mean, add, rsqrt, multiply, cast, scale).
Here each link of the chain between two products is one kernel:

- :func:`rms_norm`: (optionally) the residual add, then RMSNorm: one program per row.
- :func:`rotate_and_store`: the rotary embedding of q and k ("rotate half", partial rotary
  passed through) from the stacked q/k/v projection, q written to its own tensor, k and v
  written straight into a KV buffer's column (the static pool's row and column per batch row).
- :func:`silu_and_mul`: SwiGLU's ``silu(gate) * up`` from the stacked gate/up projection.

Each kernel rounds where the PyTorch ops it replaces round (to the activations' dtype after the
residual add, after the norm before the weight, after each rotary product and after silu), and
computes in float32 between, so a bfloat16 step stays within its last bit of the plain one; a
float32 step differs only in summation order.

Triton is imported at the top: callers import this module only where it is used (a CUDA device
with Triton, or the interpreter, ``TRITON_INTERPRET=1``, in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridllm.models.layers import RMSNorm


@triton.jit
def _rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, n_cols, eps,
              HAS_RESIDUAL: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # x + residual, rounded to the activations' dtype (PyTorch's add), kept as the new x
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    normed = x32 * tl.math.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if SCALE_IN_FLOAT32:  # Gemma's order: scale in float32, then round
        out = normed * weight
    else:  # Llama's: round, then scale (a product in the activations' dtype)
        out = normed.to(out_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_and_store(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, columns_ptr, q_ptr, k_ptr, v_ptr,
                      stride_qkv_row, stride_q_row, stride_q_head,
                      stride_k_row, stride_k_head, stride_k_key,
                      stride_v_row, stride_v_head, stride_v_key, stride_table,
                      N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      ROTARY_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)  # head: q heads, then k heads, then v heads
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    x = tl.load(qkv_ptr + row * stride_qkv_row + head * HEAD_DIM + d, mask=ok, other=0.0)
    slot = tl.load(slots_ptr + row)
    column = tl.load(columns_ptr + row)
    if head < N_HEADS + N_KV_HEADS:  # q or k: rotate the first ROTARY_DIM dimensions
        half = ROTARY_DIM // 2
        rotary = d < ROTARY_DIM
        partner = tl.where(d < half, d + half, d - half)  # "rotate half": (-x2, x1)
        other = tl.load(qkv_ptr + row * stride_qkv_row + head * HEAD_DIM + partner, mask=rotary, other=0.0)
        other = tl.where(d < half, -other.to(tl.float32), other.to(tl.float32))
        position = tl.load(positions_ptr + row)
        cos = tl.load(cos_ptr + position * stride_table + d, mask=rotary, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_table + d, mask=rotary, other=0.0).to(tl.float32)
        dtype = x.dtype
        # x * cos + rotated * sin, each product and the sum rounded as PyTorch's three ops round them
        rotated = ((x.to(tl.float32) * cos).to(dtype).to(tl.float32)
                   + (other * sin).to(dtype).to(tl.float32)).to(dtype)
        x = tl.where(rotary, rotated, x)
        if head < N_HEADS:
            tl.store(q_ptr + row * stride_q_row + head * stride_q_head + d, x, mask=ok)
        else:
            kv_head = head - N_HEADS
            tl.store(k_ptr + slot * stride_k_row + kv_head * stride_k_head + column * stride_k_key + d, x, mask=ok)
    else:
        kv_head = head - N_HEADS - N_KV_HEADS
        tl.store(v_ptr + slot * stride_v_row + kv_head * stride_v_head + column * stride_v_key + d, x, mask=ok)


@triton.jit
def _silu_and_mul(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0)
    g32 = gate.to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # silu, rounded (PyTorch's F.silu)
    tl.store(out_ptr + row * n_cols + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def rms_norm(x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(x + residual)`` and ``x + residual`` (``x`` itself without a residual), as one kernel.

    Args:
        x, residual: (..., hidden), dense, the same shape and dtype.
    Returns:
        (normed, summed), each shaped as x.
    """
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    _rms_norm[(rows,)](x, residual if residual is not None else x, norm.weight, out, summed, hidden, norm.eps,
                       HAS_RESIDUAL=residual is not None, SCALE_IN_FLOAT32=norm.scale_in_float32,
                       BLOCK=triton.next_power_of_2(hidden))
    return out, summed


def rotate_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Rotated q of one token per row, its rotated k and v written into the KV buffers.

    Args:
        qkv: (B, 1, (H + 2 Hkv) * D) the stacked projection (q heads, k heads, v heads).
        cos, sin: (positions, R) the rotary tables (R <= D: the first R dimensions rotate).
        positions, slots, columns: (B,) int64: each row's position, its row in the buffers and
            the column its key and value go to.
        keys, values: (rows, Hkv, columns, D) the buffers, their last dimension dense.
    Returns:
        q (B, H, 1, D).
    """
    batch = qkv.shape[0]
    head_dim = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
    qkv2 = qkv.reshape(batch, -1)  # (B, (H + 2 Hkv) * D)
    q = torch.empty(batch, n_heads, 1, head_dim, dtype=qkv.dtype, device=qkv.device)  # (B, H, 1, D)
    _rotate_and_store[(batch, n_heads + 2 * n_kv_heads)](
        qkv2, cos, sin, positions, slots, columns, q, keys, values,
        qkv2.stride(0), q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), cos.stride(0),
        N_HEADS=n_heads, N_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=cos.shape[-1],
        BLOCK_D=triton.next_power_of_2(head_dim))
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the stacked projection (..., 2 I) -> (..., I)."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
