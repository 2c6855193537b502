"""In-place rows of the caches that keep each layer in one dense store (``dynamic``, ``host``,
``offloaded``): the native steps write a step's keys and values into the store's next rows and
attend over its rows where they are.

A layer qualifies when its store is on the CPU, holds one sequence (batch 1) in float32 or
float16, and the compute dtype is float32 (what the kernels compute in). Claiming every layer
of a cache at once (a whole-model step) re-reads the buffers' addresses only after a
reallocation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridllm.kvcache.base import InPlaceRows, KVCache, dense_format, dense_run
from hybridllm.kvcache.storage import DenseKV


class DenseInPlaceCache(KVCache):
    """Base of the caches whose layer ``i`` is one :class:`DenseKV` (``self._stores[i]``)."""

    _stores: list[DenseKV]

    def _serves_in_place(self, store: DenseKV) -> bool:
        """Whether the native kernels may read and write this store in place."""
        return (store.device.type == "cpu" and self.spec.batch_size == 1 and self.spec.dtype == torch.float32
                and store.storage_dtype in (torch.float32, torch.float16))

    def _init_in_place(self) -> None:
        """Call once the stores exist (at the end of the subclass's ``__init__``)."""
        self._in_place = frozenset(i for i, store in enumerate(self._stores) if self._serves_in_place(store))
        self._windows = self.spec.layer_windows()
        self._table: tuple[list[int], list[int], list[int]] = ([], [], [])  # keys, values, capacity per layer
        self._table_versions: list[int] = []  # the stores' buffer versions the table was read at

    def supports_in_place(self, layer_idx: int) -> bool:
        return layer_idx in self._in_place

    def supports_in_place_layers(self, layer_indices: Sequence[int]) -> bool:
        return self._in_place.issuperset(layer_indices)

    def in_place_rows(self, layer_indices: Sequence[int], n_new: int) -> InPlaceRows:
        """Rows ``start .. start + n_new - 1`` of each layer given, counted as appended."""
        layers = list(layer_indices)
        if not self.supports_in_place_layers(layers):
            raise NotImplementedError(f"{type(self).__name__}: no in-place rows for these layers")
        starts = {self._lengths[i] for i in layers}
        if len(starts) != 1:
            raise ValueError("in-place rows need every layer claimed at the same length")
        start = starts.pop()
        end = start + n_new
        if end > self.spec.max_tokens:
            raise ValueError(f"KV cache full: {start} + {n_new} tokens exceed {self.spec.max_tokens}")
        stores = [self._stores[i] for i in layers]
        for store in stores:
            store.ensure(end)
            store.length = end  # the caller writes rows start .. end - 1 itself
        for i in layers:
            self._lengths[i] = end
        fmt = dense_format(stores[0].storage_dtype)
        if layers == list(range(self.spec.n_layers)):  # a whole-model step: the cached address table
            versions = [store.buffer.version for store in stores]
            if versions != self._table_versions:
                buffers = [store.buffers() for store in stores]  # (B, Hkv, capacity, D) each
                self._table = ([k.data_ptr() for k, _ in buffers], [v.data_ptr() for _, v in buffers],
                               [k.shape[2] for k, _ in buffers])
                self._table_versions = versions
            keys, values, capacity = self._table
            window = self._windows
        else:
            buffers = [store.buffers() for store in stores]
            keys, values = [k.data_ptr() for k, _ in buffers], [v.data_ptr() for _, v in buffers]
            capacity, window = [k.shape[2] for k, _ in buffers], [self._windows[i] for i in layers]
        return InPlaceRows(start, [dense_run(fmt, end, capacity, keys, values)], write=0, write_row=start,
                           window=window)
