"""GGUF files of real model shapes with random weights, quantized by llama.cpp's own quantizer.

    f16 = write_random_gguf("configs/qwen2.5-0.5b.json", "qwen-F16.gguf")
    q4km = quantize_with_llama_cpp(f16, "qwen-Q4_K_M.gguf", "Q4_K_M")

Speed does not depend on the weights' values, so these files measure what the published ones
would (the same tensor shapes and, through llama.cpp's quantizer, the same per-tensor type mix of
a Q4_K_M file). Nothing is downloaded: the weights are drawn from a seed
(:class:`~hybridllm.loading.random_checkpoint.RandomCheckpoint`), and the vocabulary is the default
model's byte-level BPE fitted to the config's vocabulary size (padded with unused tokens, or cut
to its first tokens), which both engines load (the prompt ids are the same for both).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from hybridllm.errors import ConfigError
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.gguf_writer import write_gguf
from hybridllm.loading.random_checkpoint import RandomCheckpoint
from hybridllm.loading.registry import default_model_path

# llama.cpp's LLAMA_FTYPE_MOSTLY_* of the file types people download.
LLAMA_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
                    "IQ4_NL": 25, "IQ4_XS": 30}
PAD_TOKEN = "<|unused_{}|>"
NORMAL_TOKEN = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


def vocab_metadata(vocab_size: int) -> dict[str, object]:
    """The default model's ``tokenizer.*`` metadata with ``vocab_size`` tokens: its list padded
    with unused tokens, or cut to its first ``vocab_size`` (byte-level BPE lists tokens in merge
    order: the merges whose parts and result are kept stay, so every text still tokenizes)."""
    source = GGUFFile(default_model_path()).metadata
    meta = {key: value for key, value in source.items() if key.startswith("tokenizer.") and key != "tokenizer.chat_template"}
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if vocab_size < len(tokens):
        tokens, types = tokens[:vocab_size], types[:vocab_size]
        kept = set(tokens)
        merges = [m for m in meta["tokenizer.ggml.merges"]
                  if all(part in kept for part in m.split(" ", 1)) and m.replace(" ", "", 1) in kept]
        meta["tokenizer.ggml.merges"] = merges
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                    "tokenizer.ggml.padding_token_id"):
            if key in meta and meta[key] >= vocab_size:
                raise ConfigError(f"a vocabulary of {vocab_size} tokens leaves out the prompts' special token {key}")
    tokens += [PAD_TOKEN.format(i) for i in range(len(tokens), vocab_size)]
    types += [NORMAL_TOKEN] * (vocab_size - len(types))
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    return meta


class _RandomTensors(Mapping):
    """A checkpoint's tensors drawn one at a time as the writer asks for them (never all at once)."""

    def __init__(self, checkpoint: RandomCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.names = list(checkpoint.parameter_names())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.checkpoint.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def write_random_gguf(config_path: str | os.PathLike, path: str | os.PathLike, weight_type: str = "F16",
                      seed: int = 0) -> Path:
    """A GGUF file of the shape ``config_path`` (a Hugging Face config.json) describes, with
    random weights (norms 1, biases 0), its matrices in ``weight_type``."""
    checkpoint = RandomCheckpoint(config_path, torch.float32, seed)
    return write_gguf(path, dataclasses.replace(checkpoint.config, name=file_model_name(config_path)),
                      _RandomTensors(checkpoint), vocab_metadata(checkpoint.config.vocab_size), weight_type)


def file_model_name(config_path: str | os.PathLike) -> str:
    """The file's ``general.name``: its shape's name, words apart ("phi 3 mini scaled 1.4b").
    llama.cpp gives the tokens of a model *named* phi-3 / phi3 Phi-3's token attributes and stops
    loading when that vocabulary's "</s>" or "<unk>" is missing; these files carry the default
    model's vocabulary, so their name must not claim Phi-3's."""
    return "random weights, " + Path(config_path).stem.replace("-", " ").replace("_", " ")


def quantize_with_llama_cpp(source: str | os.PathLike, path: str | os.PathLike, file_type: str = "Q4_K_M",
                            threads: int | None = None) -> Path:
    """``source`` (a GGUF file) quantized to ``file_type`` by llama.cpp's ``llama_model_quantize``
    (llama-cpp-python): the per-tensor types its own tool chooses."""
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError("quantizing as llama.cpp does needs llama-cpp-python (make test installs it)") from None
    if file_type not in LLAMA_FILE_TYPES:
        raise ConfigError(f"unknown llama.cpp file type {file_type!r}; choose from {', '.join(LLAMA_FILE_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FILE_TYPES[file_type]
    params.nthread = threads or os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise ConfigError(f"llama.cpp could not quantize {source} to {file_type}")
    return Path(path)


def real_shaped_file(config_path: str | os.PathLike, folder: str | os.PathLike, file_type: str = "Q4_K_M",
                     seed: int = 0) -> Path:
    """The ``file_type`` file of ``config_path``'s shape in ``folder`` (written once, then reused:
    the F16 source and the quantized file are named after the config)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = Path(config_path).stem
    target = folder / f"{stem}-{file_type}.gguf"
    if target.exists():
        return target
    source = folder / f"{stem}-F16.gguf"
    if not source.exists():
        write_random_gguf(config_path, source.with_suffix(".partial"), "F16", seed).rename(source)
    quantize_with_llama_cpp(source, target.with_suffix(".partial"), file_type).rename(target)
    return target
