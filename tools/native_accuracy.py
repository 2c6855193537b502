"""How close decode-step logits are to the exact product over the dequantized weights.

    python tools/native_accuracy.py [--model PATH] [--prompt 32] [--steps 32] [--threads 2]

Loads the model three times with ``weights="auto"`` (the file's quantization kept): the native
decode kernels, PyTorch's quantized kernels (``native_decode=False``), and an exact reference
whose int4/int8 weights are dequantized to float32 modules (``dequantize_model``). A
random prompt is prefilled by each (the first ``--prompt`` tokens), then ``--steps`` tokens are
fed one decode step at a time (teacher forcing: the same tokens for all three), and each step's
logits are compared with the reference: the largest logit difference, the mean KL divergence
and how often the top-1 token agrees.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hybridllm import LLM
from hybridllm.models.quantized import dequantize_model


def decode_logits(llm: LLM, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    cache = llm.new_cache()
    with torch.inference_mode():
        llm.model(ids[:, :prompt], cache, 0)
        return torch.stack([llm.model(ids[:, i:i + 1], cache, i)[0, -1] for i in range(prompt, ids.shape[1])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    exact_llm = LLM(args.model, weights="auto", threads=args.threads, native_decode=False)
    dequantize_model(exact_llm.model)
    vocab = min(exact_llm.config.vocab_size, 20000)
    ids = torch.randint(0, vocab, (1, args.prompt + args.steps), generator=torch.Generator().manual_seed(args.seed))
    exact = decode_logits(exact_llm, ids, args.prompt)
    print(f"{args.steps} decode steps after a {args.prompt}-token prompt, against float32 over the dequantized weights")
    print("| decode path | max abs logit difference | mean KL | top-1 agreement |")
    print("| --- | --- | --- | --- |")
    for name, native_decode in (("native kernels", True), ("PyTorch quantized kernels", False)):
        logits = decode_logits(LLM(args.model, weights="auto", threads=args.threads, native_decode=native_decode),
                               ids, args.prompt)
        kl = F.kl_div(logits.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="batchmean")
        agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean()
        print(f"| {name} | {(logits - exact).abs().max():.3f} | {kl:.2e} | {agree:.1%} |")


if __name__ == "__main__":
    main()
