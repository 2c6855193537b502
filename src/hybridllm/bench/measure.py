"""The method every engine is measured with, so their rows compare.

- The prompt has exactly ``context`` tokens, the same ids for every engine: a fixed text
  repeated, tokenized by our tokenizer of the model, cut to ``context`` ids.
- Prefill: time from the start of the request to the first generated token (TTFT);
  prefill tokens/s = context / TTFT.
- Decode: the intervals between consecutive generated tokens; decode tokens/s = intervals /
  their sum; TPOT p50/p99 are percentiles of the intervals. Greedy, end-of-sequence ignored,
  exactly ``new_tokens`` tokens.
- Peak host memory: the process's resident-set high-water mark over the request (it includes
  the resident weights). Repeats report the median of each figure and its spread (max - min);
  memory figures are the maximum over the repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridllm.engine.metrics import RequestMetrics

PROMPT_TEXT = (
    "The history of computing is a story of moving data to where the work happens. Early machines kept "
    "their programs on punched cards and their numbers in mercury delay lines; later ones added caches, "
    "then caches for the caches. A language model is no different: its weights and its memory of the "
    "conversation must sit close to the arithmetic units, or every step waits for the bus. "
)
# Figures that get a median and a spread over the repeats.
TIMED = ("prefill_tps", "ttft_s", "decode_tps", "tpot_p50_s", "tpot_p99_s", "tpot_mean_s")


def prompt_ids(encode: Callable[[str], list[int]], n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` ids: ``PROMPT_TEXT`` repeated until long enough, encoded, cut."""
    first = encode(PROMPT_TEXT)
    if not first:
        raise ValueError("the tokenizer turned the benchmark text into no tokens")
    text = PROMPT_TEXT * (n_tokens // max(1, len(first)) + 2)
    ids = encode(text)
    while len(ids) < n_tokens:  # merges at the seams can make the text a little shorter than estimated
        text += PROMPT_TEXT * 4
        ids = encode(text)
    return ids[:n_tokens]


def synthetic_prompt_ids(vocab_size: int, n_tokens: int, seed: int = 0) -> list[int]:
    """Deterministic ids for models without a tokenizer (random weights)."""
    return [(seed + 7919 * i + 104729) % vocab_size for i in range(n_tokens)]


class PeerUnavailable(Exception):
    """A peer engine, or the feature a configuration asks of it, is not available here."""


@dataclass
class RunRecord:
    """One measured request: its timings and memory figures."""

    prompt_tokens: int
    ttft_s: float
    intervals_s: list[float]
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    kv_bytes: dict[str, int | None] = field(default_factory=lambda: {"device": None, "host": None})
    bus_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The timing figures by the engine's own formulas (``RequestMetrics``), plus memory."""
        figures = RequestMetrics(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=len(self.intervals_s) + 1,
            ttft_s=self.ttft_s,
            token_intervals_s=list(self.intervals_s),
        ).to_dict()
        return {
            **{k: figures[k] for k in TIMED},
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": figures["generated_tokens"],
            "peak_host_bytes": self.peak_host_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "kv_bytes": dict(self.kv_bytes),
            "bus_bytes": self.bus_bytes,
        }


def _max(values: Sequence[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (max - min) of the timed figures; maxima of the memory figures."""
    if not runs:
        raise ValueError("no runs to summarize")
    out: dict[str, Any] = {}
    for key in TIMED:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_spread"] = (max(values) - min(values)) if values else None
    for key in ("peak_host_bytes", "peak_device_bytes", "bus_bytes", "prompt_tokens", "generated_tokens"):
        out[key] = _max([r.get(key) for r in runs])
    out["kv_bytes"] = {tier: _max([(r.get("kv_bytes") or {}).get(tier) for r in runs]) for tier in ("device", "host")}
    return out
