"""The eager backend: every decode step runs the model's own PyTorch layer code."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.models.llama import DecoderLayer, LlamaForCausalLM
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends.base import BackendReport


class EagerBackend:
    """Decode steps in plain PyTorch (the reference every other backend is tested against)."""

    name = "eager"
    compiles_lazily = False

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.report = BackendReport()

    def token_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor | None:
        return None

    def prefill_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: KVCache, all_logits: bool) -> torch.Tensor | None:
        return None

    def chunks_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                    lengths: list[int]) -> torch.Tensor | None:
        return None

    def glue(self) -> AbstractContextManager:
        return nullcontext()

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        return layer(x, cos, sin, cache)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head(x)

    def check_placement(self, placement: Placement) -> None:
        return None  # the model's own layers serve every placement

    def new_cache(self, spec: KVSpec, ledger: MemoryLedger) -> KVCache | None:
        return None
