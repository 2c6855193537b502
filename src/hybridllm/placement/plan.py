"""The planner: a memory model, a roofline predictor and a policy search that yields a ``Placement``.

Everything here except :func:`plan_for_machine` and :func:`load_model_config` is a pure
function over plain numbers (a ``ModelConfig``, byte counts, bandwidths), so it is unit-tested
without tensors or a GPU.

Memory model (bytes)
    Weights per format, per matrix of ``rows x cols`` weights (``n = rows * cols``):
    float32 ``4n``; float16/bfloat16 ``2n``; int8 per output channel ``n + 2 * rows`` (one fp16
    scale per row); int4 in groups of 32 with an fp16 scale and an fp16 offset ``n/2 + 4 * n/32``
    (5 bits per weight); q4_k_m ``4.85 * n / 8`` (llama.cpp's average over its Q4_K/Q6_K mix).
    Norms (and biases) stay in the float format, or float32 next to quantized matrices.
    KV bytes per token = 2 x layers x kv_heads x head_dim x bytes per element; int8/int4 KV adds
    an fp16 scale and an fp16 zero point per group of 64 elements (1.0625 / 0.5625 bytes per
    element). The memory of a candidate is its weights and KV per tier, an activation scratch
    for one prefill chunk on each tier that computes, and ``HOST_RUNTIME_BYTES`` on the host.
    Device KV may fill only ``KV_THRESHOLD`` (95%, the ledger's eviction threshold) of what the
    device's weights and scratch leave of its budget.

Roofline predictor (seconds)
    Decode, per token, at ``c`` cached tokens::

        t_token = device_bytes / device_bandwidth + host_bytes / host_bandwidth
                  + bus_bytes / pcie_bandwidth + token_overhead
                  + n_device_layers * device_layer_overhead + n_host_layers * host_layer_overhead
                  + bus_round_trips * BUS_SYNC_S

    where ``device_bytes``/``host_bytes`` are the weights each tier reads for one token (every
    layer's matrices, the final norm and the head; one embedding row is negligible) plus the KV
    each tier reads (for a KV stored in another format than the compute dtype the cache
    materialises a compute-dtype copy, so such KV costs its own bytes plus twice the copy's:
    quantized KV saves memory, not decode traffic), and ``bus_bytes`` is what crosses PCIe per
    token (hidden states at a device/host split, q and partial outputs of host-side attention,
    KV streamed by ``offloaded``, new tokens evicted by ``tiered``). Decode TPS = 1 / t_token.
    The overheads are the fixed per-step costs measured by ``probe.measure_layer_overhead``.

    Prefill (TTFT) of ``p`` prompt tokens in chunks of ``prefill_chunk``: compute-bound::

        ttft = FLOPs / FLOP rate + host-layer weights over the bus (once per chunk)
               + host-layer KV over the bus + chunks * (token_overhead + layers * layer_overhead)

    with FLOPs = 2 x matrix weights x p (layers) + 2 x heads x head_dim x p (p + 1) (causal
    attention) + 2 x vocab x hidden per chunk (the head, last token only). With a GPU, layers on
    the host have their weights streamed to the device for each chunk and computed there (the
    bus term); with the CPU standing in for the device everything computes at the host rate.

Policy search
    Candidates: weight format x layers on the device (0..n) x KV strategy (dynamic; quantized
    int8/int4; tiered with the largest hot window that fits, cold pages 16 or 4 bits; offloaded;
    host) x decode tier (device, or host: prefill on the device then decode on a host copy of
    the weights). The fastest predicted decode that fits both budgets at the requested context
    wins; ties go to the higher-precision format and fewer moving parts. Without a GPU the CPU
    stands in for the device: one memory pool, every layer on the "device" tier, and the
    strategies that only move KV between tiers are the same as ``dynamic``, so they are skipped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridllm.config import KVConfig, ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.placement.placement import Placement

# ---- formats ------------------------------------------------------------------------------------
WEIGHT_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4", "q4_k_m")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
Q4_K_M_BITS_PER_WEIGHT = 4.85
INT4_GROUP = 32  # int4 weights: fp16 scale + fp16 offset per 32 weights -> 5 bits per weight
KV_GROUP = 64  # quantized KV: fp16 scale + fp16 zero point per 64 elements (KVConfig.kv_group_size)
KV_RESIDUAL = 128  # quantized KV: newest tokens kept in full precision (KVConfig.kv_residual)
PAGE_SIZE = 128  # tiered hot windows are whole pages (KVConfig.kv_page_size)
KV_THRESHOLD = 0.95  # device KV may fill this share of what the weights leave (KVConfig.kv_threshold)
PRECISION_RANK = {"float32": 5, "float16": 4, "bfloat16": 4, "int8": 3, "int4": 2, "q4_k_m": 1}

# ---- constants of the predictor (README: "Planning: a worked example") --------------------------
# Resident memory of the process besides weights and KV: Python, PyTorch, the tokenizer and the
# allocator's caches (about 270 MiB after imports and the tokenizer, about 430 MiB at a request's
# peak with the default model, its weights excluded).
HOST_RUNTIME_BYTES = 448 * 2**20
# Latency of one host<->device round trip with a stream synchronisation (PCIe + driver).
BUS_SYNC_S = 20e-6
# A GPU that is not probed (plan --vram on a machine without one): a typical 8 GiB consumer card.
DEFAULT_DEVICE_BANDWIDTH_GBS = 256.0  # achievable; RTX 4060 peaks at 272 GB/s, RTX 3060 Ti/3070 at 448 GB/s
DEFAULT_PCIE_GBS = 12.0  # achievable pinned copies over PCIe 4.0 x8 or 3.0 x16 (16 GB/s peak)
DEFAULT_DEVICE_TFLOPS = 20.0  # fp16 tensor-core matmuls reached by eager PyTorch on such a card
DEFAULT_DEVICE_LAYER_OVERHEAD_S = 100e-6  # ~20 kernel launches per eager decoder layer at ~5 us
DEFAULT_DEVICE_TOKEN_OVERHEAD_S = 500e-6  # embedding, head, sampling, the logits' copy and sync
# Host figures when the probe is skipped (tests, or every figure given): a 2-channel DDR4 desktop.
DEFAULT_HOST_BANDWIDTH_GBS = 20.0
DEFAULT_HOST_GFLOPS = 200.0
DEFAULT_HOST_LAYER_OVERHEAD_S = 150e-6
DEFAULT_HOST_TOKEN_OVERHEAD_S = 1e-3
GB = 1e9


class PlanError(ConfigError):
    """A plan that cannot exist (e.g. the weights alone exceed RAM + VRAM)."""


# ---- memory model: weights --------------------------------------------------------------------
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


# ---- memory model: KV -------------------------------------------------------------------------
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


# ---- the machine --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Budgets and rates the predictor uses. Bandwidths in bytes/s, FLOP rates in FLOP/s.

    ``has_device=False``: the CPU stands in for the device; ``device_budget`` is then ignored
    and everything shares ``host_budget`` (RAM).
    """

    has_device: bool
    device_budget: int
    host_budget: int
    device_bandwidth: float
    host_bandwidth: float
    pcie_bandwidth: float
    device_flops: float
    host_flops: float
    device_layer_overhead_s: float
    host_layer_overhead_s: float
    device_token_overhead_s: float
    host_token_overhead_s: float

    @classmethod
    def cpu_only(cls, ram: int, bandwidth: float, flops: float, layer_overhead_s: float,
                 token_overhead_s: float) -> Hardware:
        return cls(False, 0, ram, bandwidth, bandwidth, math.inf, flops, flops, layer_overhead_s, layer_overhead_s,
                   token_overhead_s, token_overhead_s)


# ---- candidates and predictions ----------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One placement the search considers."""

    weight_format: str
    n_device_layers: int
    kv_cache: str = "dynamic"  # dynamic, quantized, tiered, offloaded, host
    kv_bits: int = 8  # quantized
    kv_hot_window: int = 0  # tiered
    kv_cold_bits: int = 16  # tiered
    decode_on: str = "device"

    def describe(self, cfg: ModelConfig, has_device: bool) -> str:
        kv = {"quantized": f"quantized int{self.kv_bits} KV",
              "tiered": f"tiered KV (hot window {self.kv_hot_window} tokens on the device, cold pages "
                        f"{self.kv_cold_bits}-bit in RAM)",
              "offloaded": "offloaded KV (in RAM, streamed per layer)",
              "host": "KV and attention on the host"}.get(self.kv_cache, "dynamic KV")
        if not has_device:
            return f"{self.weight_format} weights, CPU only (all {cfg.n_layers} layers), {kv}"
        where = f"{self.n_device_layers}/{cfg.n_layers} layers on the device"
        decode = ", decode on the host" if self.decode_on == "host" else ""
        return f"{self.weight_format} weights, {where}, {kv}{decode}"


@dataclass(frozen=True)
class Prediction:
    """What the predictor says about a candidate."""

    decode_tps: float
    ttft_s: float
    peak_device_bytes: int
    peak_host_bytes: int
    decode_s: dict[str, float]  # t_token split: device, host, bus, overhead
    decode_bytes: dict[str, int]  # bytes per token read on device / host / moved over the bus
    device_overflow: int  # bytes over the device budget (0 when it fits)
    host_overflow: int

    @property
    def fits(self) -> bool:
        return self.device_overflow == 0 and self.host_overflow == 0

    def to_dict(self) -> dict[str, Any]:
        return {"decode_tps": self.decode_tps, "ttft_s": self.ttft_s, "peak_device_bytes": self.peak_device_bytes,
                "peak_host_bytes": self.peak_host_bytes}


def _kv_read_bytes(elements: float, stored: float, compute: float) -> float:
    """Bytes to attend over ``elements`` cached values stored at ``stored`` bytes each.

    A format other than the compute dtype is materialised into a compute-dtype copy first:
    read the stored bytes, write the copy, read it back.
    """
    if stored == compute:
        return elements * stored
    return elements * (stored + 2 * compute)


def scratch_bytes(cfg: ModelConfig, compute_bytes: int, prefill_chunk: int) -> int:
    """Activation scratch of one prefill chunk: hidden states, q/k/v/o, the MLP's three vectors, logits."""
    per_token = 6 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * cfg.n_kv_heads * cfg.head_dim
    return prefill_chunk * per_token * compute_bytes + 4 * cfg.vocab_size


def predict(cfg: ModelConfig, cand: Candidate, hw: Hardware, context: int, compute_dtype: str = "float16",
            prompt_tokens: int | None = None, prefill_chunk: int = 512) -> Prediction:
    """Predict decode TPS at ``context`` cached tokens, the TTFT of ``prompt_tokens`` (default:
    ``context``), and the peak memory per tier of KV for ``context`` tokens."""
    n, nd = cfg.n_layers, cand.n_device_layers
    nh = n - nd
    p = context if prompt_tokens is None else prompt_tokens
    e = FLOAT_BYTES[compute_dtype]
    wb = weight_bytes(cfg, cand.weight_format)
    all_dev = nd == n
    kv_el = 2 * cfg.n_kv_heads * cfg.head_dim  # elements per token per layer
    kvl = kv_el * e  # full-precision bytes per token per layer
    c = context
    cpu_only = not hw.has_device

    # -- weights per tier (embedding and head follow Placement.from_n_gpu_layers) --
    outer = wb.embed + wb.head + wb.final_norm
    dev_w = nd * wb.layer + (outer if all_dev else 0)
    host_w = nh * wb.layer + (0 if all_dev else outer)
    if cand.decode_on == "host":
        host_w = wb.total  # a host copy of every weight for decoding
    # bytes read per decode step
    head_read = wb.head_read
    if cand.decode_on == "host":
        dev_read_w, host_read_w = 0, n * wb.layer + head_read
    else:
        dev_read_w = nd * wb.layer + (head_read if all_dev else 0)
        host_read_w = nh * wb.layer + (0 if all_dev else head_read)

    # -- KV: memory per tier and bytes read per decode step --
    dev_kv = host_kv = 0.0
    dev_scratch_kv = host_scratch_kv = 0.0
    dev_read_kv = host_read_kv = 0.0
    bus = 0.0
    round_trips = 0
    q_out_bytes = cfg.n_heads * cfg.head_dim * (e + 4) + cfg.n_heads * 4  # q there, out + lse back
    if cand.kv_cache == "dynamic" or cand.decode_on == "host":
        dev_kv, host_kv = nd * kvl * c, nh * kvl * c
        dev_read_kv, host_read_kv = nd * kvl * c, nh * kvl * c
        if cand.decode_on == "host":
            host_kv = n * kvl * c  # after migration everything lives on the host
            dev_read_kv, host_read_kv = 0, n * kvl * c
    elif cand.kv_cache == "quantized":
        q = kv_element_bytes(cand.kv_bits)
        residual = min(c, KV_RESIDUAL)
        per_layer = residual * kvl + (c - residual) * kv_el * q
        per_layer_read = residual * kvl + _kv_read_bytes((c - residual) * kv_el, q, e)
        dev_kv, host_kv = nd * per_layer, nh * per_layer
        dev_scratch_kv = c * kvl if nd else 0  # one layer's dequantized copy at a time
        host_scratch_kv = c * kvl if nh else 0
        dev_read_kv, host_read_kv = nd * per_layer_read, nh * per_layer_read
    elif cand.kv_cache == "tiered":
        hot = min(c, cand.kv_hot_window)
        cold = c - hot
        cold_el = kv_element_bytes(cand.kv_cold_bits)
        dev_kv = nd * hot * kvl
        host_kv = nd * cold * kv_el * cold_el + nh * kvl * c
        dev_read_kv = nd * hot * kvl
        host_read_kv = nd * _kv_read_bytes(cold * kv_el, cold_el, e) + nh * kvl * c
        if cold_el != e:
            host_scratch_kv = cold * kvl
        bus += nd * (q_out_bytes + kvl)  # q and the partial result cross; one token is evicted
        round_trips += nd
    elif cand.kv_cache == "offloaded":
        host_kv = n * kvl * c
        dev_kv = 2 * kvl * c if nd else 0  # double-buffered staging of one layer
        dev_read_kv, host_read_kv = nd * kvl * c, nh * kvl * c
        bus += nd * (kvl * c + kvl)  # each device layer's KV comes over, its new token goes back
        round_trips += nd
    elif cand.kv_cache == "host":
        host_kv = n * kvl * c
        host_read_kv = n * kvl * c
        bus += nd * (q_out_bytes + kvl)
        round_trips += nd
    else:
        raise ConfigError(f"unknown KV strategy {cand.kv_cache!r}")

    hidden_hops = 0 if (all_dev or nd == 0 or cand.decode_on == "host") else 2
    bus += hidden_hops * cfg.hidden_size * e
    round_trips += 1 if hidden_hops else 0

    # -- memory per tier --
    scratch = scratch_bytes(cfg, e, prefill_chunk)
    dev_mem = dev_w + dev_kv + dev_scratch_kv + (scratch if nd else 0)
    host_mem = host_w + host_kv + host_scratch_kv + (scratch if nh or cand.decode_on == "host" else 0)
    if cpu_only:  # one pool: the device tier is the CPU's RAM too
        peak_device = int(dev_mem)
        peak_host = int(dev_mem + host_mem + HOST_RUNTIME_BYTES)
        device_overflow = 0
        host_overflow = max(0, peak_host - hw.host_budget)
    else:
        peak_device = int(dev_mem)
        peak_host = int(host_mem + HOST_RUNTIME_BYTES)
        # the engine evicts (or refuses) device KV once it crosses KV_THRESHOLD of what the weights leave
        kv_room = KV_THRESHOLD * (hw.device_budget - (dev_mem - dev_kv - dev_scratch_kv))
        device_overflow = max(0, peak_device - hw.device_budget, math.ceil(dev_kv + dev_scratch_kv - kv_room))
        host_overflow = max(0, peak_host - hw.host_budget)

    # -- decode time per token --
    dev_bytes = dev_read_w + dev_read_kv
    host_bytes = host_read_w + host_read_kv
    if cand.decode_on == "host":
        overhead = hw.host_token_overhead_s + n * hw.host_layer_overhead_s
    else:
        overhead = (hw.device_token_overhead_s + nd * hw.device_layer_overhead_s
                    + nh * hw.host_layer_overhead_s + round_trips * (0 if cpu_only else BUS_SYNC_S))
    t_dev = dev_bytes / hw.device_bandwidth
    t_host = host_bytes / hw.host_bandwidth
    t_bus = bus / hw.pcie_bandwidth
    t_token = t_dev + t_host + t_bus + overhead

    # -- prefill (TTFT) --
    ttft = prefill_seconds(cfg, cand, hw, p, e, prefill_chunk)

    return Prediction(
        decode_tps=1.0 / t_token,
        ttft_s=ttft,
        peak_device_bytes=peak_device,
        peak_host_bytes=peak_host,
        decode_s={"device": t_dev, "host": t_host, "bus": t_bus, "overhead": overhead},
        decode_bytes={"device": int(dev_bytes), "host": int(host_bytes), "bus": int(bus)},
        device_overflow=int(device_overflow),
        host_overflow=int(host_overflow),
    )


def prefill_flops(cfg: ModelConfig, prompt_tokens: int, prefill_chunk: int = 512) -> dict[str, float]:
    """FLOPs of a prefill, per layer (matrices + causal attention) and for the head."""
    p = prompt_tokens
    chunks = max(1, math.ceil(p / prefill_chunk))
    layer = 2 * layer_matrix_params(cfg) * p + 2 * cfg.n_heads * cfg.head_dim * p * (p + 1)
    head = 2 * cfg.vocab_size * cfg.hidden_size * chunks
    return {"layer": float(layer), "head": float(head), "chunks": float(chunks)}


def prefill_seconds(cfg: ModelConfig, cand: Candidate, hw: Hardware, prompt_tokens: int, compute_bytes: int,
                    prefill_chunk: int = 512) -> float:
    """TTFT: compute-bound prefill, plus the bus for layers whose weights live on the host."""
    n, nd = cfg.n_layers, cand.n_device_layers
    nh = n - nd
    f = prefill_flops(cfg, prompt_tokens, prefill_chunk)
    chunks = f["chunks"]
    overhead = chunks * (hw.device_token_overhead_s + nd * hw.device_layer_overhead_s
                         + nh * hw.host_layer_overhead_s)
    if not hw.has_device:
        return (n * f["layer"] + f["head"]) / hw.host_flops + overhead
    wb = weight_bytes(cfg, cand.weight_format)
    kvl = 2 * cfg.n_kv_heads * cfg.head_dim * compute_bytes
    seconds = n * f["layer"] / hw.device_flops + overhead
    # host layers: weights stream to the device once per chunk; their KV goes back to the host
    seconds += chunks * nh * wb.layer / hw.pcie_bandwidth + nh * kvl * prompt_tokens / hw.pcie_bandwidth
    seconds += f["head"] / (hw.device_flops if nd == n else hw.host_flops)
    # the device layers' KV moves to the host: after prefill (decode on host) or as it is made
    if cand.decode_on == "host" or cand.kv_cache in ("offloaded", "host"):
        seconds += nd * kvl * prompt_tokens / hw.pcie_bandwidth
    elif cand.kv_cache == "tiered":
        seconds += nd * kvl * max(0, prompt_tokens - cand.kv_hot_window) / hw.pcie_bandwidth
    return seconds


# ---- policy search ------------------------------------------------------------------------------
def device_only_max_context(cfg: ModelConfig, fmt: str, hw: Hardware, compute_dtype: str = "float16",
                            prefill_chunk: int = 512) -> int:
    """Largest context whose full-precision KV fits on the device next to every layer in ``fmt``
    (0 when the weights alone do not fit; capped at the model's context window).

    Without a GPU the device is the CPU and the budget is the RAM, less the runtime's bytes.
    """
    e = FLOAT_BYTES[compute_dtype]
    budget = hw.device_budget if hw.has_device else hw.host_budget - HOST_RUNTIME_BYTES
    free = budget - weight_bytes(cfg, fmt).total - scratch_bytes(cfg, e, prefill_chunk)
    if free <= 0:
        return 0
    if hw.has_device:
        free *= KV_THRESHOLD
    return min(cfg.max_position_embeddings, int(free // kv_bytes_per_token(cfg, compute_dtype)))


def _tiered_window(cfg: ModelConfig, fmt: str, nd: int, hw: Hardware, context: int, e: int,
                   prefill_chunk: int) -> int:
    """Largest hot window (whole pages) whose KV fits on the device next to ``nd`` layers' weights."""
    wb = weight_bytes(cfg, fmt)
    dev_w = nd * wb.layer + (wb.embed + wb.head + wb.final_norm if nd == cfg.n_layers else 0)
    free = KV_THRESHOLD * (hw.device_budget - dev_w - scratch_bytes(cfg, e, prefill_chunk))
    per_token = nd * 2 * cfg.n_kv_heads * cfg.head_dim * e
    if free <= 0 or per_token == 0:
        return 0
    window = int(free // per_token) // PAGE_SIZE * PAGE_SIZE
    return min(window, (context // PAGE_SIZE) * PAGE_SIZE)


def candidates(cfg: ModelConfig, formats: list[str], hw: Hardware, context: int, compute_dtype: str,
               prefill_chunk: int = 512) -> list[Candidate]:
    """Every placement the search scores."""
    e = FLOAT_BYTES[compute_dtype]
    out: list[Candidate] = []
    layer_counts = range(cfg.n_layers + 1) if hw.has_device else [cfg.n_layers]
    for fmt in formats:
        for nd in layer_counts:
            out.append(Candidate(fmt, nd))
            out.append(Candidate(fmt, nd, "quantized", kv_bits=8))
            out.append(Candidate(fmt, nd, "quantized", kv_bits=4))
            if not hw.has_device or nd == 0:
                continue  # these only move KV between device and host
            window = _tiered_window(cfg, fmt, nd, hw, context, e, prefill_chunk)
            if PAGE_SIZE <= window < context:
                for cold_bits in (16, 4):
                    out.append(Candidate(fmt, nd, "tiered", kv_hot_window=window, kv_cold_bits=cold_bits))
            out.append(Candidate(fmt, nd, "offloaded"))
            out.append(Candidate(fmt, nd, "host"))
            out.append(Candidate(fmt, nd, decode_on="host"))
    return out


_COMPLEXITY = {"dynamic": 0, "quantized": 1, "tiered": 2, "offloaded": 3, "host": 3}


def _rank(cand: Candidate, pred: Prediction) -> tuple:
    """Sort key: faster first, then higher precision, then simpler."""
    return (-pred.decode_tps, -PRECISION_RANK[cand.weight_format], _COMPLEXITY[cand.kv_cache],
            cand.decode_on == "host", -cand.n_device_layers)


@dataclass
class PlanResult:
    """The planner's answer. :meth:`to_dict` is the ``plan --json`` object."""

    model: str
    context: int
    compute_dtype: str
    cpu_only: bool
    weights_bytes: dict[str, int]
    kv_bytes_per_token: dict[str, int]
    device_only_max_context: int
    candidate: Candidate
    placement: Placement
    prediction: Prediction
    fits: bool
    reason: str
    hardware: Hardware
    sources: dict[str, str] = field(default_factory=dict)  # where each machine figure came from
    alternatives: list[dict[str, Any]] = field(default_factory=list)

    @property
    def weight_format(self) -> str:
        return self.candidate.weight_format

    def to_dict(self) -> dict[str, Any]:
        hw = self.hardware
        return {
            "model": self.model,
            "context": self.context,
            "weights_bytes": self.weights_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "device_only_max_context": self.device_only_max_context,
            "placement": self.placement.to_dict(),
            "weight_format": self.weight_format,
            "compute_dtype": self.compute_dtype,
            "predicted": self.prediction.to_dict(),
            "fits": self.fits,
            "reason": self.reason,
            "decode_breakdown_s": self.prediction.decode_s,
            "decode_bytes_per_token": self.prediction.decode_bytes,
            "machine": {
                "cpu_only": self.cpu_only,
                "device_budget_bytes": hw.device_budget if hw.has_device else None,
                "host_budget_bytes": hw.host_budget,
                "device_bandwidth_gbs": hw.device_bandwidth / GB,
                "host_bandwidth_gbs": hw.host_bandwidth / GB,
                "pcie_bandwidth_gbs": None if math.isinf(hw.pcie_bandwidth) else hw.pcie_bandwidth / GB,
                "device_tflops": hw.device_flops / 1e12,
                "host_tflops": hw.host_flops / 1e12,
                "device_layer_overhead_s": hw.device_layer_overhead_s,
                "host_layer_overhead_s": hw.host_layer_overhead_s,
                "sources": self.sources,
            },
            "alternatives": self.alternatives,
        }


def to_placement(cfg: ModelConfig, cand: Candidate, hw: Hardware) -> Placement:
    """The ``Placement`` of a candidate (the CPU-only placement has every tier on "device")."""
    kv = KVConfig(
        kv_cache="dynamic" if cand.decode_on == "host" else cand.kv_cache,
        kv_bits=cand.kv_bits,
        kv_hot_window=cand.kv_hot_window or KVConfig.kv_hot_window,
        kv_cold_bits=cand.kv_cold_bits,
        vram_budget=hw.device_budget if hw.has_device else None,
    )
    # q4_k_m is a file format: "auto" keeps a Q4_K_M file's own weights
    weights = {"int8": "int8", "int4": "int4", "q4_k_m": "auto"}.get(cand.weight_format, "float")
    if not hw.has_device:
        return Placement.all_on_device(cfg.n_layers, kv=kv, weights=weights)
    return Placement.from_n_gpu_layers(cfg.n_layers, cand.n_device_layers, kv=kv, decode_on=cand.decode_on,
                                       weights=weights)


def fmt_bytes(n: float) -> str:
    """Bytes as GB (1e9) with the exact count, e.g. '4.39 GB'."""
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB" if abs(n) >= 1e3 else f"{int(n)} B"


def plan(cfg: ModelConfig, hw: Hardware, context: int, compute_dtype: str = "float16",
         formats: list[str] | None = None, prefill_chunk: int = 512, model_name: str = "",
         sources: dict[str, str] | None = None) -> PlanResult:
    """Choose the placement with the fastest predicted decode that fits ``hw``'s budgets at ``context``.

    Raises:
        PlanError: the weights alone (in the smallest allowed format) exceed RAM + VRAM, or the
            inputs are invalid.
    """
    if compute_dtype not in FLOAT_BYTES:
        raise ConfigError(f"unsupported compute dtype {compute_dtype!r}; use one of {', '.join(FLOAT_BYTES)}")
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    if context > cfg.max_position_embeddings:
        raise ConfigError(f"--context {context} exceeds the model's context window of "
                          f"{cfg.max_position_embeddings} tokens")
    formats = list(formats or _default_formats(compute_dtype))
    for fmt in formats:
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"unknown weight format {fmt!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    smallest = min(formats, key=lambda f: weight_bytes(cfg, f).total)
    need = weight_bytes(cfg, smallest).total
    have = hw.host_budget + (hw.device_budget if hw.has_device else 0)
    if need > have:
        what = "RAM + VRAM" if hw.has_device else "RAM"
        budgets = (f"{hw.host_budget} + {hw.device_budget} bytes" if hw.has_device else f"{hw.host_budget} bytes")
        raise PlanError(
            f"impossible plan: the weights alone need {need} bytes ({fmt_bytes(need)}, {smallest}, the smallest "
            f"format allowed) but {what} is {budgets}: short by {need - have} bytes ({fmt_bytes(need - have)})"
        )

    scored = [(cand, predict(cfg, cand, hw, context, compute_dtype, prefill_chunk=prefill_chunk))
              for cand in candidates(cfg, formats, hw, context, compute_dtype, prefill_chunk)]
    fitting = sorted(((c, p) for c, p in scored if p.fits), key=lambda cp: _rank(*cp))
    if fitting:
        best, pred = fitting[0]
        fits = True
        reason = _reason(cfg, best, pred, fitting, hw, context, compute_dtype)
    else:
        best, pred = min(scored, key=lambda cp: (cp[1].device_overflow + cp[1].host_overflow, _rank(*cp)))
        fits = False
        parts = []
        if pred.device_overflow:
            parts.append(f"{pred.device_overflow} bytes ({fmt_bytes(pred.device_overflow)}) more device memory")
        if pred.host_overflow:
            parts.append(f"{pred.host_overflow} bytes ({fmt_bytes(pred.host_overflow)}) more RAM")
        reason = (f"no placement fits {context} tokens: the closest ({best.describe(cfg, hw.has_device)}) needs "
                  f"{' and '.join(parts)}; lower --context or allow smaller formats (--weights, KV quantization)")

    best_fmt = best.weight_format
    alternatives = []
    for fmt in formats:  # the best plan of each format, for the reader's comparison
        options = [(c, p) for c, p in fitting if c.weight_format == fmt]
        if options:
            c, p = options[0]
            alternatives.append({"weight_format": fmt, "description": c.describe(cfg, hw.has_device),
                                 "decode_tps": p.decode_tps, "ttft_s": p.ttft_s})
    return PlanResult(
        model=model_name or cfg.name or cfg.arch,
        context=context,
        compute_dtype=compute_dtype,
        cpu_only=not hw.has_device,
        weights_bytes=weights_bytes_by_format(cfg),
        kv_bytes_per_token=kv_bytes_by_dtype(cfg),
        device_only_max_context=device_only_max_context(cfg, best_fmt, hw, compute_dtype, prefill_chunk),
        candidate=best,
        placement=to_placement(cfg, best, hw),
        prediction=pred,
        fits=fits,
        reason=reason,
        hardware=hw,
        sources=dict(sources or {}),
        alternatives=alternatives,
    )


def _default_formats(compute_dtype: str) -> list[str]:
    """Weight formats searched by default: the compute dtype's float format and the quantized ones."""
    return [compute_dtype, "int8", "int4", "q4_k_m"]


def _reason(cfg: ModelConfig, best: Candidate, pred: Prediction, fitting: list[tuple[Candidate, Prediction]],
            hw: Hardware, context: int, compute_dtype: str) -> str:
    """One paragraph: what was chosen, what bounds its speed, and the best plan that keeps more precision."""
    split = pred.decode_s
    memory = "device memory" if hw.has_device else "memory bandwidth (RAM)"
    bound = max((memory, split["device"]), ("host memory", split["host"]), ("the bus", split["bus"]),
                ("fixed per-step overhead", split["overhead"]), key=lambda kv: kv[1])[0]
    where = "CPU only (no GPU: the CPU stands in for the device)" if not hw.has_device else ""
    text = (f"{where + '; ' if where else ''}fastest that fits {context} tokens: {best.describe(cfg, hw.has_device)}; "
            f"decode reads {fmt_bytes(pred.decode_bytes['device'] + pred.decode_bytes['host'])} per token, "
            f"bound by {bound}")
    better = [(c, p) for c, p in fitting if PRECISION_RANK[c.weight_format] > PRECISION_RANK[best.weight_format]]
    if better:  # the fastest plan of the most precise format that fits
        top = max(PRECISION_RANK[c.weight_format] for c, _ in better)
        c, p = next((c, p) for c, p in better if PRECISION_RANK[c.weight_format] == top)
        text += (f"; keeping {c.weight_format} weights would give {p.decode_tps:.1f} tok/s "
                 f"({c.describe(cfg, hw.has_device)}; pin it with --weights {c.weight_format})")
    return text


# ---- inputs from files and the probe ------------------------------------------------------------
def load_model_config(model: str | Path | None) -> tuple[ModelConfig, str, bool]:
    """(config, display name, whether it has weights) of a GGUF file, an HF folder or a config.json.

    A ``config.json`` (or a folder holding only one) gives the numbers without any weights.
    """
    from hybridllm.errors import ModelLoadError
    from hybridllm.loading.registry import default_model_path, open_checkpoint

    if model is None:
        path = default_model_path()
        return open_checkpoint(path).config, path.name, True
    path = Path(model).expanduser()
    config_file = None
    if path.suffix == ".json":
        config_file = path
    elif path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        config_file = path / "config.json"
    if config_file is None:
        return open_checkpoint(path).config, path.name, True
    try:
        data = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model config not found: {config_file}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        cfg = ModelConfig.from_hf_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ModelLoadError(f"{config_file}: not a Hugging Face model config ({type(exc).__name__}: {exc})") from None
    return cfg, config_file.name if config_file.name != "config.json" else config_file.parent.name, False


def hardware_from(profile: Any | None, vram: int | None = None, ram: int | None = None,
                  device_bandwidth_gbs: float | None = None, pcie_gbs: float | None = None,
                  host_bandwidth_gbs: float | None = None, device_tflops: float | None = None
                  ) -> tuple[Hardware, dict[str, str]]:
    """Combine a ``MachineProfile`` (or None) with explicit figures; say where each came from.

    A GPU is planned for when one was probed or ``vram`` is given; otherwise the CPU stands in.
    """
    sources: dict[str, str] = {}

    def pick(name: str, given: float | None, probed: float | None, default: float, unit: float = 1.0) -> float:
        if given is not None:
            sources[name] = "given"
            return given * unit
        if probed:
            sources[name] = "probed"
            return probed * unit
        sources[name] = "assumed"
        return default * unit

    gpu = getattr(profile, "gpu", None)
    host_bw = pick("host_bandwidth", host_bandwidth_gbs, getattr(profile, "host_bandwidth_gbs", None),
                   DEFAULT_HOST_BANDWIDTH_GBS, GB)
    host_flops = pick("host_flops", None, getattr(profile, "model_flops", None) or getattr(profile, "host_flops", None),
                      DEFAULT_HOST_GFLOPS * 1e9)
    host_layer = pick("host_layer_overhead", None, getattr(profile, "host_layer_overhead_s", None),
                      DEFAULT_HOST_LAYER_OVERHEAD_S)
    host_token = pick("host_token_overhead", None, getattr(profile, "host_token_overhead_s", None),
                      DEFAULT_HOST_TOKEN_OVERHEAD_S)
    if ram is None:
        ram = (profile.ram_budget_bytes or None) if profile is not None else None
        sources["ram"] = "available" if ram is not None else "unknown"
        if ram is None:
            raise ConfigError("no RAM budget: give --ram (e.g. --ram 32GiB)")
    else:
        sources["ram"] = "given"
    has_device = gpu is not None or vram is not None
    if not has_device:
        for name in ("device_bandwidth", "pcie_bandwidth", "device_flops"):
            sources.pop(name, None)
        return Hardware.cpu_only(ram, host_bw, host_flops, host_layer, host_token), sources
    if vram is None:
        vram = gpu.vram_free_bytes
        sources["vram"] = "free"
    else:
        sources["vram"] = "given"
    return Hardware(
        has_device=True,
        device_budget=vram,
        host_budget=ram,
        device_bandwidth=pick("device_bandwidth", device_bandwidth_gbs,
                              getattr(gpu, "model_gemv_gbs", None) or getattr(gpu, "bandwidth_gbs", None),
                              DEFAULT_DEVICE_BANDWIDTH_GBS, GB),
        host_bandwidth=host_bw,
        pcie_bandwidth=pick("pcie_bandwidth", pcie_gbs, getattr(gpu, "pcie_gbs", None), DEFAULT_PCIE_GBS, GB),
        device_flops=pick("device_flops", device_tflops, getattr(gpu, "model_flops", None) or getattr(gpu, "flops", None),
                          DEFAULT_DEVICE_TFLOPS * 1e12, 1e12 if device_tflops is not None else 1.0),
        host_flops=host_flops,
        device_layer_overhead_s=pick("device_layer_overhead", None, getattr(gpu, "layer_overhead_s", None),
                                     DEFAULT_DEVICE_LAYER_OVERHEAD_S),
        host_layer_overhead_s=host_layer,
        device_token_overhead_s=pick("device_token_overhead", None, getattr(gpu, "token_overhead_s", None),
                                     DEFAULT_DEVICE_TOKEN_OVERHEAD_S),
        host_token_overhead_s=host_token,
    ), sources


def engine_weight_formats(compute_dtype: str) -> list[str]:
    """Weight formats ``LLM`` can run: the compute dtype, and int8/int4 where ``LLM`` takes ``weights=``
    (quantized linear kernels); q4_k_m is a file format that is never kept as such."""
    import inspect

    from hybridllm.llm import LLM

    if "weights" in inspect.signature(LLM.__init__).parameters:
        return [compute_dtype, "int8", "int4"]
    return [compute_dtype]


def predicted_for_run(result: PlanResult, cfg: ModelConfig, prompt_tokens: int, generated_tokens: int,
                      prefill_chunk: int = 512) -> dict[str, Any]:
    """The plan's prediction re-evaluated at a run's own lengths (decode at the mean cache length)."""
    context = prompt_tokens + max(0, generated_tokens) // 2
    pred = predict(cfg, result.candidate, result.hardware, context, result.compute_dtype,
                   prompt_tokens=prompt_tokens, prefill_chunk=prefill_chunk)
    out = pred.to_dict()
    out["context"] = context
    out["decode_breakdown_s"] = pred.decode_s
    return out


__all__ = [
    "KV_DTYPES",
    "WEIGHT_FORMATS",
    "Candidate",
    "Hardware",
    "PlanError",
    "PlanResult",
    "Prediction",
    "WeightBytes",
    "candidates",
    "device_only_max_context",
    "hardware_from",
    "kv_bytes_per_token",
    "load_model_config",
    "matrix_bytes",
    "plan",
    "predict",
    "weight_bytes",
]
