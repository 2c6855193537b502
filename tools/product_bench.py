"""GMAC/s of the native products: a GGUF type's (N, K) random weights against M input rows.

    .venv/bin/python tools/product_bench.py [--types Q4_K,Q6_K,Q8_0] [--shapes 8192x3072,3072x8192]
        [--rows 512] [--threads 2] [--activations exact|int8] [--repeat 5]

Prints the best of ``--repeat`` timed products per type and shape (after one warm-up).
``HYBRIDLLM_KERNEL_MARCH=x86-64-v3`` measures the AVX2 build. Speed does not depend on the
weights' values; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from hybridllm.kernels import native
from hybridllm.kernels.native_linear import NativeQuantLinear, activation_digits


# Where a block keeps its float16 scale (and min): set to sane values, so that no product meets a
# NaN or a subnormal (which some CPUs take slow paths for).
SCALE_OFFSETS = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_rows(type_name: str, n: int, k: int) -> torch.Tensor:
    """(n, bytes per row) uint8 of random blocks: random codes, scales in [0.001, 0.02]."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // values, block_bytes), dtype=np.uint8)  # (N, blocks, bytes)
    for offset in SCALE_OFFSETS.get(type_name, (0,)):
        scales = rng.uniform(0.001, 0.02, size=(n, k // values)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def gmacs(type_name: str, n: int, k: int, m: int, threads: int, digits: int, repeat: int) -> float:
    layer = NativeQuantLinear.from_gguf(type_name, random_rows(type_name, n, k), k, activation_digits=digits)
    view = native.linear_view(layer)
    x = torch.randn(m, k)  # (M, K) input rows
    native.linear(view, x, threads=threads)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        native.linear(view, x, threads=threads)
        best = min(best, time.perf_counter() - start)
    return n * k * m / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--shapes", default="8192x3072,3072x8192", help="N x K of the weights, comma-separated")
    parser.add_argument("--rows", type=int, default=512, help="input rows M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", default="exact", help="exact (two int8 digits) or int8 (one)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    digits = activation_digits(args.activations)
    print(f"| type | N x K | M | GMAC/s ({args.activations} activations, {args.threads} threads) |")
    print("| --- | --- | ---: | ---: |")
    for type_name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            rate = gmacs(type_name, n, k, args.rows, args.threads, digits, args.repeat)
            print(f"| {type_name} | {n} x {k} | {args.rows} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
