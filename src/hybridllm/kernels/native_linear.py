"""Host int4 layers held once, in the layout the native kernels read.

    replaced = hold_int4_natively(model)   # every CPU Int4Linear -> NativeInt4Linear, in place

PyTorch's CPU int4 kernel wants its own packed layout; the native decode kernels read 16-row
blocks (:func:`hybridllm.kernels.native.pack_int4_blocks`). Keeping both doubled the int4
weights' memory. A :class:`NativeInt4Linear` holds only the blocks, and every path reads them:
the native decode step in place, prefill chunks and any other product through
``hl_prefill_linear`` (dequantized panels, ``prefill_gemm.h``; faster than PyTorch's bfloat16
int4 kernel from a few rows on), and the rest of the engine through ``Int4Linear``'s contract
(``unpack_codes``, ``scales_and_zeros``, ``dequantize``: the same codes and group parameters).

The loader builds host int4 layers straight as ``NativeInt4Linear`` when the native backend will
run (``runtime.build.host_int4_layout``: no PyTorch-packed copy ever exists); for a model built
otherwise, :func:`hold_int4_natively` is the transform (as ``quantize_model`` is, gpt-fast style),
one layer at a time, so memory grows by one matrix, not by the model.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from hybridllm.errors import ConfigError
from hybridllm.kernels.abi import FORMAT_Q4, GROUP, HLLinear, kernels, pack_int4_blocks, unpack_int4_blocks
from hybridllm.models.quantized import Int4Linear, release_unpack_tables


class NativeInt4Linear(Int4Linear):
    """An :class:`~hybridllm.models.quantized.Int4Linear` whose only copy is the native block layout.

    Buffers: ``weight`` ((ceil(N/16), K/32, 320) uint8 blocks, CPU). ``forward`` runs the native
    product (float32 activations, float32 results): the decode products' integer dots for few
    rows or on AMX tiles, else dequantized panels (bfloat16 pair dots where the CPU has them, as
    PyTorch's int4 kernel computes; :func:`~hybridllm.kernels.abi.prefill_precision`). Lives on
    the CPU only.
    """

    def __init__(self, in_features: int, out_features: int, blocks: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # no PyTorch-packed buffers: the blocks hold codes, scales and zeros
        self.in_features, self.out_features, self.group_size = in_features, out_features, GROUP
        self.register_buffer("weight", blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = GROUP,
                   bias: torch.Tensor | None = None, device: torch.device | str = "cpu") -> NativeInt4Linear:
        """From (N, K) codes 0..15 and (K / 32, N, 2) scale/zero (rounded to bfloat16), on the CPU.
        (``from_int4_rows``, ``from_float`` and the stacking of q/k/v, gate/up build through here.)"""
        if group_size != GROUP:
            raise ConfigError(f"native int4 layers use groups of {GROUP}, got {group_size}")
        if torch.device(device).type != "cpu":
            raise ConfigError(f"a native int4 layer lives on the CPU, not {device}")
        n, k = codes.shape
        return cls(k, n, pack_int4_blocks(codes.cpu(), scales_and_zeros.cpu()), bias)

    @classmethod
    def from_int4_linear(cls, module: Int4Linear) -> NativeInt4Linear:
        """The same weights as ``module`` (group 32, on the CPU) in block layout."""
        return cls.from_codes(module.unpack_codes(), module.scales_and_zeros, module.group_size, module.bias)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.bfloat16  # the blocks' scales and zeros

    @property
    def scales_and_zeros(self) -> torch.Tensor:
        """(K/32, N, 2) bfloat16 scale and zero per group, read from the blocks."""
        return unpack_int4_blocks(self.weight, self.out_features, self.in_features)[1]

    def unpack_codes(self) -> torch.Tensor:
        """(N, K) uint8 codes 0..15."""
        return unpack_int4_blocks(self.weight, self.out_features, self.in_features)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise ConfigError(f"a native int4 layer runs on the CPU, got input on {x.device}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, K)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)  # (M, N)
        bias = None if self.bias is None else self.bias.detach().float().contiguous()  # the kernels read float32
        struct = HLLinear(FORMAT_Q4, int(bias is not None), self.out_features, self.in_features,
                          self.weight.data_ptr(), 0, 0 if bias is None else bias.data_ptr())
        kernels().hl_prefill_linear(ctypes.byref(struct), rows.data_ptr(), out.data_ptr(), rows.shape[0],
                                    torch.get_num_threads())
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def _apply(self, fn, recurse: bool = True):
        moved = fn(torch.zeros(1)).device
        if moved.type != "cpu":
            raise ConfigError(f"cannot move a native int4 layer to {moved}: its block layout is the CPU kernels' "
                              "(build the model with --decode-backend eager to keep PyTorch's layout)")
        return nn.Module._apply(self, fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP}, "
                f"bias={self.bias is not None}, layout=native blocks")


def hold_int4_natively(model: nn.Module) -> int:
    """Replace every CPU ``Int4Linear`` (group 32) of the decoder layers by a
    :class:`NativeInt4Linear` of the same weights, in place, one at a time (each PyTorch-packed
    copy is freed as its blocks are made). Returns how many were replaced."""
    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is Int4Linear and child.weight.device.type == "cpu" and child.group_size == GROUP:
                    setattr(parent, name, NativeInt4Linear.from_int4_linear(child))
                    del child
                    replaced += 1
    if replaced:
        release_unpack_tables()
    return replaced


__all__ = ["NativeInt4Linear", "hold_int4_natively"]
