"""``Placement``: the data that says where every weight and the KV cache live.

Tiers are named "device" and "host"; ``apply`` maps them to real devices (e.g. cuda:0 and cpu,
or cpu and cpu when the CPU stands in for the device), so a placement is machine-independent
and can be saved as JSON (``--placement FILE.json``).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError

TIER_NAMES = ("device", "host")


@dataclass
class Placement:
    """Per-layer weight tiers, embedding and head tiers, the KV policy, and the decode tier.

    Attributes:
        layer_tiers: tier of each decoder layer's weights (and its hot KV).
        embed_tier: tier of the token embedding.
        head_tier: tier of the final norm and the output head.
        kv: the KV cache policy.
        decode_on: "device", or "host" for phase migration (prefill on the device, then the KV
            moves to the host and decoding runs there on a host copy of the weights).
        weights: weight format ("auto", "float", "int8", "int4").
    """

    layer_tiers: list[str]
    embed_tier: str = "device"
    head_tier: str = "device"
    kv: KVConfig = field(default_factory=KVConfig)
    decode_on: str = "device"
    weights: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kv, dict):
            self.kv = KVConfig(**self.kv)
        for tier in [*self.layer_tiers, self.embed_tier, self.head_tier, self.decode_on]:
            if tier not in TIER_NAMES:
                raise ConfigError(f"placement: unknown tier {tier!r}; tiers are 'device' and 'host'")
        if not self.layer_tiers:
            raise ConfigError("placement: layer_tiers is empty")

    @property
    def n_gpu_layers(self) -> int:
        return sum(t == "device" for t in self.layer_tiers)

    def describe(self, device: str) -> str:
        """Where the layers and decoding run, in words, for the device the "device" tier maps to:
        "30 layers on the CPU" when that is the CPU (both tiers are then the CPU), else e.g.
        "20/30 layers on cuda:0, 10 on the CPU, decode on cuda:0"."""
        n_layers = len(self.layer_tiers)
        if device.split(":")[0] == "cpu":
            return f"{n_layers} layers on the CPU"
        parts = [f"{self.n_gpu_layers}/{n_layers} layers on {device}"]
        if self.n_gpu_layers < n_layers:
            parts.append(f"{n_layers - self.n_gpu_layers} on the CPU")
        parts.append(f"decode on {'the CPU' if self.decode_on == 'host' else device}")
        return ", ".join(parts)

    @classmethod
    def all_on_device(cls, n_layers: int, **kwargs: Any) -> "Placement":
        return cls(layer_tiers=["device"] * n_layers, **kwargs)

    @classmethod
    def from_n_gpu_layers(cls, n_layers: int, n_gpu_layers: int, **kwargs: Any) -> "Placement":
        """llama.cpp's ``-ngl N``: the first N layers on the device, the rest on the host.

        The embedding stays on the host unless every layer is on the device; the head follows
        the last layer. N above the layer count is clamped with a warning.
        """
        if n_gpu_layers < 0:
            raise ConfigError(f"--n-gpu-layers must be >= 0, got {n_gpu_layers}")
        if n_gpu_layers > n_layers:
            warnings.warn(f"--n-gpu-layers {n_gpu_layers} is more than the model's {n_layers} layers; using {n_layers}",
                          stacklevel=2)
            n_gpu_layers = n_layers
        tiers = ["device"] * n_gpu_layers + ["host"] * (n_layers - n_gpu_layers)
        everything = n_gpu_layers == n_layers
        return cls(layer_tiers=tiers, embed_tier="device" if everything else "host",
                   head_tier=tiers[-1], **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kv"] = asdict(self.kv)
        return out

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, data: dict[str, Any], n_layers: int | None = None) -> "Placement":
        if not isinstance(data, dict) or "layer_tiers" not in data:
            raise ConfigError("placement: expected a JSON object with 'layer_tiers'")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"placement: unknown keys {sorted(unknown)}")
        try:
            placement = cls(**data)
        except TypeError as exc:
            raise ConfigError(f"placement: {exc}") from None
        return placement if n_layers is None else placement.check_layer_count(n_layers)

    def check_layer_count(self, n_layers: int) -> "Placement":
        """This placement, if it has one tier per layer of a model of ``n_layers`` layers."""
        if len(self.layer_tiers) != n_layers:
            raise ConfigError(f"placement: {len(self.layer_tiers)} layer tiers for a model of {n_layers} layers")
        return self

    @classmethod
    def load(cls, path: str | os.PathLike, n_layers: int | None = None) -> "Placement":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"placement file not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"placement file {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
        return cls.from_dict(data, n_layers)
