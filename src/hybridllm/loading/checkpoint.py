"""What a checkpoint is: the members the loaders, the quantizer and ``LLM`` read.

Three sources implement it: ``GGUFCheckpoint`` (a GGUF file), ``HFCheckpoint`` (a Hugging Face
folder of safetensors) and ``RandomCheckpoint`` (a ``config.json``'s shape with random weights).
``open_checkpoint`` returns one; anything that has these members can be passed where a model
path is taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from hybridllm.config import ModelConfig


@runtime_checkable
class Checkpoint(Protocol):
    """A source of named weight tensors, the model's configuration and its tokenizer.

    Attributes:
        file_format: "gguf", "safetensors" or "random"; GGUF checkpoints also expose their
            ``tensors`` records and ``metadata``, which the quantized loader reads.
        path: where it was read from (its name labels progress bars and errors).
        config: the model's architecture numbers.
    """

    file_format: str
    path: Path
    config: ModelConfig

    def parameter_names(self) -> dict[str, str]:
        """Tensor name in the checkpoint -> Hugging Face parameter name, for every model weight."""
        ...

    def nbytes(self, name: str) -> int:
        """Bytes the tensor ``name`` takes in the checkpoint."""
        ...

    def read(self, name: str) -> Any:
        """The tensor's stored data in RAM (raw GGUF bytes, or a tensor): where the disk is read."""
        ...

    def dequantize(self, name: str, raw: Any) -> torch.Tensor:
        """The float tensor of ``read(name)``'s data, in the Hugging Face layout."""
        ...

    def tokenizer(self) -> Any:
        """A ``Tokenizer`` (or a stand-in with the members the engine calls)."""
        ...
