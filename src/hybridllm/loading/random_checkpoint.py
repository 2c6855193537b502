"""A checkpoint of any published shape with random weights: speed and memory at real sizes, no download.

``RandomCheckpoint`` implements :class:`hybridllm.loading.checkpoint.Checkpoint`, so the
ordinary loaders build the model from it. Each tensor is generated once, directly in the
requested dtype (use the compute dtype: nothing is allocated twice), and deterministically from
the seed and its name, so another framework can be given exactly the same weights.

    checkpoint = RandomCheckpoint("configs/llama-3.2-1b.json", dtype="bfloat16")
    llm = LLM(model=checkpoint, dtype="bfloat16")
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridllm.config import ModelConfig, parse_dtype
from hybridllm.errors import ConfigError
from hybridllm.loading.hf_config import read_config, read_hf_config
from hybridllm.models.llama import LlamaForCausalLM


class SyntheticTokenizer:
    """Stands in for a tokenizer on models that have none: bytes as ids, no text out.

    Benchmarks give token ids, so only the engine's needs are met: no end-of-sequence ids,
    and a stream decoder that yields no text.
    """

    has_chat_template = False
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset()
        self.bos_token_id = None
        self.eos_token_id = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes, each taken modulo the vocabulary size."""
        return [b % self._vocab_size for b in text.encode()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Always "": random weights have no text."""
        return ""

    def stream_decoder(self, skip_special_tokens: bool = True) -> SilentDecoder:
        return SilentDecoder()

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            **_: Any) -> str:
        raise ConfigError("a model with random weights has no chat template")


class SilentDecoder:
    """The stream decoder of :class:`SyntheticTokenizer`: every token decodes to no text."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class RandomCheckpoint:
    """A checkpoint whose tensors are drawn at random when read.

    Args:
        config_path: a Hugging Face ``config.json`` (e.g. ``configs/llama-3.2-1b.json``).
        dtype: dtype the tensors are generated in (use the compute dtype: no conversion copy).
        seed: base seed; each tensor's stream is derived from it and the tensor's name.

    Raises:
        ModelLoadError: the config file is missing or not a usable ``config.json``.
    """

    file_format = "random"

    def __init__(self, config_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, seed: int = 0) -> None:
        path = Path(config_path).expanduser()
        raw = read_hf_config(path)
        self._setup(path, read_config(path), raw, float(raw.get("initializer_range", 0.02)), dtype, seed)

    @classmethod
    def of_config(cls, config: ModelConfig, dtype: torch.dtype | str = torch.float32, seed: int = 0,
                  std: float = 0.02) -> RandomCheckpoint:
        """Random weights of a ``ModelConfig`` built in code (no file; the path is its name)."""
        checkpoint = cls.__new__(cls)
        checkpoint._setup(Path(config.name or "random"), config, {}, std, dtype, seed)
        return checkpoint

    def _setup(self, path: Path, config: ModelConfig, raw_config: dict[str, Any], std: float,
               dtype: torch.dtype | str, seed: int) -> None:
        self.path = path
        self.config = config
        self.raw_config = raw_config  # the config.json's dictionary ({} for a config built in code)
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self.std = std
        with torch.device("meta"):  # shapes only: no memory
            meta = LlamaForCausalLM(self.config)
        self._shapes = meta.checkpoint_shapes()  # the checkpoint (Hugging Face) names
        if self.config.tie_word_embeddings:
            self._shapes.pop("lm_head.weight", None)

    def parameter_names(self) -> dict[str, str]:
        return {name: name for name in self._shapes}

    def nbytes(self, name: str) -> int:
        return math.prod(self._shapes[name]) * self.dtype.itemsize

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``: ones for norms, zeros for biases, N(0, initializer_range) otherwise."""
        shape = self._shapes[name]
        if "norm" in name:
            return torch.ones(shape, dtype=self.dtype)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape, dtype=self.dtype).normal_(0.0, self.std, generator=generator)

    def read(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def dequantize(self, name: str, raw: torch.Tensor) -> torch.Tensor:
        """Random tensors are generated as floats: nothing to dequantize."""
        return raw

    def tokenizer(self) -> SyntheticTokenizer:
        return SyntheticTokenizer(self.config.vocab_size)
