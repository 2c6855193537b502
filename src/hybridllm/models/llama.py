"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain PyTorch.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so a
checkpoint's state dict loads without renaming. The model does not know where KV lives: every
attention layer hands its new keys and values to ``cache.attend`` and gets the output back.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridllm.config import ModelConfig
from hybridllm.kvcache.base import KVCache
from hybridllm.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary


class Attention(nn.Module):
    """Grouped-query self-attention whose score/softmax/value step is owned by the KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.n_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(cache.attend(self.layer_idx, q, k, v))

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (B, H, T, D) and k (B, Hkv, T, D), and v (B, Hkv, T, D) of x (B, T, hidden)."""
        if "qkv_proj" in self._modules:  # fused by hybridllm.models.fuse
            return self._project_fused(x, cos, sin)
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of attention results (B, H, T, D) -> (B, T, hidden)."""
        batch, _, seq, _ = attn.shape
        out = attn.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(out)

    def _project_fused(self, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v from one stacked projection; q and k are rotated together (one set of ops)."""
        batch, seq, _ = x.shape
        n_qk = self.n_heads + self.n_kv_heads
        qkv = self.qkv_proj(x).view(batch, seq, n_qk + self.n_kv_heads, self.head_dim)  # (B, T, H+2Hkv, D)
        qk = apply_rotary(qkv[:, :, :n_qk].transpose(1, 2), cos, sin)  # (B, H+Hkv, T, D)
        v = qkv[:, :, n_qk:].transpose(1, 2)  # (B, Hkv, T, D)
        return qk[:, :self.n_heads], qk[:, self.n_heads:], v


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        native = self._modules.get("native_step")  # set by hybridllm.kernels.native.enable_native_decode
        if native is not None and native.applies(x, cos, cache):
            return native.step(x, cos, sin, cache)  # the whole one-token step in one kernel call
        compiled = self.__dict__.get("compiled_halves")  # set by hybridllm.engine.speed.compile_layers
        if compiled is None or x.shape[1] != 1:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        # Decode step with compiled dense parts: everything but the cache's attention is in
        # two graphs (the cache call stays eager: it holds Python bookkeeping and may move data).
        before, after = compiled
        q, k, v = before(self, x, cos, sin)
        attn = cache.attend(self.self_attn.layer_idx, q, k, v)  # (B, H, 1, D)
        return after(self, x, attn)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first half of a step: norm, q/k/v projection and rotary. Returns q, k, v (B, H*, T, D)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The second half: output projection, residual, norm, MLP, residual. attn: (B, H, T, D)."""
        x = x + self.self_attn.output(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embedding, the layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal language model.

    Each layer may live on its own device; hidden states hop devices only at layer boundaries
    (``hidden_state_hop`` counts those bytes for the metrics).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.hop_bytes = 0  # bytes of hidden states moved between tiers (layer boundaries)
        # Memory tier ("device"/"host") of the embedding, each layer and the head, set by the
        # placement: a hop is counted where the tier changes even when the CPU plays the device.
        self.embed_tier = self.head_tier = "device"
        self.layer_tiers = ["device"] * config.n_layers

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        start_pos: int | torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run ``input_ids`` (B, T) at positions ``start_pos..start_pos+T-1`` through the model.

        ``start_pos`` is an int shared by the batch, or a (B,) tensor with one start per row
        (a batch of sequences of different lengths, as in continuous batching).
        Returns logits (B, T, vocab) when ``all_logits`` else (B, 1, vocab) for the last token
        only (prefill needs just that one, and the vocab projection is the largest matmul).
        """
        seq = input_ids.shape[1]
        embed = self.model.embed_tokens
        x = embed(input_ids.to(embed.weight.device))  # (B, T, hidden)
        starts = torch.as_tensor(start_pos).reshape(-1, 1)  # (B or 1, 1)
        positions = starts + torch.arange(seq)  # (B or 1, T)
        native = self.__dict__.get("native_model")  # set by hybridllm.kernels.native.enable_native_decode
        if native is not None and x.dtype == torch.float32 and native.applies(input_ids, cache):
            self.hop_bytes += native.tier_changes * x.numel() * x.element_size()
            return native.decode(x, *self.rotary.cos_sin(positions, x.dtype), cache)
        tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        tier = self.embed_tier
        for layer, layer_tier in zip(self.model.layers, self.layer_tiers):
            device = layer.input_layernorm.weight.device
            x = self._hop(x, device, tier != layer_tier)
            tier = layer_tier
            if device not in tables:
                cos, sin = self.rotary.cos_sin(positions, x.dtype)
                tables[device] = (cos.to(device), sin.to(device))
            x = layer(x, *tables[device], cache)
        if not all_logits:
            x = x[:, -1:, :]
        x = self._hop(x, self.model.norm.weight.device, tier != self.head_tier)
        x = self.model.norm(x)
        x = self._hop(x, self.lm_head.weight.device, False)  # the norm and the head share a tier
        native_head = self._modules.get("native_head")  # set by enable_native_decode
        if native_head is not None and native_head.applies(x):
            return native_head(x)
        return self.lm_head(x).float()

    def _hop(self, x: torch.Tensor, device: torch.device, crosses_tiers: bool) -> torch.Tensor:
        """``x`` on ``device``; its bytes count as moved when it changes device or tier."""
        if crosses_tiers or x.device != device:
            self.hop_bytes += x.numel() * x.element_size()
        return x if x.device == device else x.to(device)
