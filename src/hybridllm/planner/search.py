"""The policy search: score every candidate placement and pick the fastest that fits.

Candidates: weight format x layers on the device (0..n) x KV strategy (dynamic; quantized
int8/int4; tiered with the largest hot window that fits, cold pages 16 or 4 bits; offloaded;
host) x decode tier (device, or host: prefill on the device then decode on a host copy of the
weights). The fastest predicted decode that fits both budgets at the requested context wins;
ties go to the higher-precision format and fewer moving parts. Without a GPU the CPU stands in
for the device: one memory pool, every layer on the "device" tier, and the strategies that only
move KV between tiers are the same as ``dynamic``, so they are skipped.
"""

from __future__ import annotations

from typing import Any

from hybridllm.config import KVConfig, ModelConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.registry import get_strategy
from hybridllm.models.quantized import WEIGHT_MODES
from hybridllm.placement.placement import Placement
from hybridllm.planner.explain import PlanResult, alternatives, fitting_reason, gb, overflow_reason
from hybridllm.planner.memory import (
    FLOAT_BYTES,
    HOST_RUNTIME_BYTES,
    KV_THRESHOLD,
    PAGE_SIZE,
    PRECISION_RANK,
    WEIGHT_FORMATS,
    kv_bytes_by_dtype,
    kv_bytes_per_token,
    scratch_bytes,
    weight_bytes,
    weights_bytes_by_format,
)
from hybridllm.planner.roofline import Candidate, Hardware, Prediction, predict


class PlanError(ConfigError):
    """A plan that cannot exist (e.g. the weights alone exceed RAM + VRAM)."""


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


def _rank(cand: Candidate, pred: Prediction) -> tuple:
    """Sort key: faster first, then higher precision, then simpler."""
    return (-pred.decode_tps, -PRECISION_RANK[cand.weight_format], get_strategy(cand.kv_cache).moving_parts,
            cand.decode_on == "host", -cand.n_device_layers)


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
            f"impossible plan: the weights alone need {need} bytes ({gb(need)}, {smallest}, the smallest "
            f"format allowed) but {what} is {budgets}: short by {need - have} bytes ({gb(need - have)})"
        )

    scored = [(cand, predict(cfg, cand, hw, context, compute_dtype, prefill_chunk=prefill_chunk))
              for cand in candidates(cfg, formats, hw, context, compute_dtype, prefill_chunk)]
    fitting = sorted(((c, p) for c, p in scored if p.fits), key=lambda cp: _rank(*cp))
    if fitting:
        best, pred = fitting[0]
        reason = fitting_reason(cfg, best, pred, fitting, hw, context)
    else:
        best, pred = min(scored, key=lambda cp: (cp[1].device_overflow + cp[1].host_overflow, _rank(*cp)))
        reason = overflow_reason(cfg, best, pred, hw, context)
    return PlanResult(
        model=model_name or cfg.name or cfg.arch,
        context=context,
        compute_dtype=compute_dtype,
        cpu_only=not hw.has_device,
        weights_bytes=weights_bytes_by_format(cfg),
        kv_bytes_per_token=kv_bytes_by_dtype(cfg),
        device_only_max_context=device_only_max_context(cfg, best.weight_format, hw, compute_dtype, prefill_chunk),
        candidate=best,
        placement=to_placement(cfg, best, hw),
        prediction=pred,
        fits=bool(fitting),
        reason=reason,
        hardware=hw,
        sources=dict(sources or {}),
        alternatives=alternatives(cfg, formats, fitting, hw),
    )


def _default_formats(compute_dtype: str) -> list[str]:
    """Weight formats searched by default: the compute dtype's float format and the quantized ones."""
    return [compute_dtype, "int8", "int4", "q4_k_m"]


def engine_weight_formats(compute_dtype: str) -> list[str]:
    """Weight formats the engine can run: the compute dtype, and the quantized weight modes it keeps
    in memory (int8/int4); q4_k_m is a file format that is never kept as such."""
    return [compute_dtype, *(mode for mode in WEIGHT_MODES if mode in WEIGHT_FORMATS)]


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
