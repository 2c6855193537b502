"""Models of any published shape with random weights, for our engine and for transformers.

Both draw their tensors from :class:`hybridllm.loading.random_checkpoint.RandomCheckpoint`, so
the transformers baseline gets exactly the weights our engine runs.

    llm = random_llm("configs/llama-3.2-1b.json", dtype="bfloat16", threads=2)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridllm.errors import ModelLoadError
from hybridllm.llm import LLM
from hybridllm.loading.random_checkpoint import RandomCheckpoint


def random_llm(config_path: str | os.PathLike, seed: int = 0, **llm_options: Any) -> LLM:
    """An ``LLM`` of the shape ``config_path`` describes, with random weights.

    ``llm_options`` are ``LLM``'s keyword arguments (device, dtype, threads, KV options ...);
    the weights are drawn in its compute dtype.
    """
    checkpoint = RandomCheckpoint(config_path, llm_options.get("dtype", "float32"), seed)
    return LLM(model=checkpoint, show_progress=False, **llm_options)


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
