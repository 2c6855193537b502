"""How many engine replicas a target load needs (``hybridllm plan --target-tokens-per-s``).

A replica (``hybridllm serve --ray --replicas N``) is one engine with the plan's placement; the
planner predicts its decode rate for one sequence at the planned context. Batching makes a
replica give more than that in all, so dividing the target by it gives an upper bound: the count
that meets the target even when requests arrive one at a time per replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridllm.errors import ConfigError


@dataclass(frozen=True)
class Capacity:
    """The replicas for a target rate of generated tokens.

    Args:
        target_tokens_per_s: decode tokens per second the whole service must give.
        replica_tokens_per_s: the planner's decode rate of one replica (one sequence).
    """

    target_tokens_per_s: float
    replica_tokens_per_s: float

    def __post_init__(self) -> None:
        if not self.target_tokens_per_s > 0:
            raise ConfigError(f"--target-tokens-per-s must be > 0, got {self.target_tokens_per_s}")
        if not self.replica_tokens_per_s > 0:
            raise ConfigError("the plan predicts no decode rate for a replica; no replica count follows from it")

    @property
    def replicas(self) -> int:
        """The engine replicas that give the target at the single-sequence rate (at least 1)."""
        return max(1, math.ceil(self.target_tokens_per_s / self.replica_tokens_per_s - 1e-9))

    def to_dict(self) -> dict[str, Any]:
        return {"target_tokens_per_s": self.target_tokens_per_s, "replica_decode_tps": self.replica_tokens_per_s,
                "replicas": self.replicas}

    def describe(self) -> str:
        return (f"{self.replicas} replica(s) for {self.target_tokens_per_s:g} tok/s at {self.replica_tokens_per_s:.1f} "
                f"tok/s each (one sequence; batching gives more): serve --ray --replicas {self.replicas}")
