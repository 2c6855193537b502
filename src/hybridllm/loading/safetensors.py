"""Hugging Face checkpoint folders: ``config.json``, ``*.safetensors`` (memory-mapped), tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hybridllm.config import ModelConfig
from hybridllm.errors import ModelLoadError
from hybridllm.loading.hf_config import read_hf_config


class HFCheckpoint:
    """A Hugging Face model folder. Tensors are read lazily from memory-mapped safetensors files."""

    file_format = "safetensors"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{self.path}: not a Hugging Face model folder (no config.json)")
        self.raw_config = read_hf_config(config_path)
        self.config = ModelConfig.from_hf_dict(self.raw_config)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.path}: no *.safetensors files (other weight formats are not supported)")
        self._handles = []
        self._where: dict[str, int] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{file}: cannot read safetensors file ({exc})") from None
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = len(self._handles) - 1
        missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(self._where)
        if missing:
            raise ModelLoadError(f"{self.path}: checkpoint lacks {sorted(missing)}; is this a Llama-family model?")

    def parameter_names(self) -> dict[str, str]:
        """Tensor name in the files -> parameter name (identical for Hugging Face checkpoints)."""
        return {name: name for name in self._where if not name.endswith("rotary_emb.inv_freq")}

    def nbytes(self, name: str) -> int:
        handle = self._handles[self._where[name]]
        tensor_slice = handle.get_slice(name)
        numel = 1
        for dim in tensor_slice.get_shape():
            numel *= dim
        return numel * _DTYPE_SIZES.get(tensor_slice.get_dtype(), 4)

    def read(self, name: str) -> torch.Tensor:
        """The tensor in RAM, in the file's dtype."""
        return self._handles[self._where[name]].get_tensor(name)

    def dequantize(self, name: str, raw: torch.Tensor) -> torch.Tensor:
        """Safetensors hold plain float tensors: nothing to dequantize. Gemma checkpoints store
        each norm's w for a scale of 1 + w: the model (and GGUF) hold 1 + w, added in float32."""
        if self.config.family.gemma_layout and name.endswith("norm.weight"):
            return raw.float() + 1.0
        return raw

    def tokenizer(self):
        from hybridllm.loading.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(self.path)


_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
