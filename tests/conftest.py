"""Shared fixtures: tiny random models (HF folder + GGUF) and the default model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_hf_model, save_as_gguf  # noqa: E402

ARCHS = ("llama", "llama3", "qwen2", "mistral")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, Path, torch.nn.Module]]:
    """arch -> (HF folder, GGUF file, the transformers model) for every tiny architecture."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        folder = root / arch
        model = build_hf_model(folder, arch)
        out[arch] = (folder, save_as_gguf(folder, root / f"{arch}.gguf"), model)
    return out


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from hybridllm.loading.registry import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def default_llm():
    """The default model dequantized to float32 on the CPU (the golden reference: transformers
    runs the same file in float32), loaded once for the session."""
    from hybridllm import LLM

    return LLM(weights="float")
