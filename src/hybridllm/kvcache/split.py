"""A cache split by layer: the KV of each layer lives where that layer's weights live.

With ``--n-gpu-layers N`` the first N layers compute on the device and keep their KV under the
configured strategy (dynamic, tiered, ...); the other layers compute on the host and keep their
KV in a host-tier :class:`~hybridllm.kvcache.dynamic.DynamicCache`, so attention always runs
where its data is and no KV crosses the bus. Both parts share one ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from hybridllm.kvcache.base import TIERS, InPlaceRows, KVCache, KVSpec, MemoryLedger, merge_in_place_rows
from hybridllm.kvcache.dynamic import DynamicCache


class SplitCache(KVCache):
    """Routes each layer to the cache of its tier, renumbering layers inside each part.

    Args:
        spec: the whole model's cache spec.
        layer_tiers: "device" or "host" per layer.
        ledger: shared by both parts.
        device_cache: builds the device part's cache from its spec (the configured strategy).
        page_size: growth unit of the host part.
    """

    def __init__(
        self,
        spec: KVSpec,
        layer_tiers: Sequence[str],
        ledger: MemoryLedger,
        device_cache: Callable[[KVSpec, MemoryLedger], KVCache],
        page_size: int,
    ) -> None:
        # The counters (bus bytes, pages moved, lengths) live in the parts: no KVCache.__init__.
        if len(layer_tiers) != spec.n_layers:
            raise ValueError(f"{len(layer_tiers)} layer tiers for {spec.n_layers} layers")
        self.spec, self.ledger = spec, ledger
        self.layer_tiers = list(layer_tiers)
        device_layers = [i for i, tier in enumerate(layer_tiers) if tier == "device"]
        host_layers = [i for i, tier in enumerate(layer_tiers) if tier == "host"]
        self.parts: list[KVCache] = []
        self._route: list[tuple[KVCache, int]] = [None] * spec.n_layers  # type: ignore[list-item]
        for layers, build in (
            (device_layers, lambda s: device_cache(s, ledger)),
            (host_layers, lambda s: DynamicCache(s, ledger, page_size=page_size, tier="host")),
        ):
            if not layers:
                continue
            attention = tuple(spec.attention[i] for i in layers) if spec.attention else ()
            part = build(replace(spec, n_layers=len(layers), attention=attention))
            self.parts.append(part)
            for local, layer_idx in enumerate(layers):
                self._route[layer_idx] = (part, local)
        self.device_part = self._route[device_layers[0]][0] if device_layers else None

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.device_part.name if self.device_part is not None else "dynamic"

    @property
    def bus_bytes(self) -> dict[str, int]:  # type: ignore[override]
        return {d: sum(part.bus_bytes[d] for part in self.parts) for d in ("h2d", "d2h")}

    @property
    def pages_moved(self) -> int:  # type: ignore[override]
        return sum(part.pages_moved for part in self.parts)

    # ---- the contract -------------------------------------------------------------------
    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        part, local = self._route[layer_idx]
        return part.attend(local, q, k_new, v_new)

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, local = self._route[layer_idx]
        return part.read_layer(local)

    @property
    def extendable(self) -> bool:  # type: ignore[override]
        return all(part.extendable for part in self.parts)

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        part, local = self._route[layer_idx]
        part.extend(local, keys, values)

    def host_tokens(self, layer_idx: int) -> int:
        part, local = self._route[layer_idx]
        return part.host_tokens(local)

    def supports_in_place(self, layer_idx: int) -> bool:
        part, local = self._route[layer_idx]
        return part.supports_in_place(local)

    def in_place_rows(self, layer_indices, n_new: int) -> InPlaceRows:
        """Each part's claim of its layers, merged into one description in the order given."""
        by_part: dict[int, tuple[KVCache, list[int], list[int]]] = {}
        for at, layer_idx in enumerate(layer_indices):
            part, local = self._route[layer_idx]
            entry = by_part.setdefault(id(part), (part, [], []))
            entry[1].append(at)
            entry[2].append(local)
        claims = [(at, part.in_place_rows(local, n_new)) for part, at, local in by_part.values()]
        return claims[0][1] if len(claims) == 1 else merge_in_place_rows(claims, len(layer_indices))

    def length(self, layer_idx: int) -> int:
        part, local = self._route[layer_idx]
        return part.length(local)

    @property
    def seq_length(self) -> int:
        return min(part.seq_length for part in self.parts)

    def reserve(self, n_tokens: int) -> None:
        for part in self.parts:
            part.reserve(n_tokens)

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {tier: [] for tier in TIERS}
        for part in self.parts:
            for tier, tensors in part.storage_tensors().items():
                out[tier].extend(tensors)
        return out

    def truncate(self, length: int) -> None:
        longest = [max(part.length(i) for i in range(part.spec.n_layers)) for part in self.parts]
        if length < 0 or length > max(longest):
            raise ValueError(f"cannot truncate a cache of {self.seq_length} tokens to {length}")
        for part, part_longest in zip(self.parts, longest):
            part.truncate(min(length, part_longest))

    def _release_from(self, length: int) -> None:  # truncate is delegated whole
        raise NotImplementedError
