"""``hybridllm quantize``: write a Q4_0 / Q4_1 / Q8_0 GGUF file from a float checkpoint.

The source is a Hugging Face folder or a float GGUF file (F32/F16/BF16 tensors). The output
follows llama.cpp's conventions (``gguf_writer.write_gguf``: metadata, tokenizer, permuted Q/K
rows), so llama.cpp reads it; our loader keeps its 4/8-bit matrices quantized
(``--weights auto``). Norms and biases stay F32; the token embedding and the output head are
Q8_0 in the 4-bit types (they cost little and matter most), as in the default model's file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from hybridllm.errors import ConfigError
from hybridllm.loading.gguf_vocab import check_pre_tokenizer, tokenizer_metadata_from_hf
from hybridllm.loading.gguf_writer import default_tensor_type, write_gguf
from hybridllm.loading.registry import open_checkpoint

OUTPUT_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}
FLOAT_SOURCE_TYPES = ("F32", "F16", "BF16")
_VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


class _LazyTensors(Mapping):
    """The checkpoint's float tensors by Hugging Face name, read one at a time while writing."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint = checkpoint
        self.names = {hf: file for file, hf in checkpoint.parameter_names().items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        file_name = self.names[name]
        return self.checkpoint.dequantize(file_name, self.checkpoint.read(file_name)).float()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _tokenizer_metadata(checkpoint, pre: str | None) -> dict[str, object]:
    if getattr(checkpoint, "file_format", None) != "gguf":
        return tokenizer_metadata_from_hf(checkpoint.path, checkpoint.config.vocab_size, pre)
    meta = {k: v for k, v in checkpoint.metadata.items() if k.startswith("tokenizer.")}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = check_pre_tokenizer(pre)
    return meta


def quantize_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, qtype: str, pre: str | None = None
) -> Path:
    """Write ``src`` (Hugging Face folder or float GGUF) to ``dst`` as a ``qtype`` GGUF file.

    Args:
        src: the float checkpoint.
        dst: the output ``.gguf`` path (its folder must exist).
        qtype: "q4_0", "q4_1" or "q8_0" (case-insensitive).
        pre: ``tokenizer.ggml.pre`` to write instead of the one detected from ``tokenizer.json``
            (or kept from a GGUF source).

    Raises:
        ConfigError: unknown type or pre-tokenizer, quantized source, or ``dst`` equal to ``src``.
        ModelLoadError: ``src`` cannot be read.
    """
    key = qtype.lower()
    if key not in OUTPUT_TYPES:
        raise ConfigError(f"unknown quantization type {qtype!r}; choose one of {', '.join(OUTPUT_TYPES)}")
    weight_type = OUTPUT_TYPES[key]
    src_path, dst_path = Path(src).expanduser(), Path(dst).expanduser()
    if dst_path.exists() and src_path.exists() and dst_path.resolve() == src_path.resolve():
        raise ConfigError("the output file is the source file; choose another path")
    if not dst_path.parent.is_dir():
        raise ConfigError(f"output folder {dst_path.parent} does not exist")
    checkpoint = open_checkpoint(src_path)
    if getattr(checkpoint, "file_format", None) == "gguf":
        quantized = sorted({info.type_name for info in checkpoint.tensors.values()} - set(FLOAT_SOURCE_TYPES))
        if quantized:
            raise ConfigError(
                f"{src_path} is already quantized ({', '.join(quantized)}); quantize from a float GGUF file "
                f"or a Hugging Face folder"
            )

    def type_for(name: str, tensor: torch.Tensor) -> str:
        if weight_type != "Q8_0" and name in _VOCAB_TABLES and tensor.ndim == 2 and tensor.shape[-1] % 32 == 0:
            return "Q8_0"
        return default_tensor_type(name, tensor, weight_type)

    tmp = dst_path.with_name(dst_path.name + ".partial")
    try:
        write_gguf(tmp, checkpoint.config, _LazyTensors(checkpoint), _tokenizer_metadata(checkpoint, pre), weight_type,
                   type_for)
        tmp.replace(dst_path)
    finally:
        tmp.unlink(missing_ok=True)
    return dst_path
