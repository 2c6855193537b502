"""One finished sequence's record: the figures ``generate --json``, the bench and the API report."""

from __future__ import annotations

from typing import Any

from hybridllm.engine.drafting import SpecStats
from hybridllm.engine.metrics import RequestMetrics
from hybridllm.engine.sequence import SequenceState


def sequence_metrics(seq: SequenceState, runtime: Any, peak_host_bytes: int, peak_device_bytes: int) -> dict[str, Any]:
    """The metrics of ``seq`` (before its caches are freed) on ``runtime``.

    Args:
        seq: the sequence, with every cache it used (the first one first).
        runtime: the built model (weight bytes, cold start, weight format).
        peak_host_bytes: the process's peak RSS while the sequence ran.
        peak_device_bytes: the device's peak (the CUDA allocator's, or the device tier's bytes
            when the CPU plays the device).
    """
    caches = seq.caches
    first = caches[0]
    bus = {direction: sum(c.bus_bytes[direction] for c in caches) for direction in ("h2d", "d2h")}
    bus["hidden_states"] = seq.hop_bytes
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.start_time
    spec_method = runtime.speculative.method if seq.params.speculative else "none"
    spec_stats = seq.speculation.stats if seq.speculation is not None else SpecStats()
    record = RequestMetrics(
        cold_start_s=runtime.cold_start.total_s,
        prompt_tokens=len(seq.prompt_ids),
        cached_tokens=seq.cached_tokens,
        generated_tokens=len(seq.generated),
        ttft_s=ttft,
        token_intervals_s=list(seq.token_intervals),
        peak_host_bytes=peak_host_bytes,
        peak_device_bytes=peak_device_bytes,
        extra={
            "kv_cache": first.name,
            "kv_bytes": first.bytes_per_tier(),
            "kv_peak_bytes": first.peak_bytes_per_tier(),
            "kv_pages_moved": sum(c.pages_moved for c in caches),
            "decode_on": "device" if len(caches) == 1 else "host",
            "migration_bytes": sum(c.bus_bytes["d2h"] for c in caches[1:]),
            "adaptive_actions": [str(action) for action in seq.actions],
            "bus_bytes": sum(bus.values()),
            "bus_bytes_detail": bus,
            "weight_bytes": dict(runtime.weight_bytes),
            "decode_weight_bytes": runtime.decode_weight_bytes,
            "weights_format": runtime.weights_format,
            **spec_stats.to_dict(spec_method),
        },
    )
    return record.to_dict()
