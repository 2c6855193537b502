#!/usr/bin/env python
"""Write a Hugging Face model folder of random weights that ``hybridllm serve`` can load.

    python tools/random_model_folder.py configs/llama-3.2-1b.json /tmp/llama-1b-random --dtype bfloat16

Where no model may be downloaded (the lent GPU machine), the server still needs a folder: this
writes ``config.json`` (the shape given), ``model.safetensors`` (the tensors of
``RandomCheckpoint``, seeded, so ``bench --random-weights`` measures the same weights) and a
word-level tokenizer whose vocabulary covers every id of the model (``<unk>``, then ``w1`` ...),
with a one-line chat template. Prompts encode to ``<unk>`` ids and replies decode to ``w<id>``
words: the point is the server's speed and memory at a real shape, not text.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """``tokenizer.json`` (word level, ``vocab_size`` entries) and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
    }, indent=2) + "\n")


def write_folder(config_path: Path, folder: Path, dtype: str, seed: int = 0) -> Path:
    """The folder for ``config_path``'s shape; returns it."""
    from safetensors.torch import save_file

    from hybridllm.loading.random_checkpoint import RandomCheckpoint

    checkpoint = RandomCheckpoint(config_path, dtype, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_path, folder / "config.json")
    tensors = {name: checkpoint.tensor(name).contiguous() for name in checkpoint.parameter_names()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, checkpoint.config.vocab_size)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a Hugging Face config.json (e.g. configs/llama-3.2-1b.json)")
    parser.add_argument("folder", type=Path, help="where to write the model folder")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the stored tensors")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    if not args.config.is_file():
        parser.error(f"no such config file: {args.config}")
    print(f"wrote {write_folder(args.config, args.folder, args.dtype, args.seed)}")


if __name__ == "__main__":
    main()
