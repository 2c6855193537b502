"""Models of any published shape with random weights: speed and memory at real sizes, no download.

``RandomCheckpoint`` has the interface of our checkpoints (``config``, ``parameter_names``,
``read`` ...), so the ordinary loader builds the model from it. Each tensor is generated once,
directly in the compute dtype (nothing is allocated twice), and deterministically from the
seed and its name: the transformers baseline gets exactly the same weights.

    llm = random_llm("configs/llama-3.2-1b.json", dtype="bfloat16", threads=2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from hybridllm.config import ModelConfig, parse_dtype
from hybridllm.errors import ConfigError, ModelLoadError


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The dictionary of a Hugging Face ``config.json``, with clear errors."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelLoadError(f"model config not found: {file}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: a config.json holds one JSON object")
    return data


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json``, named after the file."""
    raw = read_hf_config(path)
    try:
        config = ModelConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: config.json lacks {exc}") from None
    return dataclasses.replace(config, name=raw.get("_name_or_path") or Path(path).stem)


class SyntheticTokenizer:
    """Stands in for a tokenizer on models that have none: bytes as ids, no text out.

    Benchmarks give token ids, so only the generator's needs are met: no end-of-sequence ids,
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
        return [b % self._vocab_size for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def stream_decoder(self, skip_special_tokens: bool = True) -> _SilentDecoder:
        return _SilentDecoder()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **_: Any) -> str:
        raise ConfigError("a model with random weights has no chat template")


class _SilentDecoder:
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
    """

    file_format = "random"

    def __init__(self, config_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, seed: int = 0) -> None:
        from hybridllm.models.llama import LlamaForCausalLM

        self.path = Path(config_path).expanduser()
        self.raw_config = read_hf_config(self.path)
        self.config = read_config(self.path)
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self.std = float(self.raw_config.get("initializer_range", 0.02))
        with torch.device("meta"):
            meta = LlamaForCausalLM(self.config)
        self._shapes = meta.checkpoint_shapes()  # the checkpoint (Hugging Face) names
        if self.config.tie_word_embeddings:
            self._shapes.pop("lm_head.weight", None)

    def parameter_names(self) -> dict[str, str]:
        return {name: name for name in self._shapes}

    def nbytes(self, name: str) -> int:
        numel = 1
        for dim in self._shapes[name]:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

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
        return raw

    def tokenizer(self) -> SyntheticTokenizer:
        return SyntheticTokenizer(self.config.vocab_size)


@contextmanager
def _opening(checkpoint: RandomCheckpoint) -> Iterator[None]:
    """Make ``LLM`` open ``checkpoint`` whatever path it is given (this process only)."""
    import hybridllm.llm as llm_module

    if not hasattr(llm_module, "open_checkpoint"):
        raise RuntimeError("hybridllm.llm no longer opens checkpoints through open_checkpoint; update random_llm")
    with mock.patch.object(llm_module, "open_checkpoint", lambda _model: checkpoint):
        yield


def random_llm(config_path: str | os.PathLike, seed: int = 0, **llm_options: Any):
    """An ``LLM`` of the shape ``config_path`` describes, with random weights.

    ``llm_options`` are ``LLM``'s keyword arguments (device, dtype, threads, KV options ...).
    """
    from hybridllm.llm import LLM

    checkpoint = RandomCheckpoint(config_path, llm_options.get("dtype", "float32"), seed)
    with _opening(checkpoint):
        return LLM(model=str(checkpoint.path), show_progress=False, **llm_options)


def random_hf_model(config_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, seed: int = 0,
                    device: str = "cpu"):
    """The transformers model of ``config_path`` with the very weights ``RandomCheckpoint`` draws."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = RandomCheckpoint(config_path, dtype, seed)
    raw = dict(checkpoint.raw_config)
    model_type = raw.pop("model_type", "llama")
    hf_config = AutoConfig.for_model(model_type, **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=checkpoint.dtype)
    state = {name: checkpoint.tensor(name).to(device) for name in checkpoint.parameter_names()}
    model.load_state_dict(state, strict=False, assign=True)
    if checkpoint.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for parent in list(model.modules()):  # rotary tables were built on the meta device: rebuild them
        for child_name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)) and "rotary" in type(child).__name__.lower():
                with torch.device(device):
                    setattr(parent, child_name, type(child)(config=hf_config))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ModelLoadError(f"transformers model of {config_path}: tensors left unset, e.g. {left[0]}")
    return model.eval()
