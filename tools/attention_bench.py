"""Time the native attention kernels alone, one layer's shape, against another build of them.

    .venv/bin/python tools/attention_bench.py --mode prefill --context 2048 [--against OLD.so]
    .venv/bin/python tools/attention_bench.py --mode decode --context 8192 --kv-dtype float16

``prefill``: a layer's prompt of ``--context`` positions in chunks of ``--chunk`` (each chunk's
queries over the keys so far, causal), ``hl_prefill_attention``. ``decode``: one token's queries
over ``--context`` keys, ``hl_attention``, every call on a different layer's keys (``--layers`` of
them, so that they come from memory as in a decode step). Random queries, keys and values; the
best of ``--repeat`` rounds, the builds alternating. ``--against`` loads another build's library
(a cached ``decode-*.so`` of an older checkout: ``python -c "from hybridllm.kernels import build;
print(build.build_library(()).path)"`` there) and checks that both give the same bits. Each build
has its own thread team, whose workers spin for a while after a call: each is run untimed for 2 ms
before it is timed, so that the other's have gone to sleep (two libraries both built before commit
581277d share one team and workspace instead, which is safe only when their layouts match).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from hybridllm.host_pages import collapse_tensor
from hybridllm.kernels import build, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512, help="prefill: positions per call")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--layers", type=int, default=8, help="decode: layers' worth of distinct keys")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--against", help="another build's library file, timed beside this one")
    parser.add_argument("--huge-pages", action="store_true",
                        help="back the KV's whole 2 MiB pages with huge pages (hybridllm.host_pages.collapse)")
    args = parser.parse_args()

    libraries = {"this build": build.build_library(()).library}
    if args.against:
        libraries["--against"] = ctypes.CDLL(args.against)
    dtype = getattr(torch, args.kv_dtype)
    generator = torch.Generator().manual_seed(0)
    layers = args.layers if args.mode == "decode" else 1
    shape = (args.kv_heads, args.context, args.head_dim)
    keys = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers)]
    values = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers)]
    if args.huge_pages:
        collapsed = sum(collapse_tensor(t) for t in keys + values)
        print(f"{collapsed / 2**20:.0f} MiB of the KV's {sum(t.nbytes for t in keys + values) / 2**20:.0f} on 2 MiB pages")
    if args.mode == "prefill":
        starts = list(range(0, args.context, args.chunk))
        queries = [torch.randn(min(args.chunk, args.context - s), args.heads, args.head_dim, generator=generator)
                   for s in starts]

        def run(library: ctypes.CDLL) -> list[torch.Tensor]:  # each chunk's (T, H, D)
            return [native.prefill_attention(q, keys[0], values[0], s, threads=args.threads, library=library)
                    for q, s in zip(queries, starts)]
    else:
        query = torch.randn(args.heads, args.head_dim, generator=generator)

        def run(library: ctypes.CDLL) -> list[torch.Tensor]:  # each layer's (H, D)
            return [native.attention(query, k, v, args.context, threads=args.threads, library=library)
                    for k, v in zip(keys, values)]

    outputs = {name: run(library) for name, library in libraries.items()}  # also the warm-up
    best = {name: float("inf") for name in libraries}
    for _ in range(args.repeat):
        for name, library in libraries.items():
            warm_until = time.perf_counter() + 0.002  # each build has its own thread team: the other's
            while time.perf_counter() < warm_until:  # workers stop spinning (at most ~1 ms) before the timing
                run(library)
            start = time.perf_counter()
            run(library)
            best[name] = min(best[name], time.perf_counter() - start)
    kv_bytes = 2 * args.kv_heads * args.context * args.head_dim * keys[0].element_size() * layers
    print(f"{args.mode}, context {args.context}, {args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}, "
          f"{args.kv_dtype} KV, {args.threads} threads")
    for name, seconds in best.items():
        if args.mode == "prefill":
            pairs = args.context * (args.context + 1) / 2 * args.heads  # (query, key) pairs, causal
            rate = f"{pairs * args.head_dim * 4 / seconds / 1e9:.1f} GFLOP/s"
            print(f"  {name}: {seconds * 1e3:.1f} ms per layer, {rate}")
        else:
            print(f"  {name}: {seconds / layers * 1e3:.3f} ms per layer, {kv_bytes / seconds / 1e9:.1f} GB/s of KV")
    if args.against:
        same = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
        print("  the same bits" if same else "  DIFFERENT BITS")


if __name__ == "__main__":
    main()
