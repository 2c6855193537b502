"""What each request costs: TTFT, TPOT, throughput, peak memory per tier.

The CLI, the benchmark and the server all read these records (the cold start is
:class:`hybridllm.timing.ColdStart`). Times come from ``time.perf_counter``.
"""

from __future__ import annotations

import os
import resource
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil


class HostPeakMemory:
    """Peak resident set size of this process since the last :meth:`reset` (before the first:
    over the process's life).

    Uses the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs) when it
    can, and otherwise the sampled maximum of RSS at each :meth:`sample` call. Only
    :meth:`reset` touches the mark: building one (with an engine) leaves the load's peak for
    an outside reader of VmHWM to see.
    """

    _CLEAR_REFS = Path("/proc/self/clear_refs")
    _STATUS = Path("/proc/self/status")

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._sampled = self._process.memory_info().rss
        self._kernel_hwm = os.access(self._CLEAR_REFS, os.W_OK) and self._STATUS.exists()

    def _try_reset_kernel_hwm(self) -> bool:
        try:
            self._CLEAR_REFS.write_text("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        self._kernel_hwm = self._try_reset_kernel_hwm()
        self._sampled = self._process.memory_info().rss

    def sample(self) -> None:
        if not self._kernel_hwm:
            self._sampled = max(self._sampled, self._process.memory_info().rss)

    def peak(self) -> int:
        self.sample()
        if self._kernel_hwm:
            for line in self._STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return max(self._sampled, self._process.memory_info().rss)

    @staticmethod
    def lifetime_peak() -> int:
        """Peak RSS over the whole process life (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RequestMetrics:
    """The record of one request. ``to_dict`` gives the JSON keys the CLI and API promise."""

    cold_start_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied
    generated_tokens: int = 0
    ttft_s: float | None = None
    token_intervals_s: list[float] = field(default_factory=list)  # between consecutive tokens
    peak_host_bytes: int = 0
    peak_device_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific figures (KV tiers, bus)

    @property
    def decode_time_s(self) -> float:
        return sum(self.token_intervals_s)

    def to_dict(self) -> dict[str, Any]:
        intervals = self.token_intervals_s
        decode_s = self.decode_time_s
        out: dict[str, Any] = {
            "cold_start_s": self.cold_start_s,
            "ttft_s": self.ttft_s,
            "tpot_mean_s": statistics.fmean(intervals) if intervals else None,
            "tpot_p50_s": percentile(intervals, 50) if intervals else None,
            "tpot_p99_s": percentile(intervals, 99) if intervals else None,
            "decode_tps": len(intervals) / decode_s if decode_s > 0 else None,
            "prefill_tps": self.prompt_tokens / self.ttft_s if self.ttft_s else None,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "peak_host_bytes": self.peak_host_bytes,
            "peak_device_bytes": self.peak_device_bytes,
        }
        out.update(self.extra)
        return out

