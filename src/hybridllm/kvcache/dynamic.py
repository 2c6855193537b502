"""``dynamic``: all KV on the compute device, in one buffer per layer grown by whole pages.

With ``tier="host"`` the same cache lives in host RAM: the KV of layers whose weights sit on the
host (``--n-gpu-layers``), and the cache that decoding continues in after phase migration. Each
layer's tokens are a :class:`~hybridllm.kvcache.storage.DenseKV`, the one store every dense KV
(device or host, every strategy) is kept in.
"""

from __future__ import annotations

import torch

from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.base import KVSpec, MemoryLedger
from hybridllm.kvcache.dense_in_place import DenseInPlaceCache
from hybridllm.kvcache.storage import DenseKV
from hybridllm.kvcache.strategy import KVCost, KVStrategy, dense_token_bytes, stored_dtype, stored_spec

DEFAULT_PAGE_SIZE = 128


class DynamicCache(DenseInPlaceCache):
    """Contiguous per-layer K/V buffers in one tier.

    Capacity is a multiple of ``page_size`` tokens and at least doubles when it grows, so the
    total copying over a generation is linear in its length (amortised O(1) per token), and
    :meth:`reserve` lets the loop allocate the whole request once.

    Args:
        spec: shapes, dtype and devices.
        ledger: the per-tier byte counter.
        page_size: buffers grow in multiples of this many tokens.
        tier: "device" keeps the buffers on ``spec.device``, "host" on ``spec.host_device``.
        kv_dtype: the dtype the tokens are stored in (default: the compute dtype). float16 under
            float32 compute halves the KV bytes; the native decode step reads it directly with
            float32 accumulation, PyTorch's attention (prefill) reads a float32 copy.
    """

    name = "dynamic"
    extendable = True

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 tier: str = "device", kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(spec, ledger)
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        self.page_size = page_size
        self.tier = tier
        self.storage_device = spec.device if tier == "device" else spec.host_device
        self.kv_dtype = spec.dtype if kv_dtype is None else kv_dtype
        self._stores = [DenseKV(self.ledger, tier, self.storage_device, spec, page_size, storage_dtype=self.kv_dtype)
                        for _ in range(spec.n_layers)]
        self._init_in_place()

    def capacity(self, layer_idx: int) -> int:
        return self._stores[layer_idx].capacity

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = [t for store in self._stores for t in store.tensors()]
        return {"device": held, "host": []} if self.tier == "device" else {"device": [], "host": held}

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._stores[layer_idx].read()  # (B, Hkv, length, D) each

    def reserve(self, n_tokens: int) -> None:
        """Allocate ``n_tokens`` per layer at once, or as many whole pages as the tier's budget allows."""
        n_tokens = min(n_tokens, self.spec.max_tokens)
        headroom = self.ledger.headroom(self.tier)
        if headroom is not None:
            page_bytes = self.page_size * self.spec.token_bytes() * self.spec.n_layers
            n_tokens = min(n_tokens, int(headroom // page_bytes) * self.page_size)
        for store in self._stores:
            store.reserve(n_tokens)

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        store = self._stores[layer_idx]
        past = self._advance(layer_idx, k_new.shape[2])
        store.append(k_new, v_new)  # grows first: the copy keeps the tokens cached so far
        keys, values = store.read()  # (B, Hkv, past+T, D): a sliding window masks the older keys
        options = self.spec.layer_options(layer_idx)
        return causal_attention(q, keys, values, query_start=past, scale=options.scale, softcap=options.softcap,
                                window=options.window)

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, moved_bytes: int = 0) -> None:
        """Append ``keys``/``values`` (B, Hkv, T, D) to a layer without attending (a cache being
        filled from another one, as in phase migration); ``moved_bytes`` of them crossed from the
        device tier to this host cache."""
        self._count_bus("d2h", moved_bytes)
        self._advance(layer_idx, keys.shape[2])
        self._stores[layer_idx].append(keys, values)

    def host_tokens(self, layer_idx: int) -> int:
        return self.length(layer_idx) if self.tier == "host" else 0

    def _release_from(self, length: int) -> None:
        for store in self._stores:
            if length == 0:
                store.release()
            elif store.length > length:
                store.truncate(length)  # the buffers stay; later tokens overwrite the rows


def dense_cost(tier: str, spec: KVSpec, n_tokens: int) -> KVCost:
    """Every layer's tokens in the compute dtype on one tier, read once per decode step."""
    held = spec.n_layers * n_tokens * dense_token_bytes(spec)
    return KVCost(memory={tier: held}, read={tier: held})


STRATEGY = KVStrategy(
    name="dynamic",
    tiers=("device",),
    build=lambda config, spec, ledger: DynamicCache(spec, ledger, page_size=config.kv_page_size,
                                                    kv_dtype=stored_dtype(config, spec)),
    token_bytes=lambda config, spec: {"device": spec.n_layers * dense_token_bytes(stored_spec(config, spec))},
    cost=lambda config, spec, n_tokens, query_bytes: dense_cost("device", stored_spec(config, spec), n_tokens),
    describe=lambda config: "dynamic KV",
    attention_options=True,
    native="dense rows, read and written in place",
)
