"""``quantized``: KV on the device as int8/int4 groups, with a full-precision residual window.

Per layer, tokens ``0 .. packed-1`` live in a :class:`QuantizedKV` (values per token in groups
of channels; keys likewise per token, llama.cpp's layout, or per channel in groups of
``group_size`` tokens, KIVI's) and the newest tokens in a small :class:`DenseKV` residual of at
most ``residual`` tokens (``residual + group_size - 1`` with per-channel keys).
Attention runs in parts merged exactly by their log-sum-exp: the packed prefix is read in
chunks of ``chunk_tokens`` straight from its codes (:func:`quantized_partial_attention`: the
scales and zeros are folded into the queries and the probabilities, so no dequantized copy of
the cache is built), then the residual and the new tokens get the causal kernel; afterwards
every token (per-channel keys: every whole group) older than the newest ``residual`` tokens is
quantized. With ``residual=0`` and per-token keys nothing waits in full precision: the cache is
exactly 8.5 / 4.5 bits per value at group 64, as compact as llama.cpp's q8_0 / q4_0. Per-channel
keys need ``group_size`` tokens before a group's range is known, so up to ``group_size - 1``
tokens wait.

A layer with a sliding window, a score scale or a soft-cap (Gemma, Mistral, Phi-3) attends the
packed groups its window still shows, dequantized, and the tail as :func:`windowed_attention`
does; the native steps read the codes in place as for any layer (the window in the kernel).
"""

from __future__ import annotations

import torch

from hybridllm.config import KVConfig
from hybridllm.kvcache.attention import (AttentionOptions, causal_attention, causal_mask, merge_partials,
                                         partial_attention, windowed_attention)
from hybridllm.kvcache.base import InPlaceRows, KVCache, KVFormat, KVSpec, MemoryLedger, dense_format
from hybridllm.kvcache.storage import DenseKV, QuantizedKV
from hybridllm.kvcache.strategy import (KVCost, KVStrategy, dense_token_bytes, quantized_token_bytes, read_bytes,
                                        stored_dtype, stored_spec)

DEFAULT_CHUNK_TOKENS = 1024  # packed tokens per attention chunk: its float scratch stays in cache


def _one_or_all(values: list[int]) -> list[int] | int:
    """A per-layer column as one int where every layer has the same value (the usual step)."""
    first = values[0]
    return first if all(v == first for v in values) else values


class QuantizedCache(KVCache):
    """Group-wise quantized KV on the compute device.

    Args:
        spec: shapes, dtype and device.
        ledger: the per-tier byte counter (all bytes in "device").
        bits: 8 or 4.
        group_size: tokens per key group and channels per value group.
        residual: newest tokens kept in full precision (0: quantize all complete groups).
        residual_dtype: the dtype the residual is stored in (default: the compute dtype; float16
            under float32 compute halves its bytes; attention reads it in the compute dtype).
        chunk_tokens: packed tokens per attention chunk (rounded down to whole groups).
        keys_per_token: keys quantized per token like the values (else per channel, KIVI).
    """

    name = "quantized"

    def __init__(self, spec: KVSpec, ledger: MemoryLedger | None = None, bits: int = 8, group_size: int = 64,
                 residual: int = 0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 residual_dtype: torch.dtype | None = None, keys_per_token: bool = True) -> None:
        super().__init__(spec, ledger)
        if group_size < 1 or residual < 0:
            raise ValueError(f"group_size must be >= 1 and residual >= 0, got {group_size}, {residual}")
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.keys_per_token = keys_per_token
        granule = 1 if keys_per_token else group_size  # tokens quantized together
        self._granule = granule
        self.chunk_tokens = max(granule, chunk_tokens // granule * granule)  # whole key groups
        self._residual_capacity = residual + granule - 1  # the most full-precision tokens ever held
        self._packed = [QuantizedKV(self.ledger, "device", spec.device, spec, bits, group_size,
                                    keys_per_token=keys_per_token)
                        for _ in range(spec.n_layers)]
        self._recent = [DenseKV(self.ledger, "device", spec.device, spec, storage_dtype=residual_dtype)
                        for _ in range(spec.n_layers)]
        self._packed_format = {(8, True): KVFormat.Q8, (4, True): KVFormat.Q4, (8, False): KVFormat.Q8_CHANNEL_KEYS,
                               (4, False): KVFormat.Q4_CHANNEL_KEYS}[(bits, keys_per_token)]
        self._windows = spec.layer_windows()  # the kernels' per layer (0: none)
        self._table: dict[str, dict[str, list[int]]] = {}  # _address_table's, read at _table_key
        self._table_key: tuple[list[int], list[tuple[int, int]]] | None = None

    def reserve(self, n_tokens: int) -> None:
        n_tokens = min(n_tokens, self.spec.max_tokens)
        for packed, recent in zip(self._packed, self._recent):
            packed.reserve(max(0, n_tokens - self.residual))
            if self._residual_capacity:
                recent.reserve(min(n_tokens, self._residual_capacity))

    extendable = True

    def _tail(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Count the new tokens in; returns the layer's length before them and the full-precision
        tail (the recent tokens, then the new ones): (B, Hkv, n_recent+T, D) each."""
        past = self._advance(layer_idx, k_new.shape[2])
        recent = self._recent[layer_idx]
        if self._residual_capacity:
            recent.reserve(self._residual_capacity)  # fixed size: the new tokens never all land in it
        recent_k, recent_v = recent.read()
        k_new, v_new = k_new.to(recent_k.device), v_new.to(recent_v.device)
        return past, torch.cat([recent_k, k_new], dim=2), torch.cat([recent_v, v_new], dim=2)

    def extend(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        _, tail_k, tail_v = self._tail(layer_idx, keys, values)
        n_new = keys.shape[2]
        self._settle(self._packed[layer_idx], self._recent[layer_idx], tail_k, tail_v,
                     tail_k[:, :, -n_new:], tail_v[:, :, -n_new:])

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        packed, recent = self._packed[layer_idx], self._recent[layer_idx]
        past, tail_k, tail_v = self._tail(layer_idx, k_new, v_new)
        options = self.spec.layer_options(layer_idx)
        if not options.plain:
            out = self._attend_with_options(q, packed, tail_k, tail_v, past, options)
        elif packed.length:
            out = self._attend_packed_and_tail(q, packed, tail_k, tail_v, past)
        else:
            out = causal_attention(q, tail_k, tail_v, query_start=past)
        self._settle(packed, recent, tail_k, tail_v, k_new, v_new)
        return out

    def _attend_packed_and_tail(self, q: torch.Tensor, packed: QuantizedKV, tail_k: torch.Tensor,
                                tail_v: torch.Tensor, past: int) -> torch.Tensor:
        """Every query sees all packed tokens (they are older); the tail is causal. (B, H, T, D)."""
        parts = [packed.partial_attention(q, start, min(start + self.chunk_tokens, packed.length))
                 for start in range(0, packed.length, self.chunk_tokens)]
        n_queries, n_tail = q.shape[2], tail_k.shape[2]
        mask = causal_mask(n_queries, n_tail, past - packed.length, q.device) if n_queries > 1 else None
        parts.append(partial_attention(q, tail_k, tail_v, mask))
        return merge_partials(parts).to(q.dtype)

    def _attend_with_options(self, q: torch.Tensor, packed: QuantizedKV, tail_k: torch.Tensor, tail_v: torch.Tensor,
                             past: int, options: AttentionOptions) -> torch.Tensor:
        """A layer with a sliding window, a score scale or a soft-cap (Gemma, Mistral, Phi-3): the
        packed tokens some query still sees (whole groups from the window's first key on; all of
        them without a window) dequantized, then the tail, attended as :func:`windowed_attention`
        does. (B, H, T, D)."""
        first = 0 if options.window is None else max(0, past - options.window + 1)  # oldest key any query sees
        start = min(first // self._granule * self._granule, packed.length)
        old_k, old_v = packed.read(start, packed.length)  # (B, Hkv, packed - start, D)
        keys = torch.cat([old_k.to(tail_k.dtype), tail_k], dim=2)  # positions start .. past + T - 1
        values = torch.cat([old_v.to(tail_v.dtype), tail_v], dim=2)
        return windowed_attention(q, keys, values, past, options, key_start=start)

    def _settle(self, packed: QuantizedKV, recent: DenseKV, tail_k: torch.Tensor, tail_v: torch.Tensor,
                k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Quantize every whole group older than the newest ``residual`` tokens; keep the rest."""
        n_tail = tail_k.shape[2]
        n_move = max(0, n_tail - self.residual) // self._granule * self._granule
        if n_move == 0:
            recent.append(k_new, v_new)
            return
        packed.append(tail_k[:, :, :n_move], tail_v[:, :, :n_move])
        recent.truncate(0)
        if n_move < n_tail:
            recent.append(tail_k[:, :, n_move:], tail_v[:, :, n_move:])

    # ---- in place (the native steps) ----------------------------------------------------------
    def supports_in_place(self, layer_idx: int) -> bool:
        spec = self.spec
        return (spec.device.type == "cpu" and spec.batch_size == 1 and spec.dtype == torch.float32
                and self._recent[layer_idx].storage_dtype in (torch.float32, torch.float16)
                and spec.head_dim % 2 == 0 and spec.head_dim <= 512)

    def in_place_rows(self, layer_indices, n_new: int) -> InPlaceRows:
        """Two runs per layer: the packed tokens and the full-precision residual (with this step's
        rows, written there); after the layer's attention the kernel quantizes the residual's
        oldest tokens beyond ``residual`` (whole key groups) onto the packed ones."""
        layers = list(layer_indices)
        if not self.supports_in_place_layers(layers):
            raise NotImplementedError("QuantizedCache: no in-place rows for these layers")
        starts = {self._lengths[i] for i in layers}
        if len(starts) != 1:
            raise ValueError("in-place rows need every layer claimed at the same length")
        start = starts.pop()
        if start + n_new > self.spec.max_tokens:
            raise ValueError(f"KV cache full: {start} + {n_new} tokens exceed {self.spec.max_tokens}")
        held, tail, moved = [], [], []  # per layer: packed tokens, residual tokens with this step's, settled now
        for i in layers:
            packed, recent = self._packed[i], self._recent[i]
            held.append(packed.length)
            tail.append(recent.length + n_new)
            moved.append(max(0, tail[-1] - self.residual) // self._granule * self._granule)
            recent.ensure(tail[-1], cap=max(tail[-1], recent.capacity))
            packed.ensure(held[-1] + moved[-1])
        table = self._address_table(layers)
        packed_run = {"format": int(self._packed_format), "group": self._packed[layers[0]].v_group,
                      "key_group": self.group_size, "position": 0, "tokens": _one_or_all(held), "row0": 0,
                      **table["packed"]}
        recent_run = {"format": int(dense_format(self._recent[layers[0]].storage_dtype)), "group": 0, "key_group": 0,
                      "position": _one_or_all(held), "tokens": _one_or_all(tail), "row0": 0, **table["recent"]}
        for i, h, t, m in zip(layers, held, tail, moved):
            self._packed[i].length, self._recent[i].length = h + m, t - m  # as the kernel leaves them
            self._lengths[i] = start + n_new
        return InPlaceRows(start, [packed_run, recent_run], write=1, write_row=_one_or_all([t - n_new for t in tail]),
                           window=_one_or_all([self._windows[i] for i in layers]), settle=_one_or_all(moved),
                           settle_row=_one_or_all(held))

    def _address_table(self, layers: list[int]) -> dict[str, dict[str, list[int]]]:
        """The buffers' addresses and capacities of the given layers, per run: read again only when
        a buffer was reallocated (a whole-model step claims the same layers every time)."""
        versions = [(self._packed[i].buffer.version, self._recent[i].buffer.version) for i in layers]
        if self._table_key == (layers, versions):
            return self._table
        packed_columns = {name: [] for name in ("capacity", "k", "v", "k_scale", "k_zero", "v_scale", "v_zero")}
        recent_columns = {name: [] for name in ("capacity", "k", "v")}
        for i in layers:
            packed = self._packed[i]
            fields = packed.buffer.tensors  # k_codes (B, Hkv, capacity, D * bits / 8), ...; none before the first
            packed_columns["capacity"].append(packed.capacity)
            for name, field in (("k", "k_codes"), ("v", "v_codes"), ("k_scale", "k_scale"), ("k_zero", "k_zero"),
                                ("v_scale", "v_scale"), ("v_zero", "v_zero")):
                packed_columns[name].append(fields[field].data_ptr() if packed.capacity else 0)
            keys, values = self._recent[i].buffers()  # (B, Hkv, capacity, D)
            recent_columns["capacity"].append(keys.shape[2])
            recent_columns["k"].append(keys.data_ptr())
            recent_columns["v"].append(values.data_ptr())
        self._table = {"packed": packed_columns, "recent": recent_columns}
        self._table_key = (layers, versions)
        return self._table

    def read_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed_k, packed_v = self._packed[layer_idx].read()  # dequantized, oldest tokens
        recent_k, recent_v = self._recent[layer_idx].read()
        return torch.cat([packed_k, recent_k], dim=2), torch.cat([packed_v, recent_v], dim=2)

    def storage_tensors(self) -> dict[str, list[torch.Tensor]]:
        stores = [*self._packed, *self._recent]
        return {"device": [t for store in stores for t in store.tensors()], "host": []}

    def _release_from(self, length: int) -> None:
        for layer_idx, (packed, recent) in enumerate(zip(self._packed, self._recent)):
            if length == 0:
                packed.release()
                recent.release()
            elif self.length(layer_idx) > length:
                if length >= packed.length:
                    recent.truncate(length - packed.length)
                    packed.trim()
                    continue
                # The cut falls in a quantized group: its surviving tokens return to full
                # precision (as their dequantized values) and the group is dropped.
                keep = length // self._granule * self._granule
                back_k, back_v = packed.read(keep, length)
                packed.truncate(keep)
                packed.trim()
                recent.truncate(0)
                recent.append(back_k, back_v)


def _quantized_token_bytes(config: KVConfig, spec: KVSpec) -> dict[str, float]:
    return {"device": spec.n_layers * quantized_token_bytes(spec, config.kv_bits, config.kv_group_size,
                                                            _keys_per_token(config))}


def _keys_per_token(config: KVConfig) -> bool:
    return config.kv_key_quant == "per-token"


def _quantized_cost(config: KVConfig, spec: KVSpec, n_tokens: int, query_bytes: float) -> KVCost:
    """The newest ``kv_residual`` tokens in ``--kv-dtype``, the rest packed; the packed part is
    counted as read through a compute-dtype copy of one layer at a time (the scratch)."""
    full, kept = dense_token_bytes(spec), dense_token_bytes(stored_spec(config, spec))
    packed = quantized_token_bytes(spec, config.kv_bits, config.kv_group_size, _keys_per_token(config))
    residual = min(n_tokens, config.kv_residual)
    layer = residual * kept + (n_tokens - residual) * packed
    layer_read = residual * kept + read_bytes(n_tokens - residual, packed, full)
    return KVCost(memory={"device": spec.n_layers * layer}, read={"device": spec.n_layers * layer_read},
                  scratch={"device": n_tokens * full if spec.n_layers else 0})


STRATEGY = KVStrategy(
    name="quantized",
    tiers=("device",),
    build=lambda config, spec, ledger: QuantizedCache(spec, ledger, bits=config.kv_bits,
                                                      group_size=config.kv_group_size, residual=config.kv_residual,
                                                      residual_dtype=stored_dtype(config, spec),
                                                      keys_per_token=_keys_per_token(config)),
    token_bytes=_quantized_token_bytes,
    cost=_quantized_cost,
    describe=lambda config: f"quantized int{config.kv_bits} KV",
    moving_parts=1,
    attention_options=True,
    native="int8/int4 groups read and written in place, the residual window beside them",
)
