"""The model runner: one forward of a placed model, tier by tier, through its decode backend.

    runner = build_runner(model, placement, devices, backend="auto")
    logits = runner(input_ids, cache, start_pos)   # (B, 1, vocab) float32
    runner.hop_bytes                               # hidden-state bytes moved between tiers so far

The runner owns what the model does not know: the tier of each piece (embedding, every layer,
final norm and head; from a :class:`~hybridllm.placement.placement.Placement`), the decode
backend (chosen once, here) and the hop counter. It walks the placement's segments (contiguous
runs of layers on one tier and device), moves the hidden states at segment boundaries and
counts their bytes where the tier changes, even when the CPU plays the device (tiers are
logical; the figures are the ones a real device would show).

Prefill chunks (T > 1) go to the backend's whole-chunk call where it has one that applies (the
native backend), else through the model's own layer code; decode steps (T == 1) go through the
backend: a whole-token call where it has one that applies, else layer by layer. Chunks of several
sequences can go together (:meth:`ModelRunner.prefill_chunks`) where the backend takes them in one call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridllm.config import ModelConfig
from hybridllm.kernels.build import KernelBuildError
from hybridllm.kvcache.base import KVCache
from hybridllm.models.llama import DecoderLayer, LlamaForCausalLM
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends import AUTO, BackendReport, DecodeBackend, backend_class, check_backend_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """Contiguous layers on one tier and one device."""

    tier: str
    device: torch.device
    layers: tuple[DecoderLayer, ...]


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
    """Runs a placed model: segments by tier, hidden-state hops counted, decode steps via a backend.

    Args:
        model: the model (weights already on their tiers' devices).
        placement: the tier of each piece.
        devices: the real device of each tier.
        backend: the decode backend built for ``model``.
        report: what the build chose.
    """

    def __init__(self, model: LlamaForCausalLM, placement: Placement, devices: TierDevices,
                 backend: DecodeBackend, report: RunnerReport | None = None) -> None:
        placement.check_layer_count(model.config.n_layers)
        self.model = model
        self.config: ModelConfig = model.config
        self.placement = placement
        self.devices = devices
        self.backend = backend
        self.report = report or RunnerReport(backend.name, backend.name)
        self.hop_bytes = 0
        self.segments = _segments(model, placement)
        body = [placement.embed_tier, *placement.layer_tiers]  # every position crosses these changes
        self._body_changes = sum(a != b for a, b in zip(body, body[1:]))
        self._head_changes = int(body[-1] != placement.head_tier)  # only the positions whose logits are wanted

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.compute_dtype

    def forward(self, input_ids: torch.Tensor, cache: KVCache, start_pos: int | torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """Run ``input_ids`` (B, T) at positions ``start_pos..start_pos+T-1``.

        Args:
            input_ids: (B, T) token ids (any device: they go to the embedding's).
            cache: a ``KVCache`` or a ``kvcache.batch.BatchedCaches``.
            start_pos: an int shared by the batch, or a (B,) tensor with one start per row.
            all_logits: logits of every position, else of the last one only.
        Returns:
            float32 logits (B, T or 1, vocab) on the head's device.
        """
        model, backend = self.model, self.backend
        seq = input_ids.shape[1]
        decode = seq == 1
        with backend.glue():
            x = model.embed(input_ids)  # (B, T, hidden)
            tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            tables[x.device] = model.rotary_tables(start_pos, seq, x.dtype, x.device)
        if decode:
            logits = backend.token_step(input_ids, x, *tables[x.device], cache)
        else:
            logits = backend.prefill_step(input_ids, x, *tables[x.device], cache, all_logits)
        if logits is not None:  # the whole forward in one call: the hops it made are the placement's
            position_bytes = x.shape[-1] * x.element_size() * x.shape[0]
            self.hop_bytes += position_bytes * (self._body_changes * seq + self._head_changes * logits.shape[1])
            return logits
        tier = self.placement.embed_tier
        for segment in self.segments:
            x = self._hop(x, segment.device, tier != segment.tier)
            tier = segment.tier
            if segment.device not in tables:
                tables[segment.device] = model.rotary_tables(start_pos, seq, x.dtype, segment.device)
            cos, sin = tables[segment.device]
            for layer in segment.layers:
                x = backend.layer_step(layer, x, cos, sin, cache) if decode else layer(x, cos, sin, cache)
        if not all_logits:
            x = x[:, -1:, :]
        x = self._hop(x, model.model.norm.weight.device, tier != self.placement.head_tier)
        x = model.final_norm(x)
        x = self._hop(x, model.lm_head.weight.device, False)  # the norm and the head share a tier
        return backend.head(x)

    __call__ = forward

    def prefill_chunks(self, chunks: Sequence[tuple[Sequence[int], KVCache]]) -> list[torch.Tensor] | None:
        """Prefill chunks of several sequences in one forward, where the backend can (the native
        backend, every cache writable in place): ``chunks`` are (token ids, cache) pairs of at
        least two tokens each (one token is a decode step, another kernel), the ids continuing
        each cache at its length. Returns each chunk's last-position logits (1, 1, vocab) float32,
        or None, with nothing run (then forward each chunk alone). Each chunk's logits and KV are
        bitwise its forward's alone."""
        if self.model.rope_switch_length is not None:  # longrope picks its factors per sequence length
            return None
        if any(len(tokens) < 2 for tokens, _ in chunks):
            return None
        model, backend = self.model, self.backend
        lengths = [len(tokens) for tokens, _ in chunks]
        caches = [cache for _, cache in chunks]
        ids = torch.tensor([[t for tokens, _ in chunks for t in tokens]], dtype=torch.long)  # (1, rows)
        positions = torch.cat([torch.arange(cache.seq_length, cache.seq_length + n) for n, cache in zip(lengths, caches)])
        with backend.glue():
            x = model.embed(ids)  # (1, rows, hidden)
            cos, sin = model.rotary_tables(positions, 1, x.dtype, x.device)  # (rows, 1, 1, D): each row's position
        logits = backend.chunks_step(x, cos, sin, caches, lengths)  # (chunks, vocab)
        if logits is None:
            return None
        position_bytes = x.shape[-1] * x.element_size()
        self.hop_bytes += position_bytes * (self._body_changes * ids.shape[1] + self._head_changes * len(chunks))
        return [logits[i][None, None] for i in range(len(chunks))]

    def _hop(self, x: torch.Tensor, device: torch.device, crosses_tiers: bool) -> torch.Tensor:
        """``x`` on ``device``; its bytes count as moved when it changes device or tier."""
        if crosses_tiers or x.device != device:
            self.hop_bytes += x.numel() * x.element_size()
        return x if x.device == device else x.to(device)


def _segments(model: LlamaForCausalLM, placement: Placement) -> list[Segment]:
    """The layers grouped into runs of one tier and one device, in order."""
    runs: list[tuple[str, torch.device, list[DecoderLayer]]] = []
    for layer, tier in zip(model.layers, placement.layer_tiers):
        if runs and runs[-1][0] == tier and runs[-1][1] == layer.device:
            runs[-1][2].append(layer)
        else:
            runs.append((tier, layer.device, [layer]))
    return [Segment(tier, device, tuple(layers)) for tier, device, layers in runs]


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
    chosen = choose_backend(backend, placement, devices)
    notes: list[str] = []
    try:
        built = backend_class(chosen)(model)
    except KernelBuildError as exc:
        logger.warning("native kernels unavailable, using PyTorch decode and prefill steps: %s", exc)
        notes.append(f"native decode unavailable: {exc}")
        chosen = "eager"
        built = backend_class(chosen)(model)
    built.check_placement(placement)
    report = RunnerReport(chosen, backend, time.perf_counter() - t0, built.report, notes + built.report.notes)
    return ModelRunner(model, placement, devices, built, report)
