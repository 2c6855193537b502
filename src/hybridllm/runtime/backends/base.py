"""The backend contract: how a forward of rows of any length runs on one placed model.

The runner (:class:`hybridllm.runtime.runner.ModelRunner`) hands every forward to its backend
as a :class:`~hybridllm.runtime.forward_batch.ForwardBatch`: per row a sequence's cache, its
tokens (one, a prefill chunk, or several generated ones), their start position and whether it
wants every position's logits. ``step(batch)`` is the one entry point: the backend runs the rows
its own kernels take (the native backend: every one-token row in one call, every chunk in
another) and walks the placed model's layers for the rest
(:meth:`~hybridllm.runtime.placed_model.PlacedModel.walk`, with the backend's hooks: ``glue``,
the one-token ``layer_step`` and ``head``). A backend is built once for a placed model (at build
time, not per step) and never changes what the model computes; it may hold weights in the
layout its kernels read (the native backend keeps host weights as its kernels' tiles: their one
copy).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import DecoderLayer
from hybridllm.placement.placement import Placement
from hybridllm.runtime.forward_batch import ForwardBatch


@dataclass
class BackendReport:
    """What building a backend did, for the cold start and the CLI/bench reports.

    Attributes:
        kernel_layers: layers whose decode step runs in the backend's own kernel.
        head: whether the head's one-row product runs in the backend's own kernel.
        whole_step: whether a whole decode step can run in one call.
        build_seconds: compiling the backend's kernels (0: cached or none).
        skipped: pieces that keep the PyTorch step, with why.
        notes: anything else worth a line.
    """

    kernel_layers: int = 0
    head: bool = False
    whole_step: bool = False
    build_seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class DecodeBackend(Protocol):
    """Runs the forwards of one placed model (constructed from a
    :class:`~hybridllm.runtime.placed_model.PlacedModel`).

    Attributes:
        name: the registry name ("eager", "compiled", "native", ...).
        report: what building it did.
        compiles_lazily: its first steps compile (the build runs a warm-up step so that
            compiling lands in the cold start, not in the first request's TTFT).
    """

    name: str
    report: BackendReport
    compiles_lazily: bool

    def step(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """Run every row of ``batch`` (rows of any length, each continuing its own cache) and
        return each row's float32 logits, (len(tokens) if ``all_logits`` else 1, vocab), on the
        head's device, in batch order. Each row's logits and KV are those of its forward alone
        (bitwise where the backend's kernels are batch-invariant: native)."""
        ...

    # the hooks the placed model's layer walk takes from its backend (for the rows ``step`` walks)
    def glue(self) -> AbstractContextManager:
        """The scope of the PyTorch ops around a step (embedding lookup, rotary tables): the
        native backend runs them on one thread, so that PyTorch's OpenMP workers, which spin
        for a while after a parallel op, do not sit on the cores its own thread team is about to use."""
        ...

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | BatchedCaches) -> torch.Tensor:
        """One layer of a one-token forward: x (B, 1, hidden) -> (B, 1, hidden)."""
        ...

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, vocab) of normed hidden states (B, T, hidden) (every walked forward)."""
        ...

    def check_placement(self, placement: Placement) -> None:
        """Raise ConfigError (one line: what it supports) when the backend cannot serve ``placement``."""
        ...

    def new_cache(self, spec: KVSpec, ledger: MemoryLedger) -> KVCache | None:
        """A sequence's KV cache when the backend's step needs its own (static buffers), else None:
        the KV policy's cache (``kvcache.factory.create_cache``)."""
        ...
