"""The planner's memory model: bytes of weights per format and of KV per tier, in plain numbers.

Weights per format, per matrix of ``rows x cols`` weights (``n = rows * cols``): float32 ``4n``;
float16/bfloat16 ``2n``; int8 per output channel ``n + 2 * rows`` (one fp16 scale per row); int4
in groups of 32 with an fp16 scale and an fp16 offset ``n/2 + 4 * n/32`` (5 bits per weight);
q4_k_m ``4.85 * n / 8`` (llama.cpp's average over its Q4_K/Q6_K mix). Norms (and biases) stay in
the float format, or float32 next to quantized matrices.

KV bytes per token = 2 x layers x kv_heads x head_dim x bytes per element; int8/int4 KV adds an
fp16 scale and an fp16 zero point per group of 64 elements (1.0625 / 0.5625 bytes per element).
What a candidate's KV holds, reads and moves per tier is each strategy's own declaration
(:mod:`hybridllm.kvcache.registry`); :func:`kv_cost` combines the device layers' strategy with
the host layers' dense host cache, as ``SplitCache`` does. The memory of a candidate is its
weights and KV per tier, an activation scratch for one prefill chunk on each tier that computes,
and ``HOST_RUNTIME_BYTES`` on the host. Device KV may fill only ``KV_THRESHOLD`` (95%, the
ledger's eviction threshold) of what the device's weights and scratch leave of its budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from hybridllm.config import KVConfig, ModelConfig, parse_dtype
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import TIERS, KVSpec
from hybridllm.kvcache.registry import get_strategy, host_layers_cost
from hybridllm.kvcache.strategy import KVCost

WEIGHT_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4", "q4_k_m")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PRECISION_RANK = {"float32": 5, "float16": 4, "bfloat16": 4, "int8": 3, "int4": 2, "q4_k_m": 1}
Q4_K_M_BITS_PER_WEIGHT = 4.85
INT4_GROUP = 32  # int4 weights: fp16 scale + fp16 offset per 32 weights -> 5 bits per weight
KV_GROUP = 64  # quantized KV: fp16 scale + fp16 zero point per 64 elements (KVConfig.kv_group_size)
PAGE_SIZE = KVConfig.kv_page_size  # tiered hot windows are whole pages
KV_THRESHOLD = KVConfig.kv_threshold  # device KV may fill this share of what the weights leave
# Resident memory of the process besides weights and KV: Python, PyTorch, the tokenizer and the
# allocator's caches (about 270 MiB after imports and the tokenizer, about 430 MiB at a request's
# peak with the default model, its weights excluded).
HOST_RUNTIME_BYTES = 448 * 2**20
GB = 1e9


# ---- weights --------------------------------------------------------------------------------------
def matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of a ``rows x cols`` weight matrix stored in ``fmt`` (scales included)."""
    n = rows * cols
    if fmt in FLOAT_BYTES:
        return n * FLOAT_BYTES[fmt]
    if fmt == "int8":
        return n + 2 * rows  # one fp16 scale per output channel
    if fmt == "int4":
        return n // 2 + 4 * math.ceil(n / INT4_GROUP)  # fp16 scale + fp16 offset per group
    if fmt == "q4_k_m":
        return math.ceil(n * Q4_K_M_BITS_PER_WEIGHT / 8)
    raise ConfigError(f"unknown weight format {fmt!r}; choose from {', '.join(WEIGHT_FORMATS)}")


def _vector_bytes(n: int, fmt: str) -> int:
    """Norm weights and biases: the float format itself, float32 next to quantized matrices."""
    return n * FLOAT_BYTES.get(fmt, 4)


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of a model in one format, by part."""

    layer: int  # one decoder layer (matrices, biases, norms)
    embed: int  # token embedding
    head: int  # output head matrix; 0 when tied to the embedding
    final_norm: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.layer * self.n_layers + self.embed + self.head + self.final_norm

    @property
    def head_read(self) -> int:
        """Bytes one decode step reads for the output: the head matrix (or the tied embedding)."""
        return (self.head or self.embed) + self.final_norm


def layer_matrix_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(rows, cols) of one decoder layer's matrices: q, k, v, o, gate, up, down."""
    h, d = cfg.hidden_size, cfg.head_dim
    return [
        (cfg.n_heads * d, h), (cfg.n_kv_heads * d, h), (cfg.n_kv_heads * d, h), (h, cfg.n_heads * d),
        (cfg.intermediate_size, h), (cfg.intermediate_size, h), (h, cfg.intermediate_size),
    ]


def layer_matrix_params(cfg: ModelConfig) -> int:
    return sum(r * c for r, c in layer_matrix_shapes(cfg))


def weight_bytes(cfg: ModelConfig, fmt: str) -> WeightBytes:
    """Weight bytes of ``cfg`` in format ``fmt``."""
    vectors = 2 * cfg.hidden_size
    if cfg.attention_bias:
        vectors += cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads)
    layer = sum(matrix_bytes(r, c, fmt) for r, c in layer_matrix_shapes(cfg)) + _vector_bytes(vectors, fmt)
    embed = matrix_bytes(cfg.vocab_size, cfg.hidden_size, fmt)
    head = 0 if cfg.tie_word_embeddings else matrix_bytes(cfg.vocab_size, cfg.hidden_size, fmt)
    return WeightBytes(layer, embed, head, _vector_bytes(cfg.hidden_size, fmt), cfg.n_layers)


def weights_bytes_by_format(cfg: ModelConfig) -> dict[str, int]:
    return {fmt: weight_bytes(cfg, fmt).total for fmt in WEIGHT_FORMATS}


# ---- KV -----------------------------------------------------------------------------------------
def kv_element_bytes(dtype: str | int) -> float:
    """Bytes per cached element: float sizes, or codes + fp16 scale and zero per group of 64."""
    bits = {"int8": 8, "int4": 4}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype in FLOAT_BYTES:
        return FLOAT_BYTES[dtype]
    if bits == 16:
        return 2
    if bits in (8, 4):
        return bits / 8 + 4 / KV_GROUP
    raise ConfigError(f"unknown KV dtype {dtype!r}; choose from {', '.join(KV_DTYPES)}")


def kv_bytes_per_token(cfg: ModelConfig, dtype: str | int) -> int:
    """KV bytes of one token over all layers: 2 x layers x kv_heads x head_dim x element bytes."""
    return round(2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_element_bytes(dtype))


def kv_bytes_by_dtype(cfg: ModelConfig) -> dict[str, int]:
    return {dtype: kv_bytes_per_token(cfg, dtype) for dtype in KV_DTYPES}


def kv_spec(cfg: ModelConfig, compute_dtype: str, n_layers: int | None = None) -> KVSpec:
    """The cache spec of ``n_layers`` (default: all) of ``cfg``'s layers in ``compute_dtype``
    (the memory model reads only its shape and dtype)."""
    return KVSpec(n_layers=cfg.n_layers if n_layers is None else n_layers, n_kv_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, dtype=parse_dtype(compute_dtype), device=torch.device("cpu"),
                  max_tokens=cfg.max_position_embeddings)


def attention_exchange_bytes(cfg: ModelConfig, compute_bytes: int) -> int:
    """Bytes crossing the bus per layer and token when attention runs on the other tier: q goes
    there, the float32 output and its log-sum-exp come back."""
    return cfg.n_heads * cfg.head_dim * (compute_bytes + 4) + cfg.n_heads * 4


def kv_cost(cfg: ModelConfig, kv: KVConfig, n_device_layers: int, n_tokens: int, compute_dtype: str,
            decode_on: str = "device") -> KVCost:
    """What the KV of a placement holds, reads and moves at ``n_tokens``: the device layers under
    ``kv.kv_cache``, the host layers in a dense host cache; with ``decode_on="host"`` the device
    layers' KV built by prefill is held until every layer moves to the host cache that decoding
    reads. Every tier has an entry."""
    exchange = attention_exchange_bytes(cfg, FLOAT_BYTES[compute_dtype])
    device = get_strategy(kv.kv_cache).cost(kv, kv_spec(cfg, compute_dtype, n_device_layers), n_tokens, exchange)
    if decode_on == "host":
        migrated = host_layers_cost(kv_spec(cfg, compute_dtype), n_tokens)
        return _sum_costs(KVCost(memory=device.memory, read={}), migrated)
    host = host_layers_cost(kv_spec(cfg, compute_dtype, cfg.n_layers - n_device_layers), n_tokens)
    return _sum_costs(device, host)


def _sum_costs(a: KVCost, b: KVCost) -> KVCost:
    def add(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {tier: x.get(tier, 0) + y.get(tier, 0) for tier in TIERS}

    return replace(a, memory=add(a.memory, b.memory), read=add(a.read, b.read), scratch=add(a.scratch, b.scratch),
                   bus=a.bus + b.bus, round_trips=a.round_trips + b.round_trips,
                   prefill_bus=a.prefill_bus + b.prefill_bus)


def scratch_bytes(cfg: ModelConfig, compute_bytes: int, prefill_chunk: int) -> int:
    """Activation scratch of one prefill chunk: hidden states, q/k/v/o, the MLP's three vectors, logits."""
    per_token = 6 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * cfg.n_kv_heads * cfg.head_dim
    return prefill_chunk * per_token * compute_bytes + 4 * cfg.vocab_size
