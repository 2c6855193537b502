"""Hugging Face ``config.json`` files -> their dictionary and our ``ModelConfig``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from hybridllm.config import ModelConfig
from hybridllm.errors import ModelLoadError


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The dictionary of a Hugging Face ``config.json``.

    Raises:
        ModelLoadError: the file is missing, not JSON, or not one JSON object.
    """
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
    """The ``ModelConfig`` of a Hugging Face ``config.json``, named after the file.

    Raises:
        ModelLoadError: as :func:`read_hf_config`, or a required key is missing.
    """
    raw = read_hf_config(path)
    try:
        config = ModelConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: config.json lacks {exc}") from None
    return dataclasses.replace(config, name=raw.get("_name_or_path") or Path(path).stem)
