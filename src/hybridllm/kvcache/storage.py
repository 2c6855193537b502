"""Where KV bytes live: ledgered buffers, and token stores built on them.

``LedgeredBuffer`` is a set of tensors that grow together along the token axis in one tier;
every allocation and free goes through the :class:`~hybridllm.kvcache.base.MemoryLedger`, so
the ledger always equals the real tensor bytes. A token store keeps tokens ``0 .. length-1``
of one layer in such a buffer: :class:`DenseKV` in the compute dtype, :class:`QuantizedKV`
group-wise quantized. Every strategy is assembled from these two stores.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from hybridllm.kvcache import transfer
from hybridllm.kvcache.base import KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.attention import QuantizedBlock, quantized_partial_attention
from hybridllm.kvcache.quantize import SCALE_DTYPE, channel_group, dequantize, packed_size, quantize, unpack_int4


@dataclass(frozen=True)
class Field:
    """One tensor of a buffer: shape (B, Hkv, capacity // tokens_per_row, *tail) of ``dtype``."""

    tail: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_row: int = 1  # e.g. per-channel key scales: one row per group of tokens


class LedgeredBuffer:
    """Tensors growing together along the token axis (dim 2), in one tier, accounted by the ledger.

    Args:
        ledger: receives every allocation and free.
        tier: "device" or "host".
        device: where the tensors are allocated.
        lead: the leading dims (B, Hkv).
        fields: name -> :class:`Field`.
        granule: capacities are multiples of this many tokens (a multiple of every ``tokens_per_row``).
        pin: page-lock host memory (only when CUDA is available).
    """

    def __init__(
        self, ledger: MemoryLedger, tier: str, device: torch.device, lead: tuple[int, int],
        fields: dict[str, Field], granule: int = 1, pin: bool = False,
    ) -> None:
        for name, field_spec in fields.items():
            if granule % field_spec.tokens_per_row:
                raise ValueError(f"granule {granule} is not a multiple of field {name}'s tokens per row")
        self.ledger, self.tier, self.device, self.lead = ledger, tier, device, lead
        self.fields, self.granule = fields, granule
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.capacity = 0  # tokens
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = 0  # counts reallocations (a holder of the tensors' addresses checks it)
        self._bytes_per_granule = sum(
            math.prod(lead) * (granule // f.tokens_per_row) * math.prod(f.tail) * _element_size(f.dtype)
            for f in fields.values()
        )

    def round_up(self, tokens: int) -> int:
        return -(-tokens // self.granule) * self.granule

    def nbytes(self, capacity: int | None = None) -> int:
        """Bytes held at ``capacity`` tokens (default: the current capacity)."""
        cap = self.capacity if capacity is None else self.round_up(capacity)
        return cap // self.granule * self._bytes_per_granule

    def max_capacity(self) -> int | None:
        """Largest capacity whose allocation fits under the tier's eviction limit while the
        current tensors are still alive (a resize holds both); None when the tier is unlimited."""
        headroom = self.ledger.headroom(self.tier)
        if headroom is None:
            return None
        return headroom // self._bytes_per_granule * self.granule  # so that ledger.fits(nbytes(it)) holds

    def resize(self, capacity: int, keep: int) -> None:
        """Reallocate to ``capacity`` tokens (rounded up to the granule), keeping tokens ``0 .. keep-1``."""
        capacity = self.round_up(capacity)
        if capacity == self.capacity:
            return
        if keep > min(capacity, self.capacity):
            raise ValueError(f"cannot keep {keep} tokens when resizing {self.capacity} -> {capacity}")
        if self.pin and self.tensors:
            transfer.synchronize(torch.device("cuda"))  # async writes into pinned memory must land first
        new = {
            name: transfer.empty((*self.lead, capacity // f.tokens_per_row, *f.tail), f.dtype, self.device, self.pin)
            for name, f in self.fields.items()
        } if capacity else {}
        self.ledger.allocate(self.tier, tensor_bytes(*new.values()))
        self.version += 1
        if keep:
            for name, f in self.fields.items():
                rows = keep // f.tokens_per_row
                new[name][:, :, :rows] = self.tensors[name][:, :, :rows]
        self.ledger.free(self.tier, tensor_bytes(*self.tensors.values()))
        self.tensors, self.capacity = new, capacity

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """View of field ``name`` for tokens ``start .. end-1`` (aligned to its tokens per row)."""
        per_row = self.fields[name].tokens_per_row
        if start % per_row or (end % per_row and end != self.capacity):
            raise ValueError(f"field {name}: tokens {start}..{end} are not aligned to groups of {per_row}")
        return self.tensors[name][:, :, start // per_row:-(-end // per_row)]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def growth_target(needed: int, capacity: int, cap: int | None) -> int:
    """Capacity to grow to: at least double (amortised O(1) copying per token), at most ``cap``
    (but never below ``needed``). Plain ints."""
    target = max(needed, 2 * capacity)
    if cap is not None:
        target = max(needed, min(target, cap))
    return target


class TokenStore(ABC):
    """Tokens ``0 .. length-1`` of one layer's keys and values, in one tier.

    Subclasses say how (K, V) are encoded into the buffer's fields and decoded back.

    Args:
        buffer: the storage.
        spec: the cache's shape and compute dtype.
    """

    token_granule = 1  # tokens appended, truncated and read apart together (quantized key groups)

    def __init__(self, buffer: LedgeredBuffer, spec: KVSpec) -> None:
        self.buffer = buffer
        self.spec = spec
        self.length = 0

    # ---- encoding -----------------------------------------------------------------------
    @abstractmethod
    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, Hkv, n, D) keys/values -> one tensor per field, token rows along dim 2."""

    @abstractmethod
    def _decode(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``start .. end-1`` as (B, Hkv, end-start, D) in the compute
        dtype on ``device``: the stored rows cross to ``device`` as they are, then are decoded there."""

    def _rows_on(self, start: int, end: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Every field's rows of tokens ``start .. end-1`` (aligned as :meth:`LedgeredBuffer.rows`
        needs), on ``device``: views where it is the store's own."""
        rows = {name: self.buffer.rows(name, start, end) for name in self.buffer.fields}
        if device == self.device:
            return rows
        return {name: row.to(device, non_blocking=True) for name, row in rows.items()}

    # ---- shared behaviour ---------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.buffer.capacity

    @property
    def tier(self) -> str:
        return self.buffer.tier

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def tensors(self) -> list[torch.Tensor]:
        return list(self.buffer.tensors.values())

    def reserve(self, tokens: int) -> None:
        """Allocate room for ``tokens`` at once (never shrinks)."""
        if tokens > self.capacity:
            self.buffer.resize(tokens, keep=self.length)

    def ensure(self, needed: int, cap: int | None = None) -> None:
        """Room for ``needed`` tokens, growing by doubling up to ``cap`` (default: the context window)."""
        if needed <= self.capacity:
            return
        cap = self.spec.max_tokens if cap is None else cap
        self.buffer.resize(growth_target(needed, self.capacity, cap), keep=self.length)

    def append(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> int:
        """Append (B, Hkv, n, D) keys/values (from any device); returns the bytes written.

        ``non_blocking`` lets a copy from the device return before it lands (the host must
        then not read the store before a synchronize; device readers are stream-ordered).
        """
        n = k.shape[2]
        if n == 0:
            return 0
        encoded = self._encode(k, v)
        self.ensure(self.length + n)
        for name, value in encoded.items():
            dst = self.buffer.rows(name, self.length, self.length + n)
            if non_blocking:
                transfer.copy_ordered(dst, value)
            else:
                dst.copy_(value)
        self.length += n
        return tensor_bytes(*encoded.values())

    def read(self, start: int = 0, end: int | None = None,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``start .. end-1``: (B, Hkv, end-start, D) in the compute dtype,
        on ``device`` (default: the store's own; another one gets the stored bytes, decoded there)."""
        end = self.length if end is None else end
        device = self.device if device is None else device
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"read {start}..{end} outside the {self.length} stored tokens")
        if start == end:  # possibly nothing allocated yet
            spec = self.spec
            shape = (spec.batch_size, spec.n_kv_heads, 0, spec.head_dim)
            empty = torch.empty(shape, dtype=spec.dtype, device=device)
            return empty, empty
        return self._decode(start, end, device)

    def stored_bytes(self, start: int, end: int) -> int:
        """Bytes of the stored rows :meth:`read` of ``start .. end-1`` moves to another device."""
        first, last = self._whole_granules(start, end)
        return tensor_bytes(*(self.buffer.rows(name, first, last) for name in self.buffer.fields))

    def _whole_granules(self, start: int, end: int) -> tuple[int, int]:
        """``start .. end`` widened to whole granules of :attr:`token_granule` tokens (what is read together)."""
        granule = self.token_granule
        return start // granule * granule, -(-end // granule) * granule

    def truncate(self, length: int) -> None:
        """Forget tokens ``length ..`` (storage is kept for reuse)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a store of {self.length} tokens to {length}")
        self.length = length

    def trim(self) -> None:
        """After a rollback, give back capacity far beyond the stored tokens (keeps room to double)."""
        if self.length == 0:
            self.release()
        elif self.capacity > 4 * self.buffer.round_up(self.length):
            self.buffer.resize(2 * self.length, keep=self.length)

    def release(self) -> None:
        """Forget every token and free the storage."""
        self.buffer.resize(0, keep=0)
        self.length = 0


class DenseKV(TokenStore):
    """Keys and values in the compute dtype (or ``storage_dtype``): fields k, v of shape (B, Hkv, capacity, D).

    Args:
        ledger, tier, device: where the bytes are and who counts them.
        spec: shape and dtype.
        granule: capacities are multiples of this many tokens (the page size).
        pin: page-locked host memory (for async copies to a CUDA device).
        storage_dtype: the dtype the tokens are kept in (default: the compute dtype); e.g.
            float16 under float32 compute halves the bytes (rounded to nearest on append;
            :meth:`read` gives the compute dtype, the native decode step reads them as they are).
    """

    def __init__(
        self, ledger: MemoryLedger, tier: str, device: torch.device, spec: KVSpec, granule: int = 1,
        pin: bool = False, storage_dtype: torch.dtype | None = None,
    ) -> None:
        self.storage_dtype = spec.dtype if storage_dtype is None else storage_dtype
        fields = {name: Field((spec.head_dim,), self.storage_dtype) for name in ("k", "v")}
        super().__init__(LedgeredBuffer(ledger, tier, device, (spec.batch_size, spec.n_kv_heads), fields, granule, pin),
                         spec)

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": k, "v": v}

    def _decode(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows_on(start, end, device)
        keys, values = rows["k"], rows["v"]  # (B, Hkv, end-start, D) each
        if self.storage_dtype != self.spec.dtype:  # a compute-dtype copy for PyTorch's attention
            return keys.to(self.spec.dtype), values.to(self.spec.dtype)
        return keys, values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (B, Hkv, capacity, D), for a kernel that writes rows
        and attends in place (the native decode step)."""
        return self.buffer.tensors["k"], self.buffer.tensors["v"]

    def remove(self, start: int, n: int) -> None:
        """Drop tokens ``start .. start+n-1``, shifting the later ones down (used to evict hot pages)."""
        if n == 0:
            return
        end = self.length
        if start < 0 or start + n > end:
            raise ValueError(f"remove {start}..{start + n} outside the {end} stored tokens")
        for name in ("k", "v"):
            tensor = self.buffer.tensors[name]  # (B, Hkv, capacity, D)
            tensor[:, :, start:end - n] = tensor[:, :, start + n:end].clone()  # ranges may overlap
        self.length = end - n


class QuantizedKV(TokenStore):
    """Keys and values group-wise int8/int4 (see :mod:`.quantize`); values per token, keys per
    channel (KIVI) or per token (llama.cpp's q8_0 / q4_0 layout).

    Fields: k_codes/v_codes (B, Hkv, capacity, D*bits/8) uint8; v_scale/v_zero (B, Hkv,
    capacity, D/channel_group) float16; k_scale/k_zero (B, Hkv, capacity/group, D) per channel,
    or (B, Hkv, capacity, D/channel_group) per token. Per-channel keys are appended and truncated
    in whole groups of ``group`` tokens; per-token keys one token at a time.

    Args:
        ledger, tier, device: where the bytes are and who counts them.
        spec: shape and compute dtype (what :meth:`read` returns).
        bits: 8 or 4.
        group: tokens per key group (per-channel keys) and channels per value group (and per key
            group for per-token keys), when it divides head_dim.
        granule: capacities are multiples of this many tokens (a multiple of :attr:`token_granule`).
        keys_per_token: quantize keys like values, per token in groups of channels.
    """

    def __init__(
        self, ledger: MemoryLedger, tier: str, device: torch.device, spec: KVSpec, bits: int, group: int,
        granule: int | None = None, keys_per_token: bool = False,
    ) -> None:
        self.bits, self.group, self.keys_per_token = bits, group, keys_per_token
        self.v_group = channel_group(spec.head_dim, group)
        self.token_granule = 1 if keys_per_token else group  # tokens appended / truncated together
        code_tail = (packed_size(spec.head_dim, bits),)
        per_token_scales = (spec.head_dim // self.v_group,)
        key_scale = (Field(per_token_scales, SCALE_DTYPE) if keys_per_token
                     else Field((spec.head_dim,), SCALE_DTYPE, tokens_per_row=group))
        fields = {
            "k_codes": Field(code_tail, torch.uint8),
            "k_scale": key_scale,
            "k_zero": key_scale,
            "v_codes": Field(code_tail, torch.uint8),
            "v_scale": Field(per_token_scales, SCALE_DTYPE),
            "v_zero": Field(per_token_scales, SCALE_DTYPE),
        }
        granule = self.token_granule if granule is None else granule
        lead = (spec.batch_size, spec.n_kv_heads)
        super().__init__(LedgeredBuffer(ledger, tier, device, lead, fields, granule), spec)

    def _quantize_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.keys_per_token:
            return quantize(k, self.bits, self.v_group, dim=3)  # per token: groups of channels
        return quantize(k, self.bits, self.group, dim=2)  # per channel: groups of tokens

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if k.shape[2] % self.token_granule:
            raise ValueError(f"quantized store takes whole groups of {self.group} tokens, got {k.shape[2]}")
        k_codes, k_scale, k_zero = self._quantize_keys(k)
        v_codes, v_scale, v_zero = quantize(v, self.bits, self.v_group, dim=3)  # per token: groups of channels
        return {"k_codes": k_codes, "k_scale": k_scale, "k_zero": k_zero,
                "v_codes": v_codes, "v_scale": v_scale, "v_zero": v_zero}

    def _decode(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = self._whole_granules(start, end)  # per-channel key groups are decoded whole
        rows = self._rows_on(first, last, device)  # codes, scales and zeros cross; decoded on ``device``
        dtype = self.spec.dtype
        if self.keys_per_token:
            k = dequantize(rows["k_codes"], rows["k_scale"], rows["k_zero"], self.bits, self.v_group, 3, dtype)
        else:
            k = dequantize(rows["k_codes"], rows["k_scale"], rows["k_zero"], self.bits, self.group, 2, dtype)
        v = dequantize(rows["v_codes"], rows["v_scale"], rows["v_zero"], self.bits, self.v_group, 3, dtype)
        lo, hi = start - first, end - first
        return k[:, :, lo:hi], v[:, :, lo:hi]  # (B, Hkv, end-start, D)

    def truncate(self, length: int) -> None:
        if length % self.token_granule:
            raise ValueError(f"quantized store truncates to whole groups of {self.group} tokens, got {length}")
        super().truncate(length)

    def partial_attention(self, q: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q (B, H, T, D) over tokens ``start .. end-1`` (whole key groups), read from
        the codes without a dequantized copy; returns (out (B, H, T, D), lse (B, H, T)) in float32."""
        granule = self.token_granule
        if start % granule or end % granule or not 0 <= start < end <= self.length:
            raise ValueError(f"partial attention over {start}..{end}: not whole groups of {granule} "
                             f"within the {self.length} stored tokens")
        rows = {name: self.buffer.rows(name, start, end) for name in self.buffer.fields}
        keys = QuantizedBlock(rows["k_codes"], rows["k_scale"], rows["k_zero"],
                              self.v_group if self.keys_per_token else self.group, per_token=self.keys_per_token)
        values = QuantizedBlock(rows["v_codes"], rows["v_scale"], rows["v_zero"], self.v_group, per_token=True)
        return quantized_partial_attention(q, keys, values, unpack_int4 if self.bits == 4 else _same)


def _same(codes: torch.Tensor) -> torch.Tensor:
    return codes
