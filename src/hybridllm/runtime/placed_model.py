"""A model with the tier of each piece: the layer walk every backend can fall back to, and its hops.

    placed = PlacedModel(model, placement, devices)
    logits = placed.walk(input_ids, cache, start_pos, all_logits, hooks)   # hooks: the backend's
    placed.hop_bytes                                                       # hidden-state bytes moved so far

The walk goes through the placement's segments (contiguous runs of layers on one tier and
device), moves the hidden states at segment boundaries and counts their bytes where the tier
changes, even when the CPU plays the device (tiers are logical; the figures are the ones a real
device would show). A backend that runs a whole forward in its own kernel counts the same hops
with :meth:`PlacedModel.count_whole_forward`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridllm.config import ModelConfig
from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.llama import DecoderLayer, LlamaForCausalLM
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement


@dataclass(frozen=True)
class Segment:
    """Contiguous layers on one tier and one device."""

    tier: str
    device: torch.device
    layers: tuple[DecoderLayer, ...]


class WalkHooks(Protocol):
    """What a backend lends the walk: the scope of the PyTorch ops around it, a layer's one-token
    step, and the head."""

    def glue(self) -> AbstractContextManager: ...

    def layer_step(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache | BatchedCaches) -> torch.Tensor: ...

    def head(self, x: torch.Tensor) -> torch.Tensor: ...


class PlacedModel:
    """The model, its placement and the real device of each tier.

    Args:
        model: the model (weights already on their tiers' devices).
        placement: the tier of each piece.
        devices: the real device of each tier.
    """

    def __init__(self, model: LlamaForCausalLM, placement: Placement, devices: TierDevices) -> None:
        placement.check_layer_count(model.config.n_layers)
        self.model = model
        self.config: ModelConfig = model.config
        self.placement = placement
        self.devices = devices
        self.hop_bytes = 0
        self.segments = _segments(model, placement)
        body = [placement.embed_tier, *placement.layer_tiers]  # every position crosses these changes
        self._body_changes = sum(a != b for a, b in zip(body, body[1:]))
        self._head_changes = int(body[-1] != placement.head_tier)  # only the positions whose logits are wanted

    def count_whole_forward(self, position_bytes: int, tokens: int, logit_rows: int) -> None:
        """Count the hops of a forward a backend ran in one call, as the placement moves them:
        ``tokens`` positions cross every tier change of the body, ``logit_rows`` the head's."""
        self.hop_bytes += position_bytes * (self._body_changes * tokens + self._head_changes * logit_rows)

    def walk(self, input_ids: torch.Tensor, cache: KVCache | BatchedCaches, start_pos: int | torch.Tensor,
             all_logits: bool, hooks: WalkHooks) -> torch.Tensor:
        """Run ``input_ids`` (B, T) at positions ``start_pos..start_pos+T-1`` layer by layer.

        Args:
            input_ids: (B, T) token ids (any device: they go to the embedding's).
            cache: a ``KVCache`` (B = 1) or a ``BatchedCaches`` (row i: ``caches[i]``).
            start_pos: an int shared by the batch, or a (B,) tensor with one start per row.
            all_logits: logits of every position, else of the last one only.
            hooks: the backend's one-token layer step (T == 1), head and glue.
        Returns:
            float32 logits (B, T or 1, vocab) on the head's device.
        """
        model = self.model
        seq = input_ids.shape[1]
        tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        with hooks.glue():
            x = model.embed(input_ids)  # (B, T, hidden)
            tables[x.device] = model.rotary_tables(start_pos, seq, x.dtype, x.device)
        tier = self.placement.embed_tier
        for segment in self.segments:
            x = self._hop(x, segment.device, tier != segment.tier)
            tier = segment.tier
            if segment.device not in tables:
                tables[segment.device] = model.rotary_tables(start_pos, seq, x.dtype, segment.device)
            cos, sin = tables[segment.device]
            for layer in segment.layers:
                x = hooks.layer_step(layer, x, cos, sin, cache) if seq == 1 else layer(x, cos, sin, cache)
        if not all_logits:
            x = x[:, -1:, :]
        x = self._hop(x, model.model.norm.weight.device, tier != self.placement.head_tier)
        x = model.final_norm(x)
        x = self._hop(x, model.lm_head.weight.device, False)  # the norm and the head share a tier
        return hooks.head(x)

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
