"""``host``: every token's KV, and the attention over it, on the host (CPU decode).

A prefill chunk on a GPU is the exception: its many queries attend on the device, the stored
rows crossing slice by slice (:mod:`hybridllm.kvcache.device_site`; plain layers only: a
layer with its own scale, soft-cap or window attends on the host).

Also the base of every strategy that keeps all KV in host RAM (see ``offloaded``).
"""

from __future__ import annotations

import torch

from hybridllm.config import KVConfig
from hybridllm.kvcache import transfer
from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.base import KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.dense_in_place import DenseInPlaceCache
from hybridllm.kvcache.device_site import attend_on_device, attends_on_device
from hybridllm.kvcache.storage import DenseKV
from hybridllm.kvcache.strategy import KVCost, KVStrategy, dense_token_bytes

DEFAULT_PAGE_SIZE = 128


class HostResidentCache(DenseInPlaceCache):
    """Base of strategies whose KV lives in host RAM: one contiguous :class:`DenseKV` per layer.

    Args:
        spec: shapes, dtype and devices.
        ledger: the per-tier byte counter.
        page_size: host buffers grow in multiples of this many tokens.
        pin: page-lock the host buffers (for async copies to a CUDA device).
    """

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 pin: bool = False) -> None:
        super().__init__(spec, ledger)
        self.page_size = page_size
        self._stores = [DenseKV(self.ledger, "host", spec.host_device, spec, page_size, pin)
                        for _ in range(spec.n_layers)]
        self._init_in_place()  # the native steps read and write the host stores where they are

    extendable = True

    def reserve(self, n_tokens: int) -> None:
        for store in self._stores:
            store.reserve(min(n_tokens, self.spec.max_tokens))

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._advance(layer_idx, keys.shape[2])
        self._count_bus("d2h", self._stores[layer_idx].append(keys, values))

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"device": [], "host": [t for store in self._stores for t in store.tensors()]}

    def host_tokens(self, layer_idx: int) -> int:
        return self.length(layer_idx)

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        transfer.synchronize(self.spec.device)  # pending write-backs land first
        return self._stores[layer_idx].read()

    def _release_from(self, length: int) -> None:
        transfer.synchronize(self.spec.device)  # pending copies into host buffers land first
        for store in self._stores:
            if length == 0:
                store.release()
            elif store.length > length:
                store.truncate(length)
                store.trim()


class HostCache(HostResidentCache):
    """All KV and attention on the host: only q, the new K/V and the output cross the bus.

    Args:
        spec: shapes, dtype and devices (``spec.host_device`` holds and attends).
        ledger: the per-tier byte counter (all bytes land in "host").
        page_size: host buffers grow in multiples of this many tokens.
    """

    name = "host"

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        store = self._stores[layer_idx]
        past = self._advance(layer_idx, k_new.shape[2])
        self._count_bus("d2h", store.append(k_new, v_new))
        options = self.spec.layer_options(layer_idx)
        if options.plain and attends_on_device(q, self.spec.n_kv_heads, self.spec.host_device):
            return attend_on_device(q, k_new, v_new, store, past, lambda n: self._count_bus("h2d", n))
        q_host = q.to(self.spec.host_device)
        self._count_bus("d2h", tensor_bytes(q))
        keys, values = store.read()  # (B, Hkv, past+T, D)
        out = causal_attention(q_host, keys, values, query_start=past, scale=options.scale, softcap=options.softcap,
                               window=options.window)
        self._count_bus("h2d", tensor_bytes(out))
        return out.to(q.device)


def _host_cost(config: KVConfig, spec: KVSpec, n_tokens: int, query_bytes: float) -> KVCost:
    """All KV read on the host; per layer q crosses there, the output and its LSE come back, and the
    new token's K/V is written to host RAM."""
    held = spec.n_layers * n_tokens * dense_token_bytes(spec)
    return KVCost(memory={"host": held}, read={"host": held},
                  bus=spec.n_layers * (query_bytes + dense_token_bytes(spec)), round_trips=spec.n_layers,
                  prefill_bus=held)


STRATEGY = KVStrategy(
    name="host",
    tiers=("host",),
    build=lambda config, spec, ledger: HostCache(spec, ledger, page_size=config.kv_page_size),
    token_bytes=lambda config, spec: {"host": spec.n_layers * dense_token_bytes(spec)},
    cost=_host_cost,
    describe=lambda config: "KV and attention on the host",
    moving_parts=3,
    attention_options=True,
    native="dense rows in host RAM, read and written in place",
)
