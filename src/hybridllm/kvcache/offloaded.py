"""``offloaded``: all KV in host RAM; each layer's KV is streamed to the device just in time.

Two device staging slots alternate: while layer i attends from one slot, layer i+1's KV is
copied host -> device into the other on a side stream (CUDA), so the copy overlaps the
compute; an event makes layer i+1 wait for its copy. The last layer prefetches layer 0 for
the next step. Off CUDA the prefetch is a plain synchronous copy, so the same path runs (and
the same bytes are counted) on a CPU-only machine.
"""

from __future__ import annotations

import torch

from hybridllm.config import KVConfig
from hybridllm.kvcache import transfer
from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.base import KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.host import DEFAULT_PAGE_SIZE, HostResidentCache
from hybridllm.kvcache.storage import DenseKV
from hybridllm.kvcache.strategy import KVCost, KVStrategy, dense_token_bytes


class OffloadedCache(HostResidentCache):
    """Host-resident KV (pinned on CUDA) with a double-buffered, prefetched device copy.

    Device memory holds two layers' KV (the staging slots); host memory holds everything.
    ``bus_bytes["h2d"]`` counts every staged layer, ``["d2h"]`` the new tokens written back.

    Args:
        spec: shapes, dtype and devices.
        ledger: the per-tier byte counter (slots in "device", everything else in "host").
        page_size: buffers grow in multiples of this many tokens.
    """

    name = "offloaded"

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        super().__init__(spec, ledger, page_size, pin=transfer.is_cuda(spec.device))
        self._slots = [DenseKV(self.ledger, "device", spec.device, spec, page_size) for _ in range(2)]
        self._staged: list[tuple[int, int] | None] = [None, None]  # (layer, tokens) each slot holds
        self._events: list[transfer.Event] = [None, None]  # copy-done event of each slot's prefetch
        self._active = 1  # the slot the latest attend used
        self._stream = transfer.side_stream(spec.device)

    def _serves_in_place(self, store: DenseKV) -> bool:
        """With the CPU as the compute device there is nothing to stream: the native steps read and
        write the host stores in place (only the new token's write-back is counted, as ``host``)."""
        return self.spec.device.type == "cpu" and super()._serves_in_place(store)

    def reserve(self, n_tokens: int) -> None:
        super().reserve(n_tokens)
        for slot in self._slots:
            slot.reserve(min(n_tokens, self.spec.max_tokens))

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        past = self.length(layer_idx)
        slot_idx = self._stage(layer_idx, past)
        slot = self._slots[slot_idx]
        self._advance(layer_idx, k_new.shape[2])
        slot.append(k_new, v_new)
        # Written back without blocking: only the device (stream-ordered) reads it before a sync.
        self._count_bus("d2h", self._stores[layer_idx].append(k_new, v_new, non_blocking=True))
        self._staged[slot_idx] = (layer_idx, slot.length)
        self._active = slot_idx
        self._load((layer_idx + 1) % self.spec.n_layers, 1 - slot_idx)  # overlaps the attention below
        keys, values = slot.read()  # (B, Hkv, past+T, D): a sliding window masks the older keys
        options = self.spec.layer_options(layer_idx)
        return causal_attention(q, keys, values, query_start=past, scale=options.scale, softcap=options.softcap,
                                window=options.window)

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        tiers = super().storage_tensors()
        tiers["device"] = [t for slot in self._slots for t in slot.tensors()]
        return tiers

    # ---- staging ------------------------------------------------------------------------
    def _stage(self, layer_idx: int, n_tokens: int) -> int:
        """Index of a slot holding the layer's first ``n_tokens`` tokens, waiting for its copy."""
        for slot_idx in (0, 1):
            if self._staged[slot_idx] == (layer_idx, n_tokens):
                transfer.wait(self._events[slot_idx], self.spec.device)
                self._events[slot_idx] = None
                return slot_idx
        slot_idx = 1 - self._active  # not prefetched (first call, after a truncate, out of order)
        self._load(layer_idx, slot_idx)
        transfer.wait(self._events[slot_idx], self.spec.device)
        self._events[slot_idx] = None
        return slot_idx

    def _load(self, layer_idx: int, slot_idx: int) -> None:
        """Start copying the layer's host KV into a slot (on the side stream when on CUDA)."""
        transfer.wait(self._events[slot_idx], self.spec.device)  # an earlier copy into this slot lands first
        store, slot = self._stores[layer_idx], self._slots[slot_idx]
        n_tokens = store.length
        slot.truncate(0)
        slot.ensure(n_tokens)
        self._staged[slot_idx] = (layer_idx, n_tokens)
        if n_tokens == 0:
            return
        keys, values = store.read()  # (B, Hkv, n, D) on the host
        pairs = [(slot.buffer.rows("k", 0, n_tokens), keys), (slot.buffer.rows("v", 0, n_tokens), values)]
        self._events[slot_idx] = transfer.copy_async(pairs, self._stream)
        slot.length = n_tokens
        self._count_bus("h2d", tensor_bytes(keys, values))

    def _release_from(self, length: int) -> None:
        super()._release_from(length)  # synchronizes: no copy is in flight after this
        self._staged, self._events = [None, None], [None, None]
        for slot in self._slots:  # restaged on the next attend anyway
            slot.release()


def _offloaded_cost(config: KVConfig, spec: KVSpec, n_tokens: int, query_bytes: float) -> KVCost:
    """Everything in host RAM plus two device staging slots of one layer; each decode step streams
    every layer's KV to the device and writes its new token back."""
    layer = n_tokens * dense_token_bytes(spec)
    return KVCost(memory={"host": spec.n_layers * layer, "device": 2 * layer if spec.n_layers else 0},
                  read={"device": spec.n_layers * layer},
                  bus=spec.n_layers * (layer + dense_token_bytes(spec)), round_trips=spec.n_layers,
                  prefill_bus=spec.n_layers * layer)


STRATEGY = KVStrategy(
    name="offloaded",
    tiers=("host",),  # the staging slots are transient: admission counts the host copy
    build=lambda config, spec, ledger: OffloadedCache(spec, ledger, page_size=config.kv_page_size),
    token_bytes=lambda config, spec: {"host": spec.n_layers * dense_token_bytes(spec),
                                      "device": 2 * dense_token_bytes(spec)},
    cost=_offloaded_cost,
    describe=lambda config: "offloaded KV (in RAM, streamed per layer)",
    moving_parts=3,
    attention_options=True,
    native="the host rows in place (with the CPU as the device there is nothing to stream)",
)
