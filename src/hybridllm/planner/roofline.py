"""The roofline predictor: decode TPS and TTFT of a candidate placement from bandwidths and FLOP rates.

Decode, per token, at ``c`` cached tokens::

    t_token = device_bytes / device_bandwidth + host_bytes / host_bandwidth
              + bus_bytes / pcie_bandwidth + token_overhead
              + n_device_layers * device_layer_overhead + n_host_layers * host_layer_overhead
              + bus_round_trips * BUS_SYNC_S

where ``device_bytes``/``host_bytes`` are the weights each tier reads for one token (every layer's
matrices, the final norm and the head; one embedding row is negligible) plus the KV each tier
reads, and ``bus_bytes`` is what crosses PCIe per token (hidden states at a device/host split,
plus what the KV strategy moves: q and partial outputs of host-side attention, KV streamed by
``offloaded``, new tokens evicted by ``tiered``). The KV figures are each strategy's declared
costs (:func:`~hybridllm.planner.memory.kv_cost`); a KV stored in another format than the
compute dtype is counted as materialised into a compute-dtype copy (quantized KV saves memory,
not decode traffic). Decode TPS = 1 / t_token. The overheads are the fixed per-step costs
measured by ``engine_probe.measure_layer_overhead``.

Prefill (TTFT) of ``p`` prompt tokens in chunks of ``prefill_chunk``: compute-bound::

    ttft = FLOPs / FLOP rate + host-layer weights over the bus (once per chunk)
           + host-layer KV over the bus + chunks * (token_overhead + layers * layer_overhead)

with FLOPs = 2 x matrix weights x p (layers) + 2 x heads x head_dim x p (p + 1) (causal
attention) + 2 x vocab x hidden per chunk (the head, last token only). With a GPU, layers on the
host have their weights streamed to the device for each chunk and computed there (the bus term);
with the CPU standing in for the device everything computes at the host rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridllm.config import KVConfig, ModelConfig
from hybridllm.kvcache.registry import get_strategy
from hybridllm.planner.memory import (
    FLOAT_BYTES,
    HOST_RUNTIME_BYTES,
    KV_THRESHOLD,
    kv_cost,
    layer_matrix_params,
    scratch_bytes,
    weight_bytes,
)

# Latency of one host<->device round trip with a stream synchronisation (PCIe + driver).
BUS_SYNC_S = 20e-6


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


@dataclass(frozen=True)
class Candidate:
    """One placement the search considers."""

    weight_format: str
    n_device_layers: int
    kv_cache: str = "dynamic"  # a registered KV strategy
    kv_bits: int = 8  # quantized
    kv_hot_window: int = 0  # tiered
    kv_cold_bits: int = 16  # tiered
    decode_on: str = "device"

    def kv_config(self) -> KVConfig:
        """The KV knobs of the device layers (the registry's defaults for the others)."""
        return KVConfig(kv_cache=self.kv_cache, kv_bits=self.kv_bits, kv_hot_window=self.kv_hot_window,
                        kv_cold_bits=self.kv_cold_bits)

    def describe(self, cfg: ModelConfig, has_device: bool) -> str:
        kv = get_strategy(self.kv_cache).describe(self.kv_config())
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

    # -- KV: the strategy's declared memory and traffic --
    kv = kv_cost(cfg, cand.kv_config(), nd, context, compute_dtype, cand.decode_on)
    dev_kv, host_kv = kv.memory["device"], kv.memory["host"]
    dev_scratch_kv, host_scratch_kv = kv.scratch["device"], kv.scratch["host"]
    bus, round_trips = kv.bus, kv.round_trips
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
    dev_bytes = dev_read_w + kv.read["device"]
    host_bytes = host_read_w + kv.read["host"]
    if cand.decode_on == "host":
        overhead = hw.host_token_overhead_s + n * hw.host_layer_overhead_s
    else:
        overhead = (hw.device_token_overhead_s + nd * hw.device_layer_overhead_s
                    + nh * hw.host_layer_overhead_s + round_trips * (0 if cpu_only else BUS_SYNC_S))
    t_dev = dev_bytes / hw.device_bandwidth
    t_host = host_bytes / hw.host_bandwidth
    t_bus = bus / hw.pcie_bandwidth
    t_token = t_dev + t_host + t_bus + overhead

    return Prediction(
        decode_tps=1.0 / t_token,
        ttft_s=prefill_seconds(cfg, cand, hw, p, compute_dtype, prefill_chunk),
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


def prefill_seconds(cfg: ModelConfig, cand: Candidate, hw: Hardware, prompt_tokens: int, compute_dtype: str,
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
    kvl = 2 * cfg.n_kv_heads * cfg.head_dim * FLOAT_BYTES[compute_dtype]
    seconds = n * f["layer"] / hw.device_flops + overhead
    # host layers: weights stream to the device once per chunk; their KV goes back to the host
    seconds += chunks * nh * wb.layer / hw.pcie_bandwidth + nh * kvl * prompt_tokens / hw.pcie_bandwidth
    seconds += f["head"] / (hw.device_flops if nd == n else hw.host_flops)
    # the device layers' KV that moves to the host: all of it after prefill (decode on the host),
    # else what the strategy sends there as the prompt is cached
    if cand.decode_on == "host":
        seconds += nd * kvl * prompt_tokens / hw.pcie_bandwidth
    else:
        seconds += kv_cost(cfg, cand.kv_config(), nd, prompt_tokens, compute_dtype).prefill_bus / hw.pcie_bandwidth
    return seconds
