"""Put weights and caches where a :class:`~hybridllm.placement.placement.Placement` says.

A placement names tiers ("device", "host"); :class:`TierDevices` maps them to real devices
(cuda:0 and cpu, or cpu and cpu when the CPU stands in for the device). Everything here works
on the model's structure (embedding, layers, final norm, head), never on device equality, so
the CPU-as-device runs account memory per tier exactly like a GPU run would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from hybridllm.models.llama import LlamaForCausalLM
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


def host_decode_model(model: LlamaForCausalLM, devices: TierDevices) -> LlamaForCausalLM:
    """The model for decoding on the host after phase migration: a copy with every weight on the
    host (weights already there are shared with ``model``; only device weights are copied).
    Its runner takes :func:`all_on_host`."""
    return module_copy_on(model, devices.host)


def all_on_host(placement: Placement) -> Placement:
    """``placement`` with every weight on the host (the host decode model's tiers)."""
    n_layers = len(placement.layer_tiers)
    return replace(placement, layer_tiers=["host"] * n_layers, embed_tier="host", head_tier="host")
