"""The answers of 8 greedy prompts under every way the engine can split their work (issue 33's
matrix): prefill chunks of 512, 64 and 7 tokens, the prefix cache's first and second ask, and a
batch of 16 (prompts prefilled together, or in pieces beside the others' decodes). Each answer is the generated ids with every step's log-probability and top-5
alternatives (floats kept exactly), so two answers are equal only if the logits are.

Run in the test process for the build it loaded, and as a script in a child process for another
build (``$HYBRIDLLM_KERNEL_MARCH`` is read once per process)::

    HYBRIDLLM_KERNEL_MARCH=x86-64-v3 python tests/answer_matrix.py MODEL WEIGHTS [MODEL WEIGHTS ...]

prints ``{model: {setting: [answer per prompt]}}`` as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

PROMPT_LENGTHS = (5, 33, 64, 97, 130, 171, 200, 260)  # under, on and across prefix pages (32) and chunks
MAX_TOKENS = 8
TOP = 5
CHUNKS = (512, 64, 7)
BATCH = 16


def prompts(vocab_size: int, count: int = BATCH) -> list[list[int]]:
    """``count`` seeded random prompts; the first 8 have :data:`PROMPT_LENGTHS`, the rest fill a batch."""
    generator = torch.Generator().manual_seed(33)
    lengths = list(PROMPT_LENGTHS) + [int(n) for n in torch.randint(3, 240, (count - len(PROMPT_LENGTHS),), generator=generator)]
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _answer(result: Any) -> dict[str, Any]:
    return {"ids": list(result.token_ids),
            "logprobs": [entry.logprob for entry in result.logprobs],
            "top": [[list(pair) for pair in entry.top] for entry in result.logprobs],
            "cached_tokens": result.metrics.get("cached_tokens", 0)}


def answers(model: str, weights: str, activations: str = "exact") -> dict[str, list[dict[str, Any]]]:
    """Setting name -> the 8 prompts' answers."""
    from hybridllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    out: dict[str, list[dict[str, Any]]] = {}
    for chunk in CHUNKS:
        llm = LLM(model, device="cpu", weights=weights, prefill_chunk=chunk, activations=activations)
        every = prompts(llm.config.vocab_size)
        out[f"chunk {chunk}"] = [_answer(llm.generate(ids, params)) for ids in every[:len(PROMPT_LENGTHS)]]
        if chunk in (CHUNKS[0], CHUNKS[-1]):  # whole prompts in one forward; pieces beside decodes
            batch = llm.engine.generate_batch(every, [params] * len(every))
            out[f"batch of 16, chunk {chunk}"] = [_answer(result) for result in batch[:len(PROMPT_LENGTHS)]]
    cached = LLM(model, device="cpu", weights=weights, prefix_cache_ram="64MiB", activations=activations)
    first = [_answer(cached.generate(ids, params)) for ids in every[:len(PROMPT_LENGTHS)]]
    out["prefix cache, first ask"] = first
    out["prefix cache, second ask"] = [_answer(cached.generate(ids, params)) for ids in every[:len(PROMPT_LENGTHS)]]
    return out


def main(argv: list[str]) -> None:
    """argv: (model, weights, activations) triples; prints {"model weights activations": answers}."""
    triples = list(zip(argv[::3], argv[1::3], argv[2::3]))
    print(json.dumps({" ".join(triple): answers(*triple) for triple in triples}))


if __name__ == "__main__":
    main(sys.argv[1:])
