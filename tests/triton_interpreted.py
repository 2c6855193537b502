"""The Triton kernels of the GPU path, run by Triton's interpreter on CPU tensors.

Not a test module: ``test_cuda_graph.py`` runs it in a process of its own with
``TRITON_INTERPRET=1`` (the interpreter is chosen when a kernel is defined, so it must not leak
into the tests that run the kernels on a GPU):

    TRITON_INTERPRET=1 python tests/triton_interpreted.py TINY_MODEL_FOLDER [TINY_MODEL_FOLDER ...]

It checks the split-KV decode kernels against the length-masked SDPA reference (dtypes, GQA
groups, head sizes that are not powers of two, lengths from 1 to the whole span, one split and
many) and the fused elementwise kernels against the PyTorch ops they replace, then decodes a
tiny model through the cuda-graph backend's static step (the Triton attention with and without
the fused kernels, the fused kernels with SDPA; the other folders, other families' layouts, with
both) and compares its greedy tokens with the eager backend's. Prints one line per check;
exits non-zero at the first mismatch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_cuda_graph import _eager_greedy, _model_from_folder, _prompts, _static_greedy  # noqa: E402

from hybridllm.kvcache.attention import length_masked_decode_attention  # noqa: E402
from hybridllm.kvcache.triton_decode import (COARSE_PROGRAMS, TARGET_PROGRAMS, split_count,  # noqa: E402
                                             triton_decode_attention)
from hybridllm.models.layers import RMSNorm, apply_rotary  # noqa: E402
from hybridllm.models.triton_fused import rms_norm, rotate_and_store, silu_and_mul  # noqa: E402

# bfloat16: the interpreter truncates to bfloat16 (under a unit: 2^-7 of the value) where a GPU
# rounds to nearest, so its results may be a unit off PyTorch's once per rounding (up to three in
# a row): in bfloat16 these checks catch wrong indexing and math, the cuda tests the last bits
RTOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -5}
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5}  # the values are about N(0, 1): sums that cancel


def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Exit unless ``got`` equals ``want`` within the dtype's :data:`RTOL` and :data:`ATOL`, elementwise."""
    rtol, atol = RTOL[want.dtype], ATOL[want.dtype]
    excess = ((got.float() - want.float()).abs() - rtol * want.float().abs()).max().item()
    print(f"{name}: max error {(got.float() - want.float()).abs().max().item():.2e}")
    if got.shape != want.shape or got.dtype != want.dtype or not excess <= atol:
        raise SystemExit(f"{name}: mismatch ({got.shape} {got.dtype} vs {want.shape} {want.dtype}; {excess} past rtol)")


def check_fused(dtype: torch.dtype) -> None:
    """The three fused kernels against the PyTorch ops they replace."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, 96, generator=g).to(dtype)
    residual = torch.randn(3, 1, 96, generator=g).to(dtype)
    for scale_in_float32 in (False, True):
        norm = RMSNorm(96, 1e-5, scale_in_float32)
        norm.weight.data = (1 + torch.randn(96, generator=g) / 4).to(dtype)
        with torch.no_grad():
            normed, summed = rms_norm(x, norm, residual)
            close(f"rms_norm {dtype} gemma-order={scale_in_float32} (sum)", summed, x + residual)
            close(f"rms_norm {dtype} gemma-order={scale_in_float32}", normed, norm(summed))
            alone, same = rms_norm(x, norm)
            close(f"rms_norm {dtype} without a residual", alone, norm(x))
            assert same is x
    gate_up = torch.randn(3, 1, 2 * 1500, generator=g).to(dtype)  # two blocks of the kernel, the second partial
    gate, up = gate_up.chunk(2, dim=-1)
    close(f"silu_and_mul {dtype}", silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    n_heads, n_kv_heads, head_dim = 4, 2, 24
    for rotary_dim in (24, 16):  # whole and partial rotary (Phi-3)
        qkv = torch.randn(3, 1, (n_heads + 2 * n_kv_heads) * head_dim, generator=g).to(dtype)
        angles = torch.arange(40.0)[:, None] / (10.0 ** (torch.arange(rotary_dim // 2) / 4))  # (positions, R/2)
        cos, sin = (torch.cat((f, f), dim=-1).to(dtype) for f in (angles.cos(), angles.sin()))  # (positions, R)
        positions, slots, columns = torch.tensor([0, 17, 39]), torch.tensor([2, 0, 1]), torch.tensor([5, 9, 1])
        keys = torch.zeros(4, n_kv_heads, 12, head_dim, dtype=dtype)
        values = torch.zeros_like(keys)
        q = rotate_and_store(qkv, cos, sin, positions, slots, columns, keys, values, n_heads, n_kv_heads)
        heads = qkv.view(3, n_heads + 2 * n_kv_heads, 1, head_dim)  # (B, H + 2 Hkv, 1, D)
        rotated = apply_rotary(heads[:, :n_heads + n_kv_heads], cos[positions][:, None, None, :],
                               sin[positions][:, None, None, :])  # (B, H + Hkv, 1, D)
        close(f"rotate_and_store {dtype} R={rotary_dim} (q)", q, rotated[:, :n_heads])
        close(f"rotate_and_store {dtype} R={rotary_dim} (k)", keys[slots, :, columns], rotated[:, n_heads:, 0])
        close(f"rotate_and_store {dtype} R={rotary_dim} (v)", values[slots, :, columns], heads[:, n_heads + n_kv_heads:, 0])
        written = torch.zeros(4, 12, dtype=torch.bool)
        written[slots, columns] = True
        if keys.transpose(1, 2)[~written].any() or values.transpose(1, 2)[~written].any():  # (rows, columns, Hkv, D)
            raise SystemExit("rotate_and_store wrote outside its rows' columns")


def check_kernel(dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int, span: int,
                 lengths: list[int], programs: int = TARGET_PROGRAMS) -> None:
    g = torch.Generator().manual_seed(span + head_dim)
    rows = len(lengths)
    pool_k = torch.randn(rows + 1, n_kv_heads, span + 7, head_dim, generator=g).to(dtype)  # wider than the span
    pool_v = torch.randn(rows + 1, n_kv_heads, span + 7, head_dim, generator=g).to(dtype)
    q = torch.randn(rows, n_heads, 1, head_dim, generator=g).to(dtype)
    keys, values = pool_k[:rows, :, :span], pool_v[:rows, :, :span]  # (B, Hkv, span, D) strided views
    visible = torch.tensor(lengths)
    out = triton_decode_attention(q, keys, values, visible, programs)
    ref = length_masked_decode_attention(q.float(), keys.float(), values.float(), visible)
    error = (out.float() - ref).abs().max().item()
    # bfloat16: the output's own rounding, which the interpreter truncates (under a unit: 2^-7 of
    # the value), where a GPU rounds to nearest (half a unit)
    rtol = 1e-6 if dtype == torch.float32 else 2 ** -7
    excess = ((out.float() - ref).abs() - rtol * ref.abs()).max().item()
    splits = split_count(span, rows, n_kv_heads, programs)
    print(f"kernel {dtype} H={n_heads} Hkv={n_kv_heads} D={head_dim} span={span} splits={splits} "
          f"lengths={lengths}: max error {error:.2e}")
    if out.shape != q.shape or out.dtype != dtype or not excess <= 1e-5:
        raise SystemExit(f"mismatch: max error {error}, {excess} past a relative {rtol}")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    check_kernel(torch.float32, 8, 2, 16, 256, [1, 64, 65, 256])  # splits of 64 keys, rows ending anywhere
    check_kernel(torch.float32, 4, 4, 64, 128, [100])  # no grouping, one row: two splits
    check_kernel(torch.bfloat16, 12, 4, 96, 512, [511, 3, 300])  # a head size of 96 (masked to 128)
    check_kernel(torch.float32, 32, 8, 64, 4096, [4000])  # the 1B shape: 64 splits of one tile
    check_kernel(torch.float32, 32, 8, 64, 4096, [4000], COARSE_PROGRAMS)  # 16 splits of four tiles
    check_fused(torch.float32)
    check_fused(torch.bfloat16)
    first = True
    for folder in map(Path, sys.argv[1:]):
        model = _model_from_folder(folder)
        prompts = _prompts(model.config.vocab_size)
        expected = [_eager_greedy(model, p, steps=6) for p in prompts]
        combos = [("triton", True), ("triton", False), ("sdpa", True), ("triton-coarse", True)] if first else [
            ("triton", True)]
        first = False
        for attention, fused in combos:
            tokens, backend = _static_greedy(model, prompts, steps=6, attention=attention, fused=fused)
            if fused and not backend.fused_elementwise:
                raise SystemExit(f"{folder.name}: the fused kernels do not apply to it")
            print(f"static step ({folder.name}), {attention} form, fused elementwise {fused}: {tokens} "
                  f"(eager: {expected}); steps {dict(backend.steps_by_bucket)}")
            if tokens != expected or backend.steps_by_bucket != {4: 5}:
                raise SystemExit("the static step's greedy tokens differ from the eager backend's")
    print("ok")


if __name__ == "__main__":
    main()
