"""Timing primitives shared by every layer: the cold-start record and a device barrier.

Times come from ``time.perf_counter``; device work is synchronised (:func:`synchronize`)
before a timestamp is taken, so a time covers the work it names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ColdStart:
    """Model load split into its phases (seconds) and the bytes it produced."""

    read_s: float = 0.0  # disk -> host RAM
    dequantize_s: float = 0.0  # file format -> compute dtype
    to_device_s: float = 0.0  # host RAM -> the weights' devices
    tokenizer_s: float = 0.0
    host_copy_s: float = 0.0  # --decode-on host: the host copy of the device weights
    compile_s: float = 0.0  # the decode backend: native kernel build + weight copies, torch.compile warm-up
    draft_s: float = 0.0  # --model-draft: the draft model's whole load
    bytes_read: int = 0

    @property
    def total_s(self) -> float:
        """Seconds of the whole load, every phase summed."""
        return (self.read_s + self.dequantize_s + self.to_device_s + self.tokenizer_s + self.host_copy_s
                + self.compile_s + self.draft_s)

    def to_dict(self) -> dict[str, float]:
        """The phases and ``total_s``, as the CLI's ``--json`` prints them."""
        out = asdict(self)
        out["total_s"] = self.total_s
        return out
