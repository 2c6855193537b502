#!/usr/bin/env python
"""How faithful prefill is: every position's next-token distribution of a text, ours and
llama.cpp's, against the exact model (float32 over the file's dequantized weights).

    .venv/bin/python tools/prefill_fidelity.py [--model PATH] [--text docs/architecture.md] [--tokens 1024]
        [--chunk 512] [--threads 2] [--save ours.pt] [--extra NAME=saved.pt ...] [--no-llama-cpp]
        [--activations exact,int8]

Prints, per engine, the mean KL(exact || engine) in nats per token, the top-1 agreement and the
count of positions whose top-1 token differs; ``--activations`` lists our products' input roundings
to measure (default: exact, the engine's default). ``--save`` (the first one's logits) writes our logits (and the ids) so that
another checkout's run can be compared in this one with ``--extra`` (run the other checkout's
engine with ``PYTHONPATH=<its src> ... --save its.pt --no-llama-cpp``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridllm import LLM
from hybridllm.eval.fidelity import divergence, llama_cpp_logits, position_logits
from hybridllm.loading.registry import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "docs" / "architecture.md"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save", help="write our logits and the ids here")
    parser.add_argument("--extra", action="append", default=[], help="NAME=PATH of logits saved by --save")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--activations", default="exact", help="comma-separated: exact, int8")
    args = parser.parse_args()

    path = args.model or str(default_model_path())
    engines, ids = {}, None
    for activations in args.activations.split(","):
        ours = LLM(path, threads=args.threads, activations=activations)  # weights="auto": as served
        if ids is None:
            ids = ours.tokenizer.encode(Path(args.text).read_text(), add_special_tokens=True)[:args.tokens]
        ours_logits = position_logits(ours, ids, args.chunk)
        if args.save and not engines:
            torch.save({"ids": ids, "logits": ours_logits}, args.save)
        engines[f"hybridllm ({ours.weights_format}, {activations} activations)"] = ours_logits
        del ours
    exact = position_logits(LLM(path, weights="float", threads=args.threads), ids, args.chunk)
    for spec in args.extra:
        name, saved = spec.split("=", 1)
        record = torch.load(saved)
        if list(record["ids"]) != list(ids):
            raise SystemExit(f"error: {saved} holds the logits of other ids")
        engines[name] = record["logits"]
    if not args.no_llama_cpp:
        engines["llama.cpp"] = llama_cpp_logits(path, ids, threads=args.threads)
    print(f"{Path(path).name}: {len(ids)} tokens of {Path(args.text).name}, chunks of {args.chunk}")
    print("| prefill | mean KL from exact (nats/token) | top-1 agreement | top-1 flips |")
    print("| --- | ---: | ---: | ---: |")
    for name, logits in engines.items():
        kl, agreement = divergence(exact, logits)
        flips = int((exact.argmax(-1) != logits.argmax(-1)).sum())
        print(f"| {name} | {kl:.3e} | {agreement:.4f} | {flips} / {len(ids)} |")


if __name__ == "__main__":
    main()
