"""Time building the tokenizer of a GGUF file, or of a synthetic SentencePiece vocabulary (merges
derived from scores, as Gemma's files need) of a given size.

    python tools/tokenizer_load.py MODEL.gguf
    python tools/tokenizer_load.py --spm-vocab 262144

Prints the median of ``--repeat`` builds (seconds) and the merges' count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.tokenizer import Tokenizer


def synthetic_spm_metadata(size: int, seed: int = 0) -> dict[str, object]:
    """A SentencePiece vocabulary of ``size`` tokens (2-8 characters over 66), scores by rank."""
    rng = random.Random(seed)
    chars = list("abcdefghijklmnopqrstuvwxyz▁ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789日本語😀")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + chars
    seen = set(tokens)
    while len(tokens) < size:
        token = "".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259),
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)],
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a GGUF file")
    parser.add_argument("--spm-vocab", type=int, help="a synthetic SentencePiece vocabulary of this many tokens")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if (args.model is None) == (args.spm_vocab is None):
        parser.error("give a GGUF file or --spm-vocab N")
    metadata = GGUFFile(args.model).metadata if args.model else synthetic_spm_metadata(args.spm_vocab)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
        times.append(time.perf_counter() - start)
    print(f"vocabulary {tokenizer.vocab_size}: tokenizer built in {statistics.median(times):.3f} s "
          f"(median of {args.repeat})")


if __name__ == "__main__":
    main()
