"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU and GeGLU MLPs.

Numerics follow Hugging Face transformers (norms and rotary tables in float32, then cast to the
compute dtype) so that float32 logits match it to ~1e-5.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; statistics in float32.

    ``scale_in_float32``: the normed x is multiplied by the weight in float32 and then cast
    (Gemma's order), instead of cast and then multiplied (Llama's); the same in float32.
    """

    def __init__(self, dim: int, eps: float, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # already float32: one fused call, same math
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (x32 * self.weight.float()).to(dtype)
        return self.weight * x32.to(dtype)


def rope_inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies (rotary_dim/2,) of the rotary embedding, with any scaling applied
    (longrope: its short factors, or its long ones with ``long``)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (R/2,)
    longrope = config.longrope
    if longrope is not None:
        divisors = torch.tensor(longrope.long_factor if long else longrope.short_factor, dtype=torch.float32)
        return 1.0 / (divisors * config.rope_theta ** exponents)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    elif config.rope_scaling is not None:
        inv_freq = _scale_inverse_frequencies(inv_freq, config.rope_scaling)
    return inv_freq


def _scale_inverse_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_table_count(config: ModelConfig) -> int:
    """Rotary tables a model needs: 2 when its sliding-window layers have their own base (Gemma 3)."""
    return 1 if config.local_rope_theta is None else 2


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (Hugging Face / NeoX).

    A model whose sliding-window layers rotate with their own base (Gemma 3's
    ``rope_local_base_freq``, unscaled) gets both tables side by side: table ``i`` of the
    (..., n_tables * rotary_dim) output is what :attr:`Attention.rope_table` ``i`` reads.

    Longrope (Phi-3 128K) keeps a second set of frequencies (``long_inv_freq``): a row of
    positions whose last one is past ``original_max_position_embeddings`` rotates with the long
    set, else with the short one (transformers' rule, per forward; decided per row, so a batch
    never changes a row's tables), and cos and sin are scaled by its ``attention_factor``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freqs = [rope_inverse_frequencies(config)]
        if config.local_rope_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None,
                                        rope_freq_factors=None)
            inv_freqs.append(rope_inverse_frequencies(local))
        self.register_buffer("inv_freq", torch.stack(inv_freqs), persistent=False)  # (n_tables, R/2)
        longrope = config.longrope
        self.longrope = longrope is not None
        self.original_positions = longrope.original_max_position_embeddings if self.longrope else 0
        self.attention_factor = longrope.attention_factor if self.longrope else 1.0
        long_inv_freq = rope_inverse_frequencies(config, long=True)[None] if self.longrope else self.inv_freq
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)  # (1, R/2) or inv_freq itself

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for ``positions`` (B, T), each (B, 1, T, n_tables * rotary_dim) in ``dtype``."""
        n_tables, half = self.inv_freq.shape
        positions = positions.to(self.inv_freq.device, torch.float32)
        inv_freq = self.inv_freq  # (n, R/2)
        if self.longrope:  # each row's last position picks its set, as a tensor op (no host sync)
            longer = positions.amax(dim=-1) + 1 > self.original_positions  # (B,)
            inv_freq = torch.where(longer[:, None, None, None], self.long_inv_freq, self.inv_freq)  # (B, 1, n, R/2)
        freqs = positions[..., None, None] * inv_freq  # (B, T, n, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, n, R)
        emb = emb.reshape(*emb.shape[:2], n_tables * 2 * half).unsqueeze(1)  # (B, 1, T, n*R): broadcast over heads
        if self.longrope:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by the tables ``cos``/``sin`` (B or 1, 1, T, R).

    R < D is partial rotary (Phi-3's ``partial_rotary_factor``): the first R dimensions of each
    head are rotated, the rest pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)  # (B, H, T, R)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)  # (B, H, T, D)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """The Llama MLP: down(act(gate(x)) * up(x)) with act = silu, gate and up stacked in one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., intermediate) each
        return self.down_proj(self.activation(gate) * up)

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class GeGLU(SwiGLU):
    """The Gemma MLP: the same gated product with gelu (tanh approximation, ``gelu_pytorch_tanh``)."""

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")
