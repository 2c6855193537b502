"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM) in plain PyTorch.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.o_proj.weight`` ...), except
that the projections reading the same input are stacked: ``self_attn.qkv_proj`` (q, k, v) and
``mlp.gate_up_proj`` (gate, up). :meth:`LlamaForCausalLM.stacked_projections` names the
checkpoint projections each one is built from; the loaders stack them
(:func:`hybridllm.models.fuse.stack_projections`); Phi-3 checkpoints store them stacked already.
What a family adds (Qwen3's q/k norm, Phi-3's partial rotary, Gemma's norms around attention and
the MLP, GeGLU, embedding scale and logit soft-capping) is a submodule, a layer class or a table
size chosen at construction from ``config.family``; the forward is the same code for every family.
How a layer attends (Gemma's sliding window, score scale and soft-capping) is the KV cache's
business: it reads the layer's options from its ``KVSpec`` (``kvcache.attention.layer_attention``).

The model does not know where KV lives: every attention layer hands its new keys and values to
``cache.attend`` and gets the output back. Nor does it know where its pieces live or how a
decode step is run: :class:`hybridllm.runtime.runner.ModelRunner` walks the layers by tier and
picks the decode backend; :meth:`LlamaForCausalLM.forward` is the plain reference walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridllm.config import ModelConfig
from hybridllm.kvcache.base import KVCache
from hybridllm.models.layers import GeGLU, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary


@dataclass(frozen=True)
class StackedProjection:
    """One stacked projection and the checkpoint projections it is built from, in row order.

    Attributes:
        name: the module's name in the model ("model.layers.0.self_attn.qkv_proj").
        parts: the checkpoint's module names ("model.layers.0.self_attn.q_proj", ...).
        rows: output rows of each part.
    """

    name: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]


class Attention(nn.Module):
    """Grouped-query self-attention whose score/softmax/value step is owned by the KV cache.

    ``q_norm`` / ``k_norm``: a per-head RMSNorm of q and k before rotary where the family has one
    (Qwen3, Gemma 3), else ``nn.Identity``. ``rope_table``: which of the model's rotary tables the
    layer rotates with (1: the sliding-window layers' own base, Gemma 3; else 0).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim  # the first rotary_dim dimensions of each head are rotated
        qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=False)
        qk_norm, gemma = config.family.qk_norm, config.family.gemma_layout
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, gemma) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, gemma) if qk_norm else nn.Identity()
        local_table = config.local_rope_theta is not None and config.layer_window(layer_idx) is not None
        self.rope_table = 1 if local_table else 0

    @property
    def qkv_rows(self) -> tuple[int, int, int]:
        """Output rows of q, k and v inside ``qkv_proj``."""
        kv_rows = self.n_kv_heads * self.head_dim
        return self.n_heads * self.head_dim, kv_rows, kv_rows

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(cache.attend(self.layer_idx, q, k, v))

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (B, H, T, D) and k (B, Hkv, T, D), and v (B, Hkv, T, D) of x (B, T, hidden);
        q and k are normed (where the family norms them) and rotated together (one set of ops)."""
        batch, seq, _ = x.shape
        n_qk = self.n_heads + self.n_kv_heads
        qkv = self.qkv_proj(x).view(batch, seq, n_qk + self.n_kv_heads, self.head_dim)  # (B, T, H+2Hkv, D)
        q = self.q_norm(qkv[:, :, :self.n_heads])  # (B, T, H, D)
        k = self.k_norm(qkv[:, :, self.n_heads:n_qk])  # (B, T, Hkv, D)
        if cos.shape[-1] != self.rotary_dim:  # several tables side by side: this layer's one
            start = self.rope_table * self.rotary_dim
            cos, sin = cos[..., start:start + self.rotary_dim], sin[..., start:start + self.rotary_dim]
        qk = apply_rotary(torch.cat((q, k), dim=2).transpose(1, 2), cos, sin)  # (B, H+Hkv, T, D)
        v = qkv[:, :, n_qk:].transpose(1, 2)  # (B, Hkv, T, D)
        return qk[:, :self.n_heads], qk[:, self.n_heads:], v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of attention results (B, H, T, D) -> (B, T, hidden)."""
        batch, _, seq, _ = attn.shape
        out = attn.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        gemma = config.family.gemma_layout
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=gemma)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=gemma)
        self.mlp = (GeGLU if gemma else SwiGLU)(config.hidden_size, config.intermediate_size)

    @property
    def device(self) -> torch.device:
        """Where the layer's weights are (its inputs go there)."""
        return self.input_layernorm.weight.device

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.attention_outputs(x, cache.attend(self.self_attn.layer_idx, q, k, v))

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first half of a step: norm, q/k/v projection and rotary. Returns q, k, v (B, H*, T, D)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The second half: output projection, residual, norm, MLP, residual. attn: (B, H, T, D)."""
        x = x + self.self_attn.output(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaDecoderLayer(DecoderLayer):
    """The Gemma 2/3 block: norms on both sides of attention and of the (GeGLU) MLP.

    x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))). Every norm scales in
    float32 by its weight, which holds Gemma's 1 + w.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # post_attention_layernorm norms the attention's output here
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=True)

    def attention_outputs(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.output(attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderStack(nn.Module):
    """Embedding, the layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        gemma = config.family.gemma_layout
        layer_class = GemmaDecoderLayer if gemma else DecoderLayer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=gemma)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal language model: the weights and the math of one forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    # ---- the checkpoint's layout -----------------------------------------------------------
    def stacked_projections(self) -> list[StackedProjection]:
        """Every stacked projection with the checkpoint (Hugging Face) projections it holds: the
        separate q/k/v and gate/up, or the stacked matrix itself where the checkpoint stores it so
        (``config.family.stacked_checkpoint``, Phi-3)."""
        out = []
        intermediate = self.config.intermediate_size
        stacked_checkpoint = self.config.family.stacked_checkpoint
        for i, layer in enumerate(self.model.layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            qkv_rows = layer.self_attn.qkv_rows
            if stacked_checkpoint:
                out.append(StackedProjection(f"{attn}.qkv_proj", (f"{attn}.qkv_proj",), (sum(qkv_rows),)))
                out.append(StackedProjection(f"{mlp}.gate_up_proj", (f"{mlp}.gate_up_proj",), (2 * intermediate,)))
                continue
            out.append(StackedProjection(f"{attn}.qkv_proj", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"),
                                         qkv_rows))
            out.append(StackedProjection(f"{mlp}.gate_up_proj", (f"{mlp}.gate_proj", f"{mlp}.up_proj"),
                                         (intermediate, intermediate)))
        return out

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter under its checkpoint (Hugging Face) name: the stacked
        projections split back into their parts."""
        shapes = {name: tuple(param.shape) for name, param in self.named_parameters()}
        for stacked in self.stacked_projections():
            for leaf in ("weight", "bias"):
                shape = shapes.pop(f"{stacked.name}.{leaf}", None)
                if shape is None:
                    continue
                for part, rows in zip(stacked.parts, stacked.rows):
                    shapes[f"{part}.{leaf}"] = (rows, *shape[1:])
        return shapes

    # ---- the pieces a runner walks ---------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, hidden) of ``input_ids`` (B, T), on the embedding's device;
        Gemma scales them by sqrt(hidden_size), rounded to their dtype first as transformers does."""
        embed = self.model.embed_tokens
        x = embed(input_ids.to(embed.weight.device))
        if self.config.family.gemma_layout:
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x

    @property
    def rope_switch_length(self) -> int | None:
        """Longrope (Phi-3 128K): the sequence length past which every position rotates with the
        long factors (None: the rotation never depends on the length). A forward that takes a
        sequence's cached short-rotated keys past it must re-encode them (the request loop does)."""
        return self.rotary.original_positions if self.rotary.longrope else None

    def rotary_tables(self, start_pos: int | torch.Tensor, seq: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B or 1, 1, T, n_tables * rotary_dim) of positions ``start_pos..start_pos+seq-1``
        on ``device`` (n_tables: 2 where sliding-window layers have their own base, else 1)."""
        starts = torch.as_tensor(start_pos).reshape(-1, 1)  # (B or 1, 1)
        positions = starts + torch.arange(seq)  # (B or 1, T)
        cos, sin = self.rotary.cos_sin(positions, dtype)
        return cos.to(device), sin.to(device)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (..., vocab) of normed hidden states (..., hidden), soft-capped
        (cap * tanh(logits / cap)) where the model caps them (Gemma 2)."""
        logits = self.lm_head(x).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- the plain forward -----------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        start_pos: int | torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run ``input_ids`` (B, T) at positions ``start_pos..start_pos+T-1`` through every layer.

        ``start_pos`` is an int shared by the batch, or a (B,) tensor with one start per row
        (a batch of sequences of different lengths, as in continuous batching).
        Returns float32 logits (B, T, vocab) when ``all_logits`` else (B, 1, vocab) for the last
        token only (prefill needs just that one, and the vocab projection is the largest matmul).
        """
        seq = input_ids.shape[1]
        x = self.embed(input_ids)  # (B, T, hidden)
        tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self.model.layers:
            device = layer.device
            x = x.to(device)
            if device not in tables:
                tables[device] = self.rotary_tables(start_pos, seq, x.dtype, device)
            x = layer(x, *tables[device], cache)
        if not all_logits:
            x = x[:, -1:, :]
        x = self.final_norm(x.to(self.model.norm.weight.device))
        return self.head(x.to(self.lm_head.weight.device))
