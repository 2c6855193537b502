"""The eager backend: every forward runs the model's own PyTorch layer code.

Its :meth:`EagerBackend.step` is also what every other backend does with the rows its own
kernels do not take: the one-token rows go in one (B, 1) forward (projections and MLPs batched,
attention per row through a :class:`~hybridllm.kvcache.batch.BatchedCaches`), every longer row in
a forward of its own (a prefill chunk, or several generated tokens), so that no row's arithmetic
depends on another row's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import DecoderLayer
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends.base import BackendReport
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow, one_token_inputs
from hybridllm.runtime.placed_model import PlacedModel


class EagerBackend:
    """Forwards in plain PyTorch (the reference every other backend is tested against)."""

    name = "eager"
    compiles_lazily = False

    def __init__(self, placed: PlacedModel) -> None:
        self.placed = placed
        self.model = placed.model
        self.report = BackendReport()

    def step(self, batch: ForwardBatch) -> list[torch.Tensor]:
        return self.walk_rows(batch.rows)

    def walk_rows(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
        """``rows`` through the placed model's layers: every one-token row in one (B, 1) forward,
        every other row alone; each row's logits (n_logits, vocab) in order."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        singles = [i for i, row in enumerate(rows) if row.n_tokens == 1]
        if singles:
            ids, cache, start = one_token_inputs([rows[i] for i in singles])
            logits = self.placed.walk(ids, cache, start, False, self)  # (B, 1, vocab)
            for j, i in enumerate(singles):
                out[i] = logits[j]
        for i, row in enumerate(rows):
            if out[i] is None:
                ids = torch.tensor([list(row.token_ids)], dtype=torch.long)  # (1, T)
                out[i] = self.placed.walk(ids, row.cache, row.start, row.all_logits, self)[0]  # (T or 1, vocab)
        return out

    # ---- the walk's hooks ------------------------------------------------------------------
    def glue(self) -> AbstractContextManager:
        """The scope of the PyTorch ops around a step (embedding lookup, rotary tables)."""
        return nullcontext()

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | BatchedCaches) -> torch.Tensor:
        """One layer of a one-token forward: x (B, 1, hidden) -> (B, 1, hidden)."""
        return layer(x, cos, sin, cache)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, vocab) of normed hidden states (B, T, hidden)."""
        return self.model.head(x)

    # ---- build time ------------------------------------------------------------------------
    def check_placement(self, placement: Placement) -> None:
        return None  # the model's own layers serve every placement

    def new_cache(self, spec: KVSpec, ledger: MemoryLedger) -> KVCache | None:
        return None
