"""The compiled backend: ``torch.compile`` of each layer's dense halves for one-token forwards.

A one-token forward of a layer (a decode step) runs as: graph 1 (norm, q/k/v projection, rotary), the cache's
``attend`` (eager: Python bookkeeping, possibly other devices), graph 2 (output projection,
residual, norm, MLP, residual). The two compiled functions are shared by all layers (the layer
is an argument, its weights are graph inputs), so one compilation serves the model; prefill
chunks stay eager. Compilation happens on the first decode steps (``compiles_lazily``: the build runs a warm-up
step so it lands in the cold start).
"""

from __future__ import annotations

import torch

from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import DecoderLayer
from hybridllm.runtime.backends.eager import EagerBackend
from hybridllm.runtime.placed_model import PlacedModel


class CompiledBackend(EagerBackend):
    """Eager, except that a decode step's dense parts run as two compiled graphs per layer."""

    name = "compiled"
    compiles_lazily = True

    def __init__(self, placed: PlacedModel) -> None:
        super().__init__(placed)
        self._before = torch.compile(DecoderLayer.attention_inputs, fullgraph=True)
        self._after = torch.compile(DecoderLayer.attention_outputs, fullgraph=True)
        self.report.notes.append("compiled lazily: the first decode step pays the compile time")

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | BatchedCaches) -> torch.Tensor:
        q, k, v = self._before(layer, x, cos, sin)
        attn = cache.attend(layer.self_attn.layer_idx, q, k, v)  # (B, H, 1, D)
        return self._after(layer, x, attn)
