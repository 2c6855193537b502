"""``tiered``: a hot window on the device, cold pages on the host, attention split between them.

Per layer a :class:`~hybridllm.kvcache.paging.PageTable` says which tokens are hot (the sink
tokens, then the newest pages) and which are cold (older pages). The hot tokens live in a
contiguous :class:`DenseKV` on the device; cold pages in a host store, in the compute dtype
or group-wise 4/8-bit (:class:`QuantizedKV`, quantized on the device before the move).

Attention runs where it costs least. For a few query rows (decode) cold KV never moves: the
device attends to the hot tokens while the host attends to the cold pages (on CUDA the hot
kernels are queued first and run while the host computes), then the host's partial output and
log-sum-exp cross to the device and the two are merged exactly
(:func:`~hybridllm.kvcache.attention.merge_partials`). For many query rows (a prefill chunk) the
host's work grows with the queries while the pages' bytes do not: the cold pages cross to the
device in slices (quantized pages as codes, decoded there) and the device attends to each, one
running partial merged slice by slice (:mod:`hybridllm.kvcache.device_site` decides and moves
them; the first H100 run timed out at 32K tokens with every chunk's cold attention on the host).

Pages move hot -> cold when the window slides past them (or, with ``offload_percent``, when
the host's share of the tokens falls below that percentage) and when the device ledger would
cross its eviction limit. Before new tokens are appended, the pages the policy wants at the
new length (and what the budget needs) move first; the new tokens themselves stay hot while
they attend, so cold keys always precede every query.

A layer with a sliding window, a score scale or a soft-cap (Gemma, Mistral, Phi-3) attends in
place on the CPU like any other (the native steps read every run, the window skipping what it
hides); through PyTorch it attends its tokens of both tiers in position order on the device
(:meth:`TieredCache.read_layer`), the one path that applies those options.
"""

from __future__ import annotations

import torch

from hybridllm.config import KVConfig
from hybridllm.kvcache import transfer
from hybridllm.kvcache.attention import causal_attention, causal_mask, merge_partials, partial_attention
from hybridllm.kvcache.base import (RUN_FIELDS, InPlaceRows, KVCache, KVFormat, KVSpec, MemoryLedger, dense_format,
                                    tensor_bytes)
from hybridllm.kvcache.device_site import SITES, attend_on_device, attends_on_device
from hybridllm.kvcache.paging import (
    PageTable,
    fraction_cold_pages,
    pages_to_evict,
    pages_to_settle,
    window_cold_pages,
)
from hybridllm.kvcache.quantize import token_group
from hybridllm.kvcache.storage import DenseKV, QuantizedKV, TokenStore
from hybridllm.kvcache.strategy import KVCost, KVStrategy, dense_token_bytes, quantized_token_bytes, read_bytes




class TieredCache(KVCache):
    """Hot window (plus sink tokens) on the device, cold pages on the host, split attention.

    Args:
        spec: shapes, dtype and devices (``spec.device`` hot, ``spec.host_device`` cold).
        ledger: the per-tier byte counter; its "device" budget bounds the hot tokens.
        page_size: tokens per page (the unit that moves).
        hot_window: the newest tokens kept on the device (pages wholly older move to the host).
        sink_tokens: leading tokens that stay on the device forever.
        cold_bits: 16 keeps cold pages in the compute dtype; 8 or 4 quantizes them group-wise.
        group_size: quantization group (tokens per key group, channels per value group).
        offload_percent: if set, keep this percentage of the cached tokens on the host instead
            of a window.
        cold_attention: where the cold pages are attended: "auto" (by query rows, see
            :data:`~hybridllm.kvcache.device_site.QUERY_ROWS_ON_DEVICE`), "host" or "device" (the cold pages cross the bus).
    """

    name = "tiered"

    def __init__(
        self,
        spec: KVSpec,
        ledger: MemoryLedger | None = None,
        page_size: int = 128,
        hot_window: int = 512,
        sink_tokens: int = 0,
        cold_bits: int = 16,
        group_size: int = 64,
        offload_percent: float | None = None,
        cold_attention: str = "auto",
    ) -> None:
        super().__init__(spec, ledger)
        if cold_bits not in (16, 8, 4):
            raise ValueError(f"cold_bits must be 16, 8 or 4, got {cold_bits}")
        if cold_attention not in SITES:
            raise ValueError(f"cold_attention must be one of {', '.join(SITES)}, got {cold_attention}")
        self.cold_attention = cold_attention
        self.page_size, self.hot_window, self.sink_tokens = page_size, hot_window, sink_tokens
        self.cold_bits, self.offload_percent = cold_bits, offload_percent
        n = spec.n_layers
        self._cold_group = token_group(page_size, group_size)  # tokens per key group of quantized pages
        self._tables = [PageTable(page_size, sink_tokens) for _ in range(n)]
        self._hot = [DenseKV(self.ledger, "device", spec.device, spec, granule=page_size) for _ in range(n)]
        self._cold: list[TokenStore]
        self._cold = [self._new_cold_store(cold_bits) for _ in range(n)]
        self._windows = spec.layer_windows()  # the kernels' per layer (0: none)

    # ---- the contract -------------------------------------------------------------------
    extendable = True

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        self._store(layer_idx, k_new, v_new)
        out = self._attention(layer_idx, q)
        self._settle(layer_idx)
        return out

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._store(layer_idx, keys, values)
        self._settle(layer_idx)

    def _store(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Make room in the hot store (evicting cold pages as the policy says) and append the new tokens."""
        table, hot = self._tables[layer_idx], self._hot[layer_idx]
        n_new = k_new.shape[2]
        max_hot = self._max_hot_tokens(hot)
        self._evict(layer_idx, pages_to_evict(table, n_new, self._target_cold_pages(table.length + n_new), max_hot))
        hot.ensure(table.hot_tokens + n_new, cap=max_hot)
        self._advance(layer_idx, n_new)
        table.append(n_new)
        hot.append(k_new, v_new)

    def _settle(self, layer_idx: int) -> None:
        """Move the pages the policy wants cold to the host."""
        table = self._tables[layer_idx]
        self._evict(layer_idx, pages_to_settle(table, self._target_cold_pages(table.length)))

    def reserve(self, n_tokens: int) -> None:
        """Allocate the hot stores once for what the policy keeps hot (within the device budget)."""
        n_tokens = min(n_tokens, self.spec.max_tokens)
        if self.offload_percent is None:
            hot = self.sink_tokens + self.hot_window + self.page_size
        else:
            hot = self.sink_tokens + int(n_tokens * (1 - self.offload_percent / 100)) + self.page_size
        for store in self._hot:
            most = store.buffer.max_capacity()
            store.reserve(min(n_tokens, hot) if most is None else min(n_tokens, hot, most))

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"device": [t for store in self._hot for t in store.tensors()],
                "host": [t for store in self._cold for t in store.tensors()]}

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, then the cold pages (moved to the device), then the newest hot tokens."""
        hot, cold = self._hot[layer_idx], self._cold[layer_idx]
        sinks = self._tables[layer_idx].sinks_held
        hot_k, hot_v = hot.read()
        cold_k, cold_v = (t.to(hot_k.device) for t in cold.read())
        keys = torch.cat([hot_k[:, :, :sinks], cold_k, hot_k[:, :, sinks:]], dim=2)  # (B, Hkv, length, D)
        values = torch.cat([hot_v[:, :, :sinks], cold_v, hot_v[:, :, sinks:]], dim=2)
        return keys, values

    def quantize_cold(self, bits: int) -> None:
        """Re-encode every cold page with ``bits`` (8 or 4) from now on (host memory pressure)."""
        if bits not in (8, 4) or bits >= self.cold_bits:
            raise ValueError(f"cold pages can only be quantized to fewer bits than {self.cold_bits}, got {bits}")
        self.cold_bits = bits
        for layer_idx, old in enumerate(self._cold):
            new = self._new_cold_store(bits)
            if old.length:
                new.append(*old.read())
            old.release()
            self._cold[layer_idx] = new

    def _new_cold_store(self, bits: int) -> TokenStore:
        spec = self.spec
        if bits == 16:
            return DenseKV(self.ledger, "host", spec.host_device, spec, granule=self.page_size)
        return QuantizedKV(self.ledger, "host", spec.host_device, spec, bits, self._cold_group, self.page_size)

    def host_tokens(self, layer_idx: int) -> int:
        return self.cold_tokens(layer_idx)

    def hot_tokens(self, layer_idx: int) -> int:
        """Tokens of a layer on the device (sinks included)."""
        return self._tables[layer_idx].hot_tokens

    def cold_tokens(self, layer_idx: int) -> int:
        """Tokens of a layer on the host."""
        return self._tables[layer_idx].cold_tokens

    # ---- in place (the native steps) ----------------------------------------------------------
    def supports_in_place(self, layer_idx: int) -> bool:
        spec = self.spec
        return (spec.device.type == "cpu" and spec.host_device.type == "cpu" and spec.batch_size == 1
                and spec.dtype == torch.float32 and spec.head_dim % 2 == 0 and spec.head_dim <= 512)

    def in_place_rows(self, layer_indices, n_new: int) -> InPlaceRows:
        """Three runs per layer in position order: the sink tokens (the hot store's first rows), the
        cold pages (dense, or quantized with per-channel keys), the newest hot tokens (this step's
        rows written after them). The policy's page moves run here: the ones the last step left
        (the PyTorch path makes them right after attending), then the room the new rows need."""
        layers = list(layer_indices)
        if not self.supports_in_place_layers(layers):
            raise NotImplementedError("TieredCache: no in-place rows for these layers")
        starts = {self._lengths[i] for i in layers}
        if len(starts) != 1:
            raise ValueError("in-place rows need every layer claimed at the same length")
        start = starts.pop()
        if start + n_new > self.spec.max_tokens:
            raise ValueError(f"KV cache full: {start} + {n_new} tokens exceed {self.spec.max_tokens}")
        runs = [{name: [] for name in RUN_FIELDS} for _ in range(3)]
        write_row = []
        for i in layers:
            self._settle(i)
            table, hot = self._tables[i], self._hot[i]
            max_hot = self._max_hot_tokens(hot)
            self._evict(i, pages_to_evict(table, n_new, self._target_cold_pages(table.length + n_new), max_hot))
            hot.ensure(table.hot_tokens + n_new, cap=max_hot)
            self._advance(i, n_new)
            table.append(n_new)
            write_row.append(hot.length)
            hot.length += n_new  # the kernel writes rows write_row .. write_row + n_new - 1 itself
            sinks, cold = table.sinks_held, self._cold[i]
            keys, values = hot.buffers()  # (B, Hkv, capacity, D)
            hot_fmt = int(dense_format(hot.storage_dtype))
            hot_run = {"format": hot_fmt, "group": 0, "key_group": 0, "row0": 0, "capacity": keys.shape[2],
                       "k": keys.data_ptr(), "v": values.data_ptr(), "k_scale": 0, "k_zero": 0, "v_scale": 0,
                       "v_zero": 0}
            described = [dict(hot_run, position=0, tokens=sinks), self._cold_run(cold, sinks),
                         dict(hot_run, position=sinks + cold.length, tokens=hot.length - sinks, row0=sinks)]
            for run, values_of in zip(runs, described):
                for name in RUN_FIELDS:
                    run[name].append(values_of[name])
        return InPlaceRows(start, runs, write=2, write_row=write_row, window=[self._windows[i] for i in layers])

    def _cold_run(self, cold: TokenStore, position: int) -> dict[str, int]:
        """The cold pages of a layer as a run from ``position`` on."""
        run = {"position": position, "tokens": cold.length, "row0": 0, "group": 0, "key_group": 0}
        if cold.capacity == 0:  # nothing allocated yet: an empty run
            return dict(run, format=0, capacity=0, k=0, v=0, k_scale=0, k_zero=0, v_scale=0, v_zero=0)
        if isinstance(cold, DenseKV):
            keys, values = cold.buffers()  # (B, Hkv, capacity, D)
            return dict(run, format=int(dense_format(cold.storage_dtype)), capacity=keys.shape[2], k=keys.data_ptr(),
                        v=values.data_ptr(), k_scale=0, k_zero=0, v_scale=0, v_zero=0)
        fields = cold.buffer.tensors
        fmt = KVFormat.Q8_CHANNEL_KEYS if cold.bits == 8 else KVFormat.Q4_CHANNEL_KEYS
        return dict(run, format=int(fmt), group=cold.v_group, key_group=cold.group,
                    capacity=fields["k_codes"].shape[2], k=fields["k_codes"].data_ptr(),
                    v=fields["v_codes"].data_ptr(), k_scale=fields["k_scale"].data_ptr(),
                    k_zero=fields["k_zero"].data_ptr(), v_scale=fields["v_scale"].data_ptr(),
                    v_zero=fields["v_zero"].data_ptr())

    # ---- policy -------------------------------------------------------------------------
    def _target_cold_pages(self, length: int) -> int:
        if self.offload_percent is not None:
            return fraction_cold_pages(length, self.offload_percent, self.sink_tokens, self.page_size)
        return window_cold_pages(length, self.hot_window, self.sink_tokens, self.page_size)

    def _max_hot_tokens(self, hot: DenseKV) -> int | None:
        """Most tokens a layer's hot store may hold: its capacity, or more if the ledger allows it to grow."""
        grow_to = hot.buffer.max_capacity()
        return None if grow_to is None else max(hot.capacity, grow_to)

    def _evict(self, layer_idx: int, n_pages: int) -> None:
        """Move the ``n_pages`` oldest hot pages of a layer to the cold store."""
        if n_pages == 0:
            return
        hot, cold = self._hot[layer_idx], self._cold[layer_idx]
        start, n_tokens = self._tables[layer_idx].evict(n_pages)
        keys, values = hot.read(start, start + n_tokens)  # (B, Hkv, n_pages*page, D)
        self._count_bus("d2h", cold.append(keys, values))  # quantized on the device first if cold_bits < 16
        hot.remove(start, n_tokens)
        self.pages_moved += n_pages

    # ---- split attention ----------------------------------------------------------------
    def _attention(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        hot, cold = self._hot[layer_idx], self._cold[layer_idx]
        n_queries, n_hot = q.shape[2], hot.length
        options = self.spec.layer_options(layer_idx)
        if not options.plain:  # Gemma's, Mistral's, Phi-3's layers: every tier's tokens in order, on the device
            keys, values = self.read_layer(layer_idx)  # (B, Hkv, length, D)
            sinks = self._tables[layer_idx].sinks_held
            cold_part = slice(sinks, sinks + cold.length)  # the cold pages, decoded, moved to the device
            self._count_bus("h2d", tensor_bytes(keys[:, :, cold_part], values[:, :, cold_part]))
            return causal_attention(q, keys, values, query_start=keys.shape[2] - n_queries, scale=options.scale,
                                    softcap=options.softcap, window=options.window)
        hot_k, hot_v = hot.read()  # (B, Hkv, n_hot, D): sinks, older hot tokens, then the queries' own
        if cold.length == 0:
            return causal_attention(q, hot_k, hot_v, query_start=n_hot - n_queries)
        if attends_on_device(q, self.spec.n_kv_heads, self.spec.host_device, self.cold_attention):
            # the hot tokens (the queries' own last) on the device, then the cold pages slice by slice
            return attend_on_device(q, hot_k, hot_v, cold, cold.length, lambda n: self._count_bus("h2d", n))
        q_host, q_ready = transfer.to_host_async(q, self.spec.host_device)  # queued before the hot kernels
        mask = causal_mask(n_queries, n_hot, n_hot - n_queries, q.device) if n_queries > 1 else None
        hot_part = partial_attention(q, hot_k, hot_v, mask)  # async on CUDA
        transfer.host_wait(q_ready)
        if self._attends_cold_in_place(cold, q.shape[1]):  # the kernels read the pages as they lie
            cold_out, cold_lse = self.spec.host_attention(q_host, self._cold_run(cold, 0), self.spec.n_kv_heads)
        else:
            cold_k, cold_v = cold.read()  # (B, Hkv, n_cold, D); every cold key precedes every query
            cold_out, cold_lse = partial_attention(q_host, cold_k, cold_v)
        self._count_bus("d2h", tensor_bytes(q))
        self._count_bus("h2d", tensor_bytes(cold_out, cold_lse))
        cold_part = (cold_out.to(q.device, non_blocking=True), cold_lse.to(q.device, non_blocking=True))
        return merge_partials([hot_part, cold_part]).to(q.dtype)

    def _attends_cold_in_place(self, cold: TokenStore, n_heads: int) -> bool:
        """Whether the spec's host attention reads this layer's cold pages in place (dense rows
        of float32/float16, or quantized pages, in shapes it takes)."""
        spec = self.spec
        return (spec.host_attention is not None
                and spec.host_attention.reads(n_heads, spec.n_kv_heads, spec.head_dim, spec.batch_size)
                and (not isinstance(cold, DenseKV) or cold.storage_dtype in (torch.float32, torch.float16)))

    # ---- truncation ---------------------------------------------------------------------
    def _release_from(self, length: int) -> None:
        for layer_idx, (table, hot, cold) in enumerate(zip(self._tables, self._hot, self._cold)):
            if length == 0:
                hot.release()
                cold.release()
                self._tables[layer_idx] = PageTable(self.page_size, self.sink_tokens)
                continue
            if table.length <= length:
                continue
            plan = table.truncate(length)
            restored = cold.read(*plan.restore) if plan.restored_tokens else None
            cold.truncate(plan.cold_keep)
            hot.truncate(plan.hot_keep)
            if restored is not None:  # a partial page is always hot: it comes back
                self._count_bus("h2d", hot.append(*restored))
                self.pages_moved += 1
            cold.trim()
            hot.trim()


def _cold_token_bytes(config: KVConfig, spec: KVSpec) -> float:
    """Bytes of one cold token of one layer: compute dtype, or group-wise quantized pages."""
    if config.kv_cold_bits == 16:
        return dense_token_bytes(spec)
    return quantized_token_bytes(spec, config.kv_cold_bits, token_group(config.kv_page_size, config.kv_group_size))


def _tiered_token_bytes(config: KVConfig, spec: KVSpec) -> dict[str, float]:
    host_share = 1.0 if config.kv_offload_percent is None else config.kv_offload_percent / 100
    return {"device": spec.n_layers * dense_token_bytes(spec) * (1 - host_share),
            "host": spec.n_layers * _cold_token_bytes(config, spec) * host_share}


def _tiered_cost(config: KVConfig, spec: KVSpec, n_tokens: int, query_bytes: float) -> KVCost:
    """Sinks and the hot window (or the device share) on the device, the rest cold on the host;
    per layer q crosses to the host, the cold part's output and LSE come back, and one token is
    evicted per step."""
    full, cold_token = dense_token_bytes(spec), _cold_token_bytes(config, spec)
    if config.kv_offload_percent is None:
        hot = min(n_tokens, config.kv_sink_tokens + config.kv_hot_window)
    else:
        hot = n_tokens * (1 - config.kv_offload_percent / 100)
    cold = n_tokens - hot
    layers = spec.n_layers
    return KVCost(
        memory={"device": layers * hot * full, "host": layers * cold * cold_token},
        read={"device": layers * hot * full, "host": layers * read_bytes(cold, cold_token, full)},
        scratch={"host": cold * full if layers and cold_token != full else 0},
        bus=layers * (query_bytes + full),
        round_trips=layers,
        prefill_bus=layers * full * cold,
    )


STRATEGY = KVStrategy(
    name="tiered",
    tiers=("device", "host"),
    spills_to_host=True,
    attention_options=True,
    host_part=True,
    build=lambda config, spec, ledger: TieredCache(
        spec, ledger,
        page_size=config.kv_page_size,
        hot_window=config.kv_hot_window,
        sink_tokens=config.kv_sink_tokens,
        cold_bits=config.kv_cold_bits,
        group_size=config.kv_group_size,
        offload_percent=config.kv_offload_percent,
    ),
    token_bytes=_tiered_token_bytes,
    cost=_tiered_cost,
    describe=lambda config: (f"tiered KV (hot window {config.kv_hot_window} tokens on the device, cold pages "
                             f"{config.kv_cold_bits}-bit in RAM)"),
    moving_parts=2,
    native="sinks, cold pages (16-bit or int8/int4 groups) and the hot window read in place, merged exactly",
)
