"""Weight bytes per tier of a placed model, and what one decode step reads.

The figures the metrics, the bench and the planner's accuracy check report: bytes of parameters
and quantized buffers per tier of a :class:`~hybridllm.placement.placement.Placement`, plus the
weight copies a decode backend holds for its own kernels (the native int4 blocks).
"""

from __future__ import annotations

import itertools

from torch import nn

from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.models.quantized import Int4Linear
from hybridllm.placement.placement import Placement
from hybridllm.runtime.backends.base import DecodeBackend


def module_tiers(model: LlamaForCausalLM, placement: Placement) -> list[tuple[nn.Module, str]]:
    """Each top-level piece of the model with its tier in ``placement`` (the rotary tables are
    not weights)."""
    pieces: list[tuple[nn.Module, str]] = [(model.model.embed_tokens, placement.embed_tier)]
    pieces += list(zip(model.model.layers, placement.layer_tiers))
    pieces += [(model.model.norm, placement.head_tier), (model.lm_head, placement.head_tier)]
    return pieces


def weight_bytes_per_tier(model: LlamaForCausalLM, placement: Placement,
                          backend: DecodeBackend | None = None) -> dict[str, int]:
    """Bytes of weights (parameters and quantized buffers) per tier of ``placement``, plus the
    weight copies a decode ``backend`` holds (the native kernels' int4 blocks) in their layer's tier.

    Tiers are logical: a tensor shared within a tier (a tied head) counts once, but a tier's
    own copy counts in that tier even where both tiers are the CPU (CPU as the device), so the
    figures are the ones a real device would show.
    """
    out = {"device": 0, "host": 0}
    seen: set[tuple[str, object]] = set()
    for piece, tier in module_tiers(model, placement):
        for tensor in itertools.chain(piece.parameters(), piece.buffers()):
            key = (tier, (str(tensor.device), tensor.untyped_storage().data_ptr()))
            if key in seen:
                continue
            seen.add(key)
            out[tier] += tensor.numel() * tensor.element_size()
    if backend is not None:
        for layer_idx, nbytes in backend.layer_copy_bytes().items():
            out[placement.layer_tiers[layer_idx]] += nbytes
    return out


def decode_weight_bytes(model: LlamaForCausalLM, placement: Placement, backend: DecodeBackend) -> int:
    """Weight bytes one decode step reads: every weight once (as counted by
    :func:`weight_bytes_per_tier`), less the PyTorch-packed int4 weights of layers whose decode
    step reads the backend's own copy instead (``hybridllm.kernels.native``)."""
    total = sum(weight_bytes_per_tier(model, placement, backend).values())
    for layer in model.model.layers:
        if not backend.reads_copy(layer.self_attn.layer_idx):
            continue
        for module in layer.modules():
            if isinstance(module, Int4Linear):
                total -= sum(t.numel() * t.element_size() for t in (module.weight, module.scales_and_zeros))
    return total
