"""The models preset's files (hybridllm.bench.model_files): random weights of a published shape,
with the default model's vocabulary, that llama.cpp loads as it loads the real ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridllm.bench.model_files import file_model_name, write_random_gguf
from hybridllm.loading.gguf import GGUFFile

ROOT = Path(__file__).resolve().parent.parent


def tiny_shape_of(config_name: str, folder: Path) -> Path:
    """configs/<config_name>.json shrunk to a few thousand parameters per layer, same family and vocabulary."""
    config = json.loads((ROOT / "configs" / f"{config_name}.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4)
    path = folder / f"{config_name}.json"
    path.write_text(json.dumps(config))
    return path


def test_a_phi3_shaped_file_loads_in_llama_cpp(tmp_path):
    """llama.cpp gives a model *named* phi-3 Phi-3's token attributes, which need tokens ("</s>",
    "<unk>") the default model's vocabulary lacks; the file's name must not claim Phi-3."""
    llama_cpp = pytest.importorskip("llama_cpp")
    config = tiny_shape_of("phi-3-mini-scaled-1.4b", tmp_path)
    path = write_random_gguf(config, tmp_path / "phi3.gguf")
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)  # raised "unordered_map::at" when named phi-3
    assert vocab.n_vocab() == 32064
    name = GGUFFile(path).metadata["general.name"]
    assert name == file_model_name(config) and "phi-3" not in name.lower() and "phi3" not in name.lower()
