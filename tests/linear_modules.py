"""Linear layers of every weight format the native kernels read, and their exact product (for the
kernel tests of test_native_decode.py and test_native_prefill.py)."""

from __future__ import annotations

import torch

from hybridllm.models.quantized import Int4Linear, Int8GroupedLinear, Int8Linear

KINDS = ("float", "float_bias", "int4", "int4_bias", "int8", "int8_groups")


def linear_module(kind: str, n: int, k: int) -> torch.nn.Module:
    """A seeded (n, k) layer of ``kind`` (see ``KINDS``; "_bias" adds a bias)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) if kind.endswith("bias") else None
    if kind.startswith("float"):
        module = torch.nn.Linear(k, n, bias=bias is not None)
        module.weight.data, module.bias = weight, None if bias is None else torch.nn.Parameter(bias)
        return module
    if kind.startswith("int4"):
        return Int4Linear.from_float(weight, bias)
    if kind == "int8":
        return Int8Linear.from_float(weight)
    return Int8GroupedLinear.from_float(weight)


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The float32 (N, K) weight the layer computes with."""
    return module.weight if isinstance(module, torch.nn.Linear) else module.dequantize()


def exact_product(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T (+ bias) in float64 over the layer's exact (dequantized) weight."""
    out = x.double() @ dequantized_weight(module).double().T
    return out if getattr(module, "bias", None) is None else out + module.bias.double()
