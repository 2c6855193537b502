"""``dynamic``: all KV on the compute device, in one buffer per layer grown by whole pages.

With ``tier="host"`` the same cache lives in host RAM: the KV of layers whose weights sit on the
host (``--n-gpu-layers``), and the cache that decoding continues in after phase migration.
"""

from __future__ import annotations

import torch

from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.base import InPlaceSlot, KVCache, KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.strategy import KVCost, KVStrategy, dense_token_bytes

DEFAULT_PAGE_SIZE = 128


class DynamicCache(KVCache):
    """Contiguous per-layer K/V buffers on the device.

    Capacity is a multiple of ``page_size`` tokens and at least doubles when it grows, so the
    total copying over a generation is linear in its length (amortised O(1) per token), and
    :meth:`reserve` lets the generator allocate the whole request once.

    Args:
        spec: shapes, dtype and devices.
        ledger: the per-tier byte counter.
        page_size: buffers grow in multiples of this many tokens.
        tier: "device" keeps the buffers on ``spec.device``, "host" on ``spec.host_device``.
    """

    name = "dynamic"

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 tier: str = "device") -> None:
        super().__init__(spec, ledger)
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        self.page_size = page_size
        self.tier = tier
        self.storage_device = spec.device if tier == "device" else spec.host_device
        self._k: list[torch.Tensor | None] = [None] * spec.n_layers  # each (B, Hkv, capacity, D)
        self._v: list[torch.Tensor | None] = [None] * spec.n_layers

    def capacity(self, layer_idx: int) -> int:
        buf = self._k[layer_idx]
        return 0 if buf is None else buf.shape[2]

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = [t for t in (*self._k, *self._v) if t is not None]
        return {"device": held, "host": []} if self.tier == "device" else {"device": [], "host": held}

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length(layer_idx)
        if self._k[layer_idx] is None:
            spec = self.spec
            empty = torch.empty((spec.batch_size, spec.n_kv_heads, 0, spec.head_dim), dtype=spec.dtype,
                                device=self.storage_device)
            return empty, empty
        return self._k[layer_idx][:, :, :n], self._v[layer_idx][:, :, :n]

    def reserve(self, n_tokens: int) -> None:
        """Allocate ``n_tokens`` per layer at once, or as many whole pages as the tier's budget allows."""
        n_tokens = min(n_tokens, self.spec.max_tokens)
        headroom = self.ledger.headroom(self.tier)
        if headroom is not None:
            page_bytes = self.page_size * self.spec.token_bytes() * self.spec.n_layers
            n_tokens = min(n_tokens, int(headroom // page_bytes) * self.page_size)
        for layer_idx in range(self.spec.n_layers):
            self._grow(layer_idx, n_tokens, exact=True)

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        n_new = k_new.shape[2]
        total = self.length(layer_idx) + n_new
        self._grow(layer_idx, total)  # before _advance: the copy keeps the tokens cached so far
        past = self._advance(layer_idx, n_new)
        k_buf, v_buf = self._k[layer_idx], self._v[layer_idx]
        k_buf[:, :, past:total] = k_new
        v_buf[:, :, past:total] = v_new
        return causal_attention(q, k_buf[:, :, :total], v_buf[:, :, :total], query_start=past)

    def supports_in_place(self, layer_idx: int) -> bool:
        spec = self.spec
        return self.storage_device.type == "cpu" and spec.batch_size == 1 and spec.dtype == torch.float32

    def in_place_slot(self, layer_idx: int, n_new: int) -> InPlaceSlot:
        self._grow(layer_idx, self.length(layer_idx) + n_new)
        past = self._advance(layer_idx, n_new)
        return InPlaceSlot(self._k[layer_idx], self._v[layer_idx], past)

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, moved_bytes: int = 0) -> None:
        """Append ``keys``/``values`` (B, Hkv, T, D) to a layer without attending (a cache being
        filled from another one, as in phase migration); ``moved_bytes`` of them crossed from the
        device tier to this host cache."""
        self._count_bus("d2h", moved_bytes)
        n_new = keys.shape[2]
        self._grow(layer_idx, self.length(layer_idx) + n_new)
        past = self._advance(layer_idx, n_new)
        self._k[layer_idx][:, :, past:past + n_new] = keys
        self._v[layer_idx][:, :, past:past + n_new] = values

    def host_tokens(self, layer_idx: int) -> int:
        return self.length(layer_idx) if self.tier == "host" else 0

    def _grow(self, layer_idx: int, needed: int, exact: bool = False) -> None:
        capacity = self.capacity(layer_idx)
        if needed <= capacity:
            return
        target = needed if exact else max(needed, 2 * capacity)
        pages = -(-target // self.page_size)
        new_capacity = min(pages * self.page_size, max(self.spec.max_tokens, needed))
        spec = self.spec
        shape = (spec.batch_size, spec.n_kv_heads, new_capacity, spec.head_dim)
        k_buf = torch.empty(shape, dtype=spec.dtype, device=self.storage_device)
        v_buf = torch.empty(shape, dtype=spec.dtype, device=self.storage_device)
        used = self._lengths[layer_idx]
        old_k, old_v = self._k[layer_idx], self._v[layer_idx]
        if old_k is not None:
            k_buf[:, :, :used] = old_k[:, :, :used]
            v_buf[:, :, :used] = old_v[:, :, :used]
            self.ledger.free(self.tier, tensor_bytes(old_k, old_v))
        self.ledger.allocate(self.tier, tensor_bytes(k_buf, v_buf))
        self._k[layer_idx], self._v[layer_idx] = k_buf, v_buf

    def _release_from(self, length: int) -> None:
        if length > 0:
            return  # keep the buffers; positions >= length are simply overwritten later
        for layer_idx in range(self.spec.n_layers):
            if self._k[layer_idx] is not None:
                self.ledger.free(self.tier, tensor_bytes(self._k[layer_idx], self._v[layer_idx]))
            self._k[layer_idx] = self._v[layer_idx] = None


def dense_cost(tier: str, spec: KVSpec, n_tokens: int) -> KVCost:
    """Every layer's tokens in the compute dtype on one tier, read once per decode step."""
    held = spec.n_layers * n_tokens * dense_token_bytes(spec)
    return KVCost(memory={tier: held}, read={tier: held})


STRATEGY = KVStrategy(
    name="dynamic",
    tiers=("device",),
    build=lambda config, spec, ledger: DynamicCache(spec, ledger, page_size=config.kv_page_size),
    token_bytes=lambda config, spec: {"device": spec.n_layers * dense_token_bytes(spec)},
    cost=lambda config, spec, n_tokens, query_bytes: dense_cost("device", spec, n_tokens),
    describe=lambda config: "dynamic KV",
)
