"""Put weights and caches where a :class:`~hybridllm.placement.placement.Placement` says.

A placement names tiers ("device", "host"); :class:`TierDevices` maps them to real devices
(cuda:0 and cpu, or cpu and cpu when the CPU stands in for the device). Everything here works
on the model's structure (embedding, layers, final norm, head), never on device equality, so
the CPU-as-device runs account memory per tier exactly like a GPU run would.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.models.quantized import Int4Linear
from hybridllm.placement.placement import Placement

LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class TierDevices:
    """The real device of each tier."""

    device: torch.device
    host: torch.device = torch.device("cpu")

    def of(self, tier: str) -> torch.device:
        return self.device if tier == "device" else self.host


def tier_of_parameter(name: str, placement: Placement) -> str:
    """The tier of a parameter, by its Hugging Face name (the checkpoint's naming contract)."""
    if name.startswith(LAYER_PREFIX):
        layer_idx = int(name[len(LAYER_PREFIX):].split(".", 1)[0])
        return placement.layer_tiers[layer_idx]
    if name.startswith("model.embed_tokens."):
        return placement.embed_tier
    return placement.head_tier  # model.norm.*, lm_head.*


def weight_device_for(placement: Placement, devices: TierDevices) -> Callable[[str], torch.device]:
    """``device_for(name)`` for the loaders: each parameter goes straight to its tier's device."""
    return lambda name: devices.of(tier_of_parameter(name, placement))


def assign_tiers(model: LlamaForCausalLM, placement: Placement) -> None:
    """Tell the model the tier of each piece, so hidden-state hops between tiers are counted."""
    model.embed_tier, model.head_tier = placement.embed_tier, placement.head_tier
    model.layer_tiers = list(placement.layer_tiers)


def place_tied_head(model: LlamaForCausalLM, placement: Placement, devices: TierDevices) -> None:
    """A head tied to the embedding is loaded with the embedding; give the head tier its own copy
    when the two tiers differ (llama.cpp does the same: the output matrix is per device)."""
    if placement.embed_tier == placement.head_tier or not model.config.tie_word_embeddings:
        return
    model.lm_head = module_copy_on(model.lm_head, devices.of(placement.head_tier))


def module_copy_on(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``module`` whose tensors are on ``device``; tensors already there are shared,
    not copied, and the original module is left untouched.

    Parameters get fresh ``Parameter`` objects over the same storage before the move (a move
    rebinds ``param.data``, which would otherwise reach the original), so only tensors that
    really change device allocate memory. Module ``_apply`` overrides (e.g. int4 repacking
    for another device) run as in ``module.to(device)``.
    """
    memo: dict[int, object] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = buffer
    return copy.deepcopy(module, memo).to(device)


def module_tiers(model: LlamaForCausalLM) -> list[tuple[nn.Module, str]]:
    """Each top-level piece of the model with the tier it was given (:func:`assign_tiers`; the
    rotary tables are not weights)."""
    pieces: list[tuple[nn.Module, str]] = [(model.model.embed_tokens, model.embed_tier)]
    pieces += list(zip(model.model.layers, model.layer_tiers))
    pieces += [(model.model.norm, model.head_tier), (model.lm_head, model.head_tier)]
    return pieces


def weight_bytes_per_tier(model: LlamaForCausalLM) -> dict[str, int]:
    """Bytes of weights (parameters and quantized buffers) per tier, by the model's own tiers.

    Tiers are logical: a tensor shared within a tier (a tied head) counts once, but a tier's
    own copy counts in that tier even where both tiers are the CPU (CPU as the device), so the
    figures are the ones a real device would show.
    """
    out = {"device": 0, "host": 0}
    seen: set[tuple[str, object]] = set()
    for piece, tier in module_tiers(model):
        for tensor in itertools.chain(piece.parameters(), piece.buffers()):
            key = (tier, (str(tensor.device), tensor.untyped_storage().data_ptr()))
            if key in seen:
                continue
            seen.add(key)
            out[tier] += tensor.numel() * tensor.element_size()
    return out


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    """Weight bytes one decode step reads: every weight once (as counted by
    :func:`weight_bytes_per_tier`), less the PyTorch-packed int4 weights of layers whose decode
    step runs natively: those read their own copy (``hybridllm.kernels.native``) instead."""
    total = sum(weight_bytes_per_tier(model).values())
    for layer in model.model.layers:
        if layer._modules.get("native_step") is None:
            continue
        for module in layer.modules():
            if isinstance(module, Int4Linear):
                total -= sum(t.numel() * t.element_size() for t in (module.weight, module.scales_and_zeros))
    return total


def host_decode_model(model: LlamaForCausalLM, devices: TierDevices) -> LlamaForCausalLM:
    """The model for decoding on the host after phase migration: every weight on the host.

    Weights already on the host are shared with ``model``; only device weights are copied.
    """
    clone = module_copy_on(model, devices.host)
    clone.hop_bytes = 0
    clone.embed_tier = clone.head_tier = "host"
    clone.layer_tiers = ["host"] * len(clone.layer_tiers)
    return clone
