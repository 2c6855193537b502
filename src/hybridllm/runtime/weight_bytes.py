"""Weight bytes per tier of a placed model, and what one decode step reads.

The figures the metrics, the bench and the planner's accuracy check report: bytes of parameters
and quantized buffers per tier of a :class:`~hybridllm.placement.placement.Placement` (every
weight is held once, in the layout its kernels read: the native int4 blocks included).
"""

from __future__ import annotations

import itertools

from torch import nn

from hybridllm.models.llama import LlamaForCausalLM
from hybridllm.placement.placement import Placement


def module_tiers(model: LlamaForCausalLM, placement: Placement) -> list[tuple[nn.Module, str]]:
    """Each top-level piece of the model with its tier in ``placement`` (the rotary tables are
    not weights)."""
    pieces: list[tuple[nn.Module, str]] = [(model.model.embed_tokens, placement.embed_tier)]
    pieces += list(zip(model.model.layers, placement.layer_tiers))
    pieces += [(model.model.norm, placement.head_tier), (model.lm_head, placement.head_tier)]
    return pieces


def weight_bytes_per_tier(model: LlamaForCausalLM, placement: Placement) -> dict[str, int]:
    """Bytes of weights (parameters and quantized buffers) per tier of ``placement``.

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
    return out


def decode_weight_bytes(model: LlamaForCausalLM, placement: Placement) -> int:
    """Weight bytes one decode step reads: every weight once (as counted by
    :func:`weight_bytes_per_tier`; no backend keeps a second copy to read instead)."""
    return sum(weight_bytes_per_tier(model, placement).values())
