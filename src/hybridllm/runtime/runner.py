"""The model runner: forwards of a placed model through its backend.

    runner = build_runner(model, placement, devices, backend="auto")
    logits = runner.step(ForwardBatch([ForwardRow(cache, ids, cache.seq_length), ...]))  # per row
    logits = runner(input_ids, cache, start_pos)   # one (B, T) block: (B, T or 1, vocab) float32
    runner.hop_bytes                               # hidden-state bytes moved between tiers so far

The runner owns what the model does not know: the placed model (the tier of each piece, from a
:class:`~hybridllm.placement.placement.Placement`, and the hop counter:
:class:`~hybridllm.runtime.placed_model.PlacedModel`) and the backend (chosen once, here), whose
``step(batch)`` runs every forward: rows of any length, each continuing its own cache (a decode
step's one token, a prefill chunk, several generated tokens to verify). It also says where a
longrope model's rotation changes with a sequence's length (:meth:`ModelRunner.rotates_long`),
so that the request loop can re-encode a cache that crosses it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from hybridllm.config import ModelConfig
from hybridllm.kernels.build import KernelBuildError
from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends import AUTO, BackendReport, DecodeBackend, backend_class, check_backend_name
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow
from hybridllm.runtime.placed_model import PlacedModel, Segment

logger = logging.getLogger(__name__)


@dataclass
class RunnerReport:
    """What :func:`build_runner` chose and built; ``seconds`` belongs in the cold-start figures.

    Attributes:
        backend: the decode backend chosen ("eager", "compiled", "native", ...).
        requested: the backend asked for ("auto" or a name).
        seconds: building the backend.
        build: the backend's own report (kernel layers, head, whole step, copies, skipped).
        notes: why the choice differs from the request, and the backend's notes.
    """

    backend: str
    requested: str
    seconds: float = 0.0
    build: BackendReport = field(default_factory=BackendReport)
    notes: list[str] = field(default_factory=list)


class ModelRunner:
    """Runs a placed model's forwards through its backend.

    Args:
        placed: the model with its placement and tier devices.
        backend: the backend built for ``placed``.
        report: what the build chose.
    """

    def __init__(self, placed: PlacedModel, backend: DecodeBackend, report: RunnerReport | None = None) -> None:
        self.placed = placed
        self.model: LlamaForCausalLM = placed.model
        self.config: ModelConfig = placed.config
        self.placement: Placement = placed.placement
        self.devices: TierDevices = placed.devices
        self.segments: list[Segment] = placed.segments
        self.backend = backend
        self.report = report or RunnerReport(backend.name, backend.name)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.compute_dtype

    @property
    def hop_bytes(self) -> int:
        """Hidden-state bytes moved between tiers by every forward so far."""
        return self.placed.hop_bytes

    @hop_bytes.setter
    def hop_bytes(self, value: int) -> None:
        self.placed.hop_bytes = value

    def step(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """Run every row of ``batch`` (each starting where its cache ends) and return each row's
        float32 logits (len(tokens) if ``all_logits`` else 1, vocab), on the head's device, in order."""
        batch.check_positions()
        return self.backend.step(batch)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | BatchedCaches, start_pos: int | torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """Run ``input_ids`` (B, T) at positions ``start_pos..start_pos+T-1``: row i continues
        ``cache`` (B = 1) or ``cache.caches[i]`` (a ``BatchedCaches``). One row, or one token per
        row, is a step of B rows; B > 1 rows of T > 1 tokens are one batched walk through the
        layers (the batched PyTorch prefill tools and tests measure each KV strategy's own
        attention with).

        Args:
            start_pos: an int shared by the batch, or a (B,) tensor with one start per row.
            all_logits: logits of every position, else of the last one only.
        Returns:
            float32 logits (B, T or 1, vocab) on the head's device.
        """
        caches = cache.caches if isinstance(cache, BatchedCaches) else [cache]
        if len(caches) != input_ids.shape[0]:
            raise ValueError(f"{input_ids.shape[0]} rows of ids for {len(caches)} caches")
        if len(caches) > 1 and input_ids.shape[1] > 1:
            return self.placed.walk(input_ids, cache, start_pos, all_logits, self.backend)
        starts = start_pos.tolist() if isinstance(start_pos, torch.Tensor) else [start_pos] * len(caches)
        ids = input_ids.tolist()
        rows = [ForwardRow(c, ids[i], int(starts[i]), all_logits) for i, c in enumerate(caches)]
        logits = self.step(ForwardBatch(rows))
        return logits[0][None] if len(logits) == 1 else torch.stack(logits)

    __call__ = forward

    # ---- longrope (Phi-3 128K) ------------------------------------------------------------------
    def rotates_long(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens rotates with longrope's long factors."""
        switch = self.model.rope_switch_length
        return switch is not None and length > switch

    def rope_switch_room(self, length: int) -> int | None:
        """How many more tokens a sequence of ``length`` tokens rotating with longrope's short
        factors takes before it switches to the long ones (None: no switch ahead)."""
        switch = self.model.rope_switch_length
        return None if switch is None or length > switch else switch - length

    def crosses_rope_switch(self, cached: int, n_new: int) -> bool:
        """Whether ``n_new`` more tokens take a sequence of ``cached`` tokens, whose keys rotate with
        longrope's short factors, past the switch (its cache must then be re-encoded)."""
        return 0 < cached and not self.rotates_long(cached) and self.rotates_long(cached + n_new)


def choose_backend(backend: str, placement: Placement, devices: TierDevices) -> str:
    """The backend a runner gets: the name asked for, or for "auto" native when any layer or the
    head computes on the CPU, else eager (before knowing whether the native kernels build)."""
    if backend != AUTO:
        return backend
    computing = [*placement.layer_tiers, placement.head_tier]  # the pieces a decode step computes on
    return "native" if any(devices.of(tier).type == "cpu" for tier in computing) else "eager"


def build_runner(model: LlamaForCausalLM, placement: Placement, devices: TierDevices,
                 backend: str = AUTO) -> ModelRunner:
    """The runner of ``model`` placed by ``placement``, with its decode backend built.

    Args:
        model: the loaded model (weights on their tiers' devices).
        placement: the tier of each piece.
        devices: the real device of each tier.
        backend: "auto" (native when any layer or the head is on the CPU and the kernels build,
            else eager), or a registered name ("eager", "compiled", "native"). Where the native
            kernels cannot be built, a warning is logged and the eager backend runs.
    Raises:
        ConfigError: an unknown backend name.
    """
    check_backend_name(backend)
    t0 = time.perf_counter()
    placed = PlacedModel(model, placement, devices)
    chosen = choose_backend(backend, placement, devices)
    notes: list[str] = []
    try:
        built = backend_class(chosen)(placed)
    except KernelBuildError as exc:
        logger.warning("native kernels unavailable, using PyTorch decode and prefill steps: %s", exc)
        notes.append(f"native decode unavailable: {exc}")
        chosen = "eager"
        built = backend_class(chosen)(placed)
    built.check_placement(placement)
    report = RunnerReport(chosen, backend, time.perf_counter() - t0, built.report, notes + built.report.notes)
    return ModelRunner(placed, built, report)
