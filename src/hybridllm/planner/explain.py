"""The planner's explanation: the result object, its ``plan --json`` form and the one-paragraph reason."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import ModelConfig
from hybridllm.placement.placement import Placement
from hybridllm.planner.memory import GB, PRECISION_RANK
from hybridllm.planner.roofline import Candidate, Hardware, Prediction
from hybridllm.units import format_bytes


def gb(n: float) -> str:
    """Bytes in decimal units (next to the GB/s figures of the plan): ``4.39 GB``."""
    return format_bytes(n, 2, decimal=True)


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


def fitting_reason(cfg: ModelConfig, best: Candidate, pred: Prediction, fitting: list[tuple[Candidate, Prediction]],
                   hw: Hardware, context: int) -> str:
    """One paragraph: what was chosen, what bounds its speed, and the best plan that keeps more precision."""
    split = pred.decode_s
    memory = "device memory" if hw.has_device else "memory bandwidth (RAM)"
    bound = max((memory, split["device"]), ("host memory", split["host"]), ("the bus", split["bus"]),
                ("fixed per-step overhead", split["overhead"]), key=lambda kv: kv[1])[0]
    where = "CPU only (no GPU: the CPU stands in for the device)" if not hw.has_device else ""
    text = (f"{where + '; ' if where else ''}fastest that fits {context} tokens: {best.describe(cfg, hw.has_device)}; "
            f"decode reads {gb(pred.decode_bytes['device'] + pred.decode_bytes['host'])} per token, "
            f"bound by {bound}")
    better = [(c, p) for c, p in fitting if PRECISION_RANK[c.weight_format] > PRECISION_RANK[best.weight_format]]
    if better:  # the fastest plan of the most precise format that fits
        top = max(PRECISION_RANK[c.weight_format] for c, _ in better)
        c, p = next((c, p) for c, p in better if PRECISION_RANK[c.weight_format] == top)
        text += (f"; keeping {c.weight_format} weights would give {p.decode_tps:.1f} tok/s "
                 f"({c.describe(cfg, hw.has_device)}; pin it with --weights {c.weight_format})")
    return text


def overflow_reason(cfg: ModelConfig, closest: Candidate, pred: Prediction, hw: Hardware, context: int) -> str:
    """Why nothing fits: by how much the closest candidate overflows, and what to change."""
    parts = []
    if pred.device_overflow:
        parts.append(f"{pred.device_overflow} bytes ({gb(pred.device_overflow)}) more device memory")
    if pred.host_overflow:
        parts.append(f"{pred.host_overflow} bytes ({gb(pred.host_overflow)}) more RAM")
    return (f"no placement fits {context} tokens: the closest ({closest.describe(cfg, hw.has_device)}) needs "
            f"{' and '.join(parts)}; lower --context or allow smaller formats (--weights, KV quantization)")


def alternatives(cfg: ModelConfig, formats: list[str], fitting: list[tuple[Candidate, Prediction]],
                 hw: Hardware) -> list[dict[str, Any]]:
    """The best fitting plan of each format, for the reader's comparison."""
    out = []
    for fmt in formats:
        options = [(c, p) for c, p in fitting if c.weight_format == fmt]
        if options:
            c, p = options[0]
            out.append({"weight_format": fmt, "description": c.describe(cfg, hw.has_device),
                        "decode_tps": p.decode_tps, "ttft_s": p.ttft_s})
    return out
