"""Quantized KV: bytes against error, for choosing the format (issue 19).

For each (bits, key scales, group, residual, residual dtype) it prints the KV bytes of a ``context``-token
sequence of the default model, as counted by the cache's own ledger, against the same tokens
in float16 (``--kv-cache dynamic --kv-dtype float16``: what llama.cpp's f16 cache holds), and
the perplexity delta and KL of ``hybridllm eval perplexity`` with that cache (windows of
``context`` tokens fed in chunks of 64).

    .venv/bin/python tools/kv_compactness.py --context 1024 --max-tokens 8192
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

from hybridllm import LLM
from hybridllm.config import KVConfig
from hybridllm.kvcache.base import KVSpec
from hybridllm.kvcache.factory import create_cache


def ledger_bytes(llm: LLM, config: KVConfig, n_tokens: int) -> int:
    """Bytes a cache built by ``config`` holds after ``n_tokens`` tokens appended in chunks of 64
    (reserved for them first)."""
    c = llm.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, torch.device("cpu"), max_tokens=n_tokens)
    cache = create_cache(config, spec)
    cache.reserve(n_tokens)  # as the engine does for a request of known length: no growth slack
    gen = torch.Generator().manual_seed(0)
    for start in range(0, n_tokens, 64):
        n = min(64, n_tokens - start)
        for layer in range(c.n_layers):
            keys, values = (torch.randn(1, c.n_kv_heads, n, c.head_dim, generator=gen) for _ in range(2))
            cache.extend(layer, keys, values)
    return sum(cache.bytes_per_tier().values())


def perplexity(args: argparse.Namespace, flags: list[str]) -> dict:
    # float32 weights on the CPU: the KV format is the only difference from the reference
    command = [str(Path(sys.executable).with_name("hybridllm")), "eval", "perplexity", "--threads", str(args.threads), "--json",
               "--weights", "float", "--device", "cpu",
               "--context", str(args.context), "--max-tokens", str(args.max_tokens), *flags]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bits", default="8,4")
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--residuals", default="0,128")
    parser.add_argument("--residual-dtypes", default="float16")
    parser.add_argument("--key-quant", default="per-token,per-channel", help="key scales: per-token and/or per-channel")
    parser.add_argument("--no-perplexity", action="store_true", help="bytes only")
    args = parser.parse_args()
    llm = LLM()
    fp16 = ledger_bytes(llm, KVConfig(kv_dtype="float16"), args.context)
    print(f"float16 KV of {args.context} tokens: {fp16:,} bytes")
    print("| bits | keys | group | residual | residual dtype | bytes vs float16 | perplexity delta | KL (nats/token) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    grid = itertools.product(args.bits.split(","), args.key_quant.split(","), args.groups.split(","),
                             args.residuals.split(","), args.residual_dtypes.split(","))
    for bits, key_quant, group, residual, residual_dtype in grid:
        if residual == "0" and residual_dtype != args.residual_dtypes.split(",")[0]:
            continue  # no residual: its dtype does not matter
        config = KVConfig(kv_cache="quantized", kv_bits=int(bits), kv_group_size=int(group),
                          kv_residual=int(residual), kv_dtype=residual_dtype, kv_key_quant=key_quant)
        ratio = fp16 / ledger_bytes(llm, config, args.context)
        quality = "" if args.no_perplexity else perplexity(args, [
            "--kv-cache", "quantized", "--kv-bits", bits, "--kv-group-size", group, "--kv-residual", residual,
            "--kv-dtype", residual_dtype, "--kv-key-quant", key_quant])
        delta = f"{quality['delta_percent']:+.3f} %" if quality else "-"
        kl = f"{quality['kl_divergence']:.5f}" if quality else "-"
        print(f"| int{bits} | {key_quant} | {group} | {residual} | {residual_dtype if residual != '0' else '-'} | "
              f"{ratio:.2f}x | {delta} | {kl} |", flush=True)


if __name__ == "__main__":
    main()
