"""KV cache building blocks without a model: the split-attention merge, group-wise quantization,
the page table (plain ints) and the ledgered buffers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridllm.kvcache import attention
from hybridllm.kvcache.attention import causal_attention, causal_mask, merge_partials, partial_attention
from hybridllm.kvcache.base import KVBudgetError, KVSpec, MemoryLedger, tensor_bytes
from hybridllm.kvcache.paging import (
    PageTable,
    fraction_cold_pages,
    pages_to_evict,
    pages_to_settle,
    window_cold_pages,
)
from hybridllm.kvcache.quantize import channel_group, dequantize, pack_int4, quantize, token_group, unpack_int4
from hybridllm.kvcache.storage import DenseKV, Field, LedgeredBuffer, QuantizedKV

CPU = torch.device("cpu")


# ---- split attention merged by log-sum-exp --------------------------------------------------
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One softmax over all keys, in float64; the queries are the last T positions (causal)."""
    n_queries, n_keys = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)  # (B, H, S, D)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~causal_mask(n_queries, n_keys, n_keys - n_queries, q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)


PARTIALS = [attention.reference_partial_attention]
if attention._FUSED_CPU is not None:
    PARTIALS.append(attention.fused_partial_attention)


@pytest.mark.parametrize("partial_attention", PARTIALS, ids=lambda f: f.__name__.split("_")[0])
@pytest.mark.parametrize("n_queries", [1, 7, 32])
@pytest.mark.parametrize("heads", [(8, 2), (6, 6)], ids=["gqa", "mha"])
def test_split_attention_equals_one_softmax(n_queries, heads, partial_attention):
    n_heads, n_kv_heads = heads
    gen = torch.Generator().manual_seed(n_queries)
    n_sink, n_cold, n_hot_old = 3, 45, 20  # the hot part ends with the queries' own keys
    total = n_sink + n_cold + n_hot_old + n_queries
    q = torch.randn(2, n_heads, n_queries, 16, generator=gen)
    k = 2 * torch.randn(2, n_kv_heads, total, 16, generator=gen)  # larger scores: a peaky softmax
    v = torch.randn(2, n_kv_heads, total, 16, generator=gen)
    expected = reference_attention(q, k, v).float()

    sink = slice(0, n_sink)
    cold = slice(n_sink, n_sink + n_cold)
    hot = slice(n_sink + n_cold, total)
    n_hot = total - n_sink - n_cold
    hot_mask = causal_mask(n_queries, n_hot, n_hot - n_queries, CPU) if n_queries > 1 else None
    parts = [
        partial_attention(q, k[:, :, sink], v[:, :, sink]),
        partial_attention(q, k[:, :, cold], v[:, :, cold]),
        partial_attention(q, k[:, :, hot], v[:, :, hot], hot_mask),
    ]
    torch.testing.assert_close(merge_partials(parts), expected, atol=1e-5, rtol=0)
    # two tiers, as the tiered cache runs it: hot = sinks + newest (contiguous in its store)
    hot_k = torch.cat([k[:, :, sink], k[:, :, hot]], dim=2)
    hot_v = torch.cat([v[:, :, sink], v[:, :, hot]], dim=2)
    n_hot2 = hot_k.shape[2]
    mask2 = causal_mask(n_queries, n_hot2, n_hot2 - n_queries, CPU)
    two = merge_partials([partial_attention(q, hot_k, hot_v, mask2),
                          partial_attention(q, k[:, :, cold], v[:, :, cold])])
    torch.testing.assert_close(two, expected, atol=1e-5, rtol=0)
    # and the fast single-range kernel agrees with the reference too
    torch.testing.assert_close(causal_attention(q, k, v, total - n_queries), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("partial_attention", PARTIALS, ids=lambda f: f.__name__.split("_")[0])
def test_merge_ignores_a_part_with_no_visible_key(partial_attention):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # (1, 2, 3, 8): GQA
    nothing = torch.zeros(3, 3, dtype=torch.bool)
    empty_out, empty_lse = partial_attention(q, k, v, nothing)
    assert torch.isneginf(empty_lse).all() and (empty_out == 0).all()
    full = partial_attention(q, k, v)
    torch.testing.assert_close(merge_partials([full, (empty_out, empty_lse)]), full[0], atol=1e-6, rtol=0)
    some = torch.ones(3, 3, dtype=torch.bool)
    some[1] = False  # one query sees nothing in this part
    out, lse = partial_attention(q, k, v, some)
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, [0, 2]]).all()
    assert (out[:, :, 1] == 0).all()


def test_partial_attention_uses_one_contract_on_every_path():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 4, 8, generator=gen)
    k, v = torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    mask = causal_mask(4, 9, 5, CPU)
    out, lse = partial_attention(q, k, v, mask)
    ref_out, ref_lse = attention.reference_partial_attention(q, k, v, mask)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


# ---- group-wise quantization ------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [2, 3], ids=["per-channel(K)", "per-token(V)"])
def test_quantize_error_is_at_most_half_a_step(bits, dim):
    x = torch.randn(2, 3, 128, 64, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    codes, scale, zero = quantize(x, bits, 32, dim)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * bits // 8
    expected_scale_shape = list(x.shape)
    expected_scale_shape[dim] //= 32
    assert list(scale.shape) == expected_scale_shape == list(zero.shape)
    back = dequantize(codes, scale, zero, bits, 32, dim, torch.float32)
    assert back.shape == x.shape
    step = scale.float().repeat_interleave(32, dim=dim)
    assert ((back - x).abs() <= step / 2 + 1e-4 * x.abs().max()).all()
    relative = ((back - x).norm() / x.norm()).item()
    assert relative < (0.01 if bits == 8 else 0.1)


def test_quantize_groups_run_along_the_requested_axis():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])  # channel 0 varies along the tokens
    codes, scale, zero = quantize(x, 8, 4, dim=2)  # one key group per channel
    assert scale.shape == (1, 1, 1, 4)
    assert scale[0, 0, 0, 0].item() == pytest.approx(3 / 255, rel=1e-3) and scale[0, 0, 0, 1:].max() < 1e-3
    torch.testing.assert_close(dequantize(codes, scale, zero, 8, 4, 2, torch.float32), x, atol=1e-3, rtol=0)


def test_constant_groups_and_int4_packing_round_trip():
    x = torch.full((1, 2, 8, 6), 0.75)
    for bits in (8, 4):
        codes, scale, zero = quantize(x, bits, 8, dim=2)
        torch.testing.assert_close(dequantize(codes, scale, zero, bits, 8, 2, torch.float32), x)
    values = torch.randint(0, 16, (3, 5, 10), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (3, 5, 5)
    assert torch.equal(unpack_int4(packed), values)


def test_group_lengths_adapt_to_head_dim_and_page():
    assert channel_group(64, 64) == 64 and channel_group(128, 64) == 64 and channel_group(80, 64) == 80
    assert token_group(128, 64) == 64 and token_group(32, 64) == 32 and token_group(96, 64) == 32


# ---- the page table (plain ints) ----------------------------------------------------------------
def test_window_and_fraction_targets():
    assert window_cold_pages(length=100, window=40, sink_tokens=0, page_size=16) == 3  # pages end at 48 <= 60
    assert window_cold_pages(length=100, window=40, sink_tokens=4, page_size=16) == 3  # 4+48=52 <= 60
    assert window_cold_pages(length=30, window=40, sink_tokens=0, page_size=16) == 0
    assert window_cold_pages(length=100, window=0, sink_tokens=0, page_size=16) == 6
    assert fraction_cold_pages(length=100, percent=70, sink_tokens=0, page_size=16) == 4  # 64 <= 70 tokens
    assert fraction_cold_pages(length=100, percent=100, sink_tokens=10, page_size=16) == 5  # sinks stay hot
    assert fraction_cold_pages(length=1000, percent=0, sink_tokens=0, page_size=16) == 0


def test_page_table_eviction_and_indices():
    table = PageTable(page_size=8, sink_tokens=3)
    table.append(2)
    assert table.movable_pages() == 0 and table.hot_tokens == 2  # still filling the sinks
    table.append(30)  # 32 tokens: sinks 0..2, pages [3,11) [11,19) [19,27), partial [27,32)
    assert table.movable_pages() == 3
    assert table.evict(2) == (3, 16)  # the two oldest pages, right after the sinks in the hot store
    assert (table.cold_tokens, table.hot_tokens, table.movable_pages()) == (16, 16, 1)
    assert table.hot_index(1) == 1 and table.hot_index(19) == 3 and table.hot_index(31) == 15
    with pytest.raises(ValueError):
        table.hot_index(10)  # cold
    with pytest.raises(ValueError):
        table.evict(2)


def test_page_table_truncation_plans():
    def fresh() -> PageTable:
        table = PageTable(page_size=8, sink_tokens=3, length=40)
        table.evict(3)  # cold: positions 3..26; hot: sinks + 27..39
        return table

    in_hot = fresh().truncate(30)
    assert (in_hot.hot_keep, in_hot.cold_keep, in_hot.restored_tokens) == (6, 24, 0)
    table = fresh()
    in_cold = table.truncate(14)  # page [11, 19) is cut: 11..13 come back hot
    assert (in_cold.hot_keep, in_cold.cold_keep, in_cold.restore) == (3, 8, (8, 11))
    assert (table.cold_pages, table.length) == (1, 14)
    on_boundary = fresh().truncate(19)
    assert (on_boundary.hot_keep, on_boundary.cold_keep, on_boundary.restored_tokens) == (3, 16, 0)
    in_sinks = fresh().truncate(2)
    assert (in_sinks.hot_keep, in_sinks.cold_keep, in_sinks.restored_tokens) == (2, 0, 0)


def test_pages_to_evict_follows_policy_then_budget():
    table = PageTable(page_size=10, length=55)  # 5 complete pages + 5 tokens, all hot
    target = window_cold_pages(55 + 1, window=30, sink_tokens=0, page_size=10)
    assert pages_to_evict(table, 1, target, max_hot_tokens=None) == 2  # pages ending at 10, 20 <= 26
    assert pages_to_evict(table, 1, target, max_hot_tokens=30) == 3  # 55 - 30 + 1 = 26 <= 30
    assert pages_to_evict(table, 20, 0, max_hot_tokens=40) == 4  # 55 - 40 + 20 = 35 <= 40
    with pytest.raises(KVBudgetError):
        pages_to_evict(table, 40, 0, max_hot_tokens=40)  # 5 + 40 must stay hot
    table.evict(5)
    assert pages_to_settle(table, target_cold_pages=9) == 0  # nothing complete is left hot


# ---- ledgered storage ---------------------------------------------------------------------------
def test_ledgered_buffer_counts_real_bytes_and_keeps_tokens():
    ledger = MemoryLedger({"device": 10_000})
    fields = {"a": Field((4,), torch.float32), "s": Field((4,), torch.float16, tokens_per_row=8)}
    buf = LedgeredBuffer(ledger, "device", CPU, (1, 2), fields, granule=8)
    buf.resize(10, keep=0)
    assert buf.capacity == 16
    assert ledger.current("device") == tensor_bytes(*buf.tensors.values()) == buf.nbytes() == 16 * 8 * 4 + 2 * 8 * 2
    buf.rows("a", 0, 16).copy_(torch.arange(128.0).view(1, 2, 16, 4))
    before = buf.rows("a", 0, 8).clone()
    buf.resize(40, keep=8)
    assert torch.equal(buf.rows("a", 0, 8), before)
    assert ledger.current("device") == tensor_bytes(*buf.tensors.values())
    assert ledger.peak("device") == buf.nbytes(16) + buf.nbytes(40)  # old and new alive during the copy
    assert buf.max_capacity() == (int(10_000 * 0.95) - buf.nbytes()) // buf.nbytes(8) * 8
    buf.resize(0, keep=0)
    assert ledger.current("device") == 0 and buf.tensors == {}


def test_token_stores_round_trip():
    spec = KVSpec(n_layers=1, n_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
    ledger = MemoryLedger()
    k, v = torch.randn(1, 2, 48, 8), torch.randn(1, 2, 48, 8)
    dense = DenseKV(ledger, "host", CPU, spec, granule=16)
    dense.append(k[:, :, :20], v[:, :, :20])
    dense.append(k[:, :, 20:], v[:, :, 20:])
    assert torch.equal(dense.read()[0], k) and dense.capacity == 64  # 32, then doubled
    dense.remove(4, 16)
    assert torch.equal(dense.read()[1], torch.cat([v[:, :, :4], v[:, :, 20:]], dim=2))
    packed = QuantizedKV(ledger, "host", CPU, spec, bits=8, group=16)
    # codes 2 x (1*2*48*8) B; key scale+zero 2 x (1*2*3*8) fp16; value scale+zero 2 x (1*2*48*1) fp16
    assert packed.append(k, v) == 1536 + 192 + 384
    kk, vv = packed.read(5, 40)
    torch.testing.assert_close(kk, k[:, :, 5:40], atol=0.05, rtol=0)
    torch.testing.assert_close(vv, v[:, :, 5:40], atol=0.05, rtol=0)
    with pytest.raises(ValueError):
        packed.truncate(20)  # not a whole key group
    all_tensors = dense.tensors() + packed.tensors()
    assert ledger.current("host") == tensor_bytes(*all_tensors)
