"""Static KV buffers: one preallocated (rows, Hkv, capacity + 1, D) K and V buffer per layer,
shared by the sequences of one model, one row each (the ``cuda-graph`` decode backend's cache).

A captured CUDA graph replays fixed addresses, so the KV a decode step reads and writes must not
move between steps: every sequence's tokens live in one row of a :class:`StaticKVPool`, and a
batched decode step attends over the pool's first ``bucket`` rows at once (a view, no gather).
The extra column ``capacity`` is a scratch slot: the padded rows of a bucket (free rows, or rows
of sequences that are not in this decode batch) write their key and value there, so they never
touch a real sequence's tokens.

The pool grows (more rows, a longer capacity: doubling, whole pages, at most the context window)
by copying into new buffers; ``generation`` counts the reallocations, so graphs captured over the
old buffers are dropped. Each :class:`StaticSlotCache` counts its row's bytes in its own ledger
(re-counted when the pool grows); the rows no sequence holds are the backend's overhead.
"""

from __future__ import annotations

import torch

from hybridllm.kvcache.attention import causal_attention
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger

DEFAULT_PAGE_SIZE = 128


class StaticKVPool:
    """The K/V buffers of every layer, in rows handed to :class:`StaticSlotCache` s.

    Args:
        spec: shapes, dtype and device (``spec.max_tokens`` bounds the capacity).
        page_size: the capacity grows in multiples of this many tokens.
    """

    def __init__(self, spec: KVSpec, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        if spec.batch_size != 1:
            raise ValueError(f"a static KV pool holds one sequence per row, not batches of {spec.batch_size}")
        self.spec = spec
        self.page_size = page_size
        self.rows = 0
        self.capacity = 0
        self.generation = 0
        self.keys: list[torch.Tensor] = []  # per layer (rows, Hkv, capacity + 1, D)
        self.values: list[torch.Tensor] = []
        self._owners: list[StaticSlotCache | None] = []

    @property
    def scratch_column(self) -> int:
        """The column padded rows write into (never part of a sequence)."""
        return self.capacity

    def row_bytes(self) -> int:
        """Bytes of one row in every layer, K and V (the scratch column included)."""
        spec = self.spec
        element = torch.empty((), dtype=spec.dtype).element_size()
        return 2 * spec.n_layers * spec.n_kv_heads * (self.capacity + 1) * spec.head_dim * element

    def acquire(self, owner: StaticSlotCache) -> int:
        """The lowest free row for ``owner`` (the pool grows by doubling its rows if none is free)."""
        free = [row for row, held in enumerate(self._owners) if held is None]
        if not free:
            self._reallocate(max(1, 2 * self.rows), max(self.capacity, self.page_size))
            free = [row for row, held in enumerate(self._owners) if held is None]
        self._owners[free[0]] = owner
        return free[0]

    def release(self, row: int) -> None:
        self._owners[row] = None

    def held_rows(self) -> int:
        """Rows a sequence holds now."""
        return sum(owner is not None for owner in self._owners)

    def ensure_capacity(self, n_tokens: int) -> None:
        """At least ``n_tokens`` per row (doubling, whole pages, at most ``spec.max_tokens``)."""
        if n_tokens <= self.capacity:
            return
        if n_tokens > self.spec.max_tokens:
            raise ValueError(f"KV cache full: {n_tokens} tokens exceed {self.spec.max_tokens}")
        pages = -(-max(n_tokens, 2 * self.capacity) // self.page_size)
        self._reallocate(self.rows, min(pages * self.page_size, self.spec.max_tokens))

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New buffers of ``rows`` x ``capacity``, the held tokens copied, owners re-counted."""
        spec = self.spec
        shape = (rows, spec.n_kv_heads, capacity + 1, spec.head_dim)  # +1: the scratch column
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: writable in and out of inference mode
            keys = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.n_layers)]
            values = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.n_layers)]
            for new, old in zip([*keys, *values], [*self.keys, *self.values]):
                new[:self.rows, :, :self.capacity].copy_(old[:, :, :self.capacity])
        self.keys, self.values = keys, values
        self._owners.extend([None] * (rows - self.rows))
        self.rows, self.capacity = rows, capacity
        self.generation += 1
        for owner in self._owners:
            if owner is not None:
                owner.recount()


class StaticSlotCache(KVCache):
    """One sequence's KV in one row of a :class:`StaticKVPool` (every layer, the device tier).

    Prefill chunks and eager decode steps go through :meth:`attend` like any cache; the
    ``cuda-graph`` backend writes and attends over the pool's rows itself in its static step and
    records the token with :meth:`advance_all`.

    Args:
        spec: the pool's spec.
        ledger: where the row's bytes are counted (device tier).
        pool: the shared buffers.
    """

    name = "static"

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None, pool: StaticKVPool) -> None:
        super().__init__(spec, ledger)
        self.pool = pool
        self.row: int | None = None
        self._charged = 0

    def slot(self) -> int:
        """This sequence's row, taken from the pool on first need."""
        if self.row is None:
            self.row = self.pool.acquire(self)
            self.recount()
        return self.row

    def recount(self) -> None:
        """Count the row's current bytes in the ledger (after taking it or after the pool grew)."""
        held = self.pool.row_bytes() if self.row is not None else 0
        if held > self._charged:
            self.ledger.allocate("device", held - self._charged)
        elif held < self._charged:
            self.ledger.free("device", self._charged - held)
        self._charged = held

    def reserve(self, n_tokens: int) -> None:
        self.slot()
        self.pool.ensure_capacity(min(n_tokens, self.spec.max_tokens))

    extendable = True

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        past, end = self._write(layer_idx, k_new, v_new)
        row = self.row
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        return causal_attention(q, keys[row:row + 1, :, :end], values[row:row + 1, :, :end], query_start=past)

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write(layer_idx, keys, values)

    def _write(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[int, int]:
        """Write the new tokens into the row; returns the layer's length before and after them."""
        row = self.slot()
        past = self._advance(layer_idx, k_new.shape[2])
        end = past + k_new.shape[2]
        self.pool.ensure_capacity(end)
        self.pool.keys[layer_idx][row, :, past:end] = k_new[0]  # (Hkv, T, D)
        self.pool.values[layer_idx][row, :, past:end] = v_new[0]
        return past, end

    def advance_all(self) -> int:
        """Record one token appended to every layer by a static step; returns its position."""
        position = self.seq_length
        for layer_idx in range(self.spec.n_layers):
            self._advance(layer_idx, 1)
        return position

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        row, length = self.slot(), self.length(layer_idx)
        return (self.pool.keys[layer_idx][row:row + 1, :, :length],  # (1, Hkv, length, D)
                self.pool.values[layer_idx][row:row + 1, :, :length])

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.row is None:
            return {"device": [], "host": []}
        rows = [buffer[self.row] for buffer in [*self.pool.keys, *self.pool.values]]  # (Hkv, capacity + 1, D)
        return {"device": rows, "host": []}

    def _release_from(self, length: int) -> None:
        if length == 0 and self.row is not None:  # later tokens are simply overwritten
            self.pool.release(self.row)
            self.row = None
            self.recount()
