"""The decode backend contract: how a decode step (one token per sequence) runs.

The runner (:class:`hybridllm.runtime.runner.ModelRunner`) walks the layers tier by tier and
hands every decode step's layers, and every forward's head, to its backend; a backend may also
run a whole prefill chunk. A backend is built once for a model (at build time, not per step)
and never changes what the model computes; it may hold weights in the layout its kernels read
(the native backend keeps host int4 layers as its kernels' blocks: their one copy).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.models.llama import DecoderLayer
from hybridllm.placement.placement import Placement


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
    """Runs the decode steps of one model.

    Attributes:
        name: the registry name ("eager", "compiled", "native", ...).
        report: what building it did.
        compiles_lazily: its first steps compile (the build runs a warm-up step so that
            compiling lands in the cold start, not in the first request's TTFT).
    """

    name: str
    report: BackendReport
    compiles_lazily: bool

    def token_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor | None:
        """Logits (1, 1, vocab) of a whole decode step in one call, or None (no such step, or it
        does not apply here): the runner then walks the layers. ``x``: the embedding (B, 1, hidden)."""
        ...

    def prefill_step(self, input_ids: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: KVCache, all_logits: bool) -> torch.Tensor | None:
        """Logits (1, T or 1, vocab) of a whole prefill chunk (T > 1 tokens of one sequence) in
        one call, or None: the runner then runs the model's own layers. ``x``: the embedding
        (1, T, hidden); ``all_logits``: every position's logits, else the last one's."""
        ...

    def chunks_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                    lengths: list[int]) -> torch.Tensor | None:
        """Last-position logits (chunks, vocab) of prefill chunks of several sequences in one
        call, or None (no such step, or it does not apply): the runner then runs each chunk
        alone. ``x``: the chunks' embeddings packed (1, rows, hidden), chunk i ``lengths[i]`` rows
        continuing ``caches[i]``; ``cos``/``sin``: each row's rotary table (rows, 1, 1, D)."""
        ...

    def glue(self) -> AbstractContextManager:
        """The scope of the PyTorch ops around a step (embedding lookup, rotary tables): the
        native backend runs them on one thread, so that PyTorch's OpenMP workers, which spin
        for a while after a parallel op, do not sit on the cores its own thread team is about to use."""
        ...

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        """One layer of a decode step: x (B, 1, hidden) -> (B, 1, hidden)."""
        ...

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (B, T, vocab) of normed hidden states (B, T, hidden) (every forward)."""
        ...

    def check_placement(self, placement: Placement) -> None:
        """Raise ConfigError (one line: what it supports) when the backend cannot serve ``placement``."""
        ...

    def new_cache(self, spec: KVSpec, ledger: MemoryLedger) -> KVCache | None:
        """A sequence's KV cache when the backend's step needs its own (static buffers), else None:
        the KV policy's cache (``kvcache.factory.create_cache``)."""
        ...
