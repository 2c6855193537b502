"""``system_fingerprint``: which build of the engine answered (OpenAI's field).

Two servers share a fingerprint when they would compute the same tokens: the same hybridllm
version, weight format, dtype, device kind, placement and KV policy. Like OpenAI's, it is
meant to be compared between responses, not parsed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hybridllm import __version__

FINGERPRINT_PREFIX = "hl-"
FINGERPRINT_HEX_DIGITS = 10


def system_fingerprint(runtime: Any) -> str:
    """``"hl-" + a short hash`` of what decides the arithmetic of ``runtime`` (a built Runtime)."""
    engine = runtime.engine_config
    described = {
        "version": __version__,
        "weights_format": str(runtime.weights_format),
        "activations": str(runtime.activations),
        "dtype": str(engine.dtype),
        "device": str(engine.torch_device.type),
        "placement": dataclasses.asdict(runtime.placement),  # layer tiers, decode tier, the KV policy
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()
    return FINGERPRINT_PREFIX + digest[:FINGERPRINT_HEX_DIGITS]
