"""Native prefill (``hl_prefill_model``) and the one copy of the host int4 weights.

Each kernel against its PyTorch reference on every build (the host's, AVX2, portable): the
products of many rows (the decode products: each row the bits it gets alone) and the chunk's
causal attention; then the whole native prefill against the model's PyTorch layers (every tiny
architecture, chunks that start past 0, float16 KV, every position's logits), where it applies and
where PyTorch runs instead, and the int4 layers held once in the kernels' tiles. No wall-time
assertions.
"""

from __future__ import annotations

import pytest
import torch

from hybridllm.config import KVConfig
from hybridllm.errors import ConfigError
from hybridllm.kernels import native
from hybridllm.kernels.native_linear import NativeInt4Linear, hold_natively
from hybridllm.kvcache import DynamicCache, KVSpec, create_cache
from hybridllm.kvcache.attention import causal_attention
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.quantized import Int4Linear, quantize_model
from hybridllm.placement.apply import TierDevices
from hybridllm.placement.placement import Placement
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow
from hybridllm.runtime.runner import build_runner
from hybridllm.runtime.weight_bytes import decode_weight_bytes, weight_bytes_per_tier

from conftest import ARCHS, NEEDS_COMPILER
from linear_modules import exact_product, linear_module

CPU = torch.device("cpu")

pytestmark = NEEDS_COMPILER


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _library(request, isa: str):
    """The host's build, or the AVX2 / portable build (conftest's fixtures; AVX2 skips without it)."""
    return native.kernels() if isa == "native" else request.getfixturevalue(f"{isa}_library")


# ---- the products of many rows --------------------------------------------------------------------
@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("kind, n, k", [
    ("float", 98, 100),        # rows beyond whole tiles, inputs beyond whole vectors
    ("float_bias", 64, 576),
    ("int4", 96, 576),
    ("int4_bias", 160, 1536),
    ("int8", 98, 128),
    ("int8_groups", 98, 576),
])
@pytest.mark.parametrize("rows", [3, 8, 20, 29, 70])  # below and above the AMX tiles' threshold; tile remainders
def test_many_rows_match_the_dequantized_product_and_each_row_alone(request, isa, kind, n, k, rows):
    library = _library(request, isa)
    module = linear_module(kind, n, k)
    view = native.linear_view(module)
    x = torch.randn(rows, k, generator=_gen(rows))
    out = native.linear(view, x, library=library)
    expected = exact_product(module, x)
    error = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    # float32 products: summation order only; quantized: integer dots over two int8 digits per activation
    assert error < (1e-5 if kind.startswith("float") else 5e-4)
    alone = torch.cat([native.linear(view, x[i:i + 1], library=library) for i in range(rows)])
    assert torch.equal(out, alone)  # one arithmetic per row, whatever the row count


@pytest.mark.parametrize("rows", [8, 33])
def test_rows_do_not_depend_on_each_other(rows):
    module = Int4Linear.from_float(torch.randn(96, 128, generator=_gen(8)), torch.randn(96, generator=_gen(9)))
    view = native.linear_view(module)
    x = torch.randn(rows, 128, generator=_gen(rows))
    together = native.linear(view, x)
    doubled = native.linear(view, torch.cat((x, x)))
    torch.testing.assert_close(doubled[:rows], together, atol=0, rtol=0)
    torch.testing.assert_close(doubled[rows:], together, atol=0, rtol=0)


# ---- the chunk's attention ----------------------------------------------------------------------
@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, start, rows, window", [
    (9, 3, 64, 0, 1, 0),       # a single position
    (9, 3, 64, 0, 77, 0),      # several query blocks and key blocks
    (9, 3, 64, 300, 40, 0),    # a chunk after 300 cached positions
    (8, 8, 32, 10, 70, 0),     # no grouping
    (14, 2, 64, 5, 33, 0),     # 7 queries per KV head
    (4, 2, 40, 20, 50, 0),     # a head size that is not a multiple of the vectors
    (4, 2, 20, 0, 21, 0),      # nor of 8
    (9, 3, 64, 100, 60, 48),   # a sliding window
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_prefill_attention_matches_causal_attention(request, isa, n_heads, n_kv_heads, head_dim, start, rows,
                                                    window, kv_dtype):
    library = _library(request, isa)
    gen = _gen(start + rows + head_dim)
    total = start + rows
    capacity = total + 9  # rows beyond the chunk must be ignored
    q = torch.randn(rows, n_heads, head_dim, generator=gen)
    keys = (torch.randn(n_kv_heads, capacity, head_dim, generator=gen) * 3).to(kv_dtype)
    values = torch.randn(n_kv_heads, capacity, head_dim, generator=gen).to(kv_dtype)
    out = native.prefill_attention(q, keys, values, start, window, library=library)
    # reference: every position against its visible keys, over the same (rounded) values
    group = n_heads // n_kv_heads
    k_all = keys[:, :total].float().repeat_interleave(group, 0)  # (H, total, D)
    v_all = values[:, :total].float().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hsd->hts", q, k_all) / head_dim ** 0.5  # (H, T, total)
    positions = torch.arange(start, total)[:, None]
    key_pos = torch.arange(total)[None, :]
    visible = key_pos <= positions
    if window:
        visible &= key_pos > positions - window
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = torch.einsum("hts,hsd->thd", scores.softmax(-1), v_all)
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=3e-5)


def test_prefill_attention_agrees_with_the_caches_attention_helper():
    """The same result as ``causal_attention`` (the PyTorch path's kernel) on a chunk."""
    gen = _gen(3)
    q = torch.randn(1, 9, 24, 64, generator=gen)  # (B, H, T, D)
    keys = torch.randn(1, 3, 40, 64, generator=gen)
    values = torch.randn(1, 3, 40, 64, generator=gen)
    expected = causal_attention(q, keys, values, 16)  # positions 16 .. 39
    out = native.prefill_attention(q[0].transpose(0, 1), keys[0], values[0], 16)
    torch.testing.assert_close(out, expected[0].transpose(0, 1), atol=3e-5, rtol=3e-5)


# ---- the whole prefill ----------------------------------------------------------------------------
def _load(tiny_models, arch: str, weights: str = "float"):
    model = load_model(open_checkpoint(tiny_models[arch][0]), torch.float32, lambda n: CPU)
    if weights != "float":
        quantize_model(model, weights)
    return model


def _runner(model, backend: str):
    return build_runner(model, Placement.all_on_device(model.config.n_layers), TierDevices(CPU), backend)


def _cache(runner, kv_dtype=torch.float32) -> DynamicCache:
    c = runner.config
    return DynamicCache(KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU,
                               max_tokens=c.max_position_embeddings), page_size=16, kv_dtype=kv_dtype)


def _prefill(runner, cache, ids: torch.Tensor, chunk: int, all_logits: bool = False) -> torch.Tensor:
    """``ids`` (1, T) in chunks; the logits of each chunk (all positions, or each chunk's last)."""
    out = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            out.append(runner(ids[:, start:start + chunk], cache, start, all_logits=all_logits))
    return torch.cat(out, dim=1)


def _count_calls(monkeypatch, method: str = "prefill_chunks") -> dict[str, int]:
    """Count the calls of ``NativeModel.<method>`` (``counts[method]``)."""
    counts = {method: 0}
    original = getattr(native.NativeModel, method)

    def counting(self, *args, **kwargs):
        counts[method] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(native.NativeModel, method, counting)
    return counts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_native_prefill_equals_the_pytorch_layers_on_float_weights(tiny_models, arch, kv_dtype, monkeypatch):
    reference = _runner(_load(tiny_models, arch), "eager")
    model = _runner(_load(tiny_models, arch), "native")
    counts = _count_calls(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (1, 90), generator=_gen(11))
    expected = _prefill(reference, _cache(reference, kv_dtype), ids, chunk=40, all_logits=True)
    cache = _cache(model, kv_dtype)
    logits = _prefill(model, cache, ids, chunk=40, all_logits=True)
    assert counts["prefill_chunks"] == 3  # every chunk (40, 40, 10 positions) in one native call
    tolerance = 1e-4 if kv_dtype == torch.float32 else 2e-3  # float16 KV: the PyTorch path rounds too
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
    # the cache holds what the PyTorch layers would have written: decoding on from it agrees
    with torch.inference_mode():
        token = torch.tensor([[int(logits[0, -1].argmax())]])
        step = model(token, cache, cache.seq_length)
    ref_cache = _cache(reference, kv_dtype)
    _prefill(reference, ref_cache, ids, chunk=40)
    with torch.inference_mode():
        ref_step = reference(token, ref_cache, ref_cache.seq_length)
    torch.testing.assert_close(step, ref_step, atol=tolerance, rtol=tolerance)


@pytest.fixture(params=[True, False], ids=["tiles", "no_tiles"])
def amx_tiles(request):
    """AMX tiles on (where the CPU has them) or off (then quantized weights' prefill goes through
    the vector kernels, as on CPUs without AMX: the same bits)."""
    library = native.kernels()
    if request.param and not library.hl_amx():
        pytest.skip("no AMX tiles on this machine")
    library.hl_set_amx(int(request.param))
    yield request.param
    library.hl_set_amx(1)


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_chunks_of_several_sequences_in_one_call_equal_each_alone(tiny_models, weights, amx_tiles, monkeypatch):
    """``step`` of several sequences' chunks (some continuing a cache already holding tokens) in
    one native call give each chunk's logits and KV bitwise as its own forward does."""
    runner = _runner(_load(tiny_models, "llama", weights), "native")
    gen = _gen(21)
    vocab = runner.config.vocab_size
    history = [0, 7, 0, 40]  # tokens already in each cache
    lengths = [5, 33, 2, 12]  # this step's chunk of each sequence (below and above the AMX threshold)
    pasts = [torch.randint(0, vocab, (1, n), generator=gen) for n in history]
    chunks = [torch.randint(0, vocab, (1, n), generator=gen) for n in lengths]
    alone, together = [], []
    for cache_set in (alone, together):
        for past in pasts:
            cache = _cache(runner)
            if past.shape[1]:
                _prefill(runner, cache, past, chunk=64)
            cache_set.append(cache)
    with torch.inference_mode():
        expected = [runner(chunk, cache, cache.seq_length)[0, -1] for chunk, cache in zip(chunks, alone)]
        calls, decodes = _count_calls(monkeypatch), _count_calls(monkeypatch, "decode")
        got = runner.step(ForwardBatch([ForwardRow(cache, chunk[0].tolist(), cache.seq_length)
                                        for chunk, cache in zip(chunks, together)]))
    assert calls["prefill_chunks"] == 1 and decodes["decode"] == 0  # one call for all four sequences
    for i, (logits, reference) in enumerate(zip(got, expected)):
        assert logits.shape == (1, vocab)
        assert torch.equal(logits[-1], reference), f"sequence {i}"  # each row's arithmetic is its own
    for a, b in zip(alone, together):  # the same KV written, at the same positions
        assert a.seq_length == b.seq_length
        for layer in range(runner.config.n_layers):
            for x, y in zip(a.read_layer(layer), b.read_layer(layer)):
                assert torch.equal(x, y)


class _NotInPlace(DynamicCache):
    """A cache the kernels may not read in place (as a strategy they cannot read would be)."""

    def supports_in_place(self, layer_idx: int) -> bool:
        return False

    def supports_in_place_layers(self, layer_indices) -> bool:
        return False


def test_rows_the_whole_model_kernels_do_not_take_walk_the_layers_in_the_same_step(tiny_models, monkeypatch):
    """A step whose rows mix in-place caches, a cache the kernels cannot read in place and a
    one-token row: the chunks go to one native call, the one-token row to the decode kernel, the
    other cache's row through the PyTorch layers; each row's logits are those of its forward alone."""
    runner = _runner(_load(tiny_models, "llama"), "native")
    c = runner.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=c.max_position_embeddings)
    rows = [[1, 2, 3], [4, 5], [6]]
    make = [lambda: _cache(runner), lambda: _NotInPlace(spec), lambda: _cache(runner)]
    with torch.inference_mode():
        alone = [runner.step(ForwardBatch([ForwardRow(new(), ids, 0)]))[0] for new, ids in zip(make, rows)]
        chunks, decodes = _count_calls(monkeypatch), _count_calls(monkeypatch, "decode")
        caches = [new() for new in make]
        together = runner.step(ForwardBatch([ForwardRow(cache, ids, 0) for cache, ids in zip(caches, rows)]))
    assert chunks["prefill_chunks"] == 1 and decodes["decode"] == 1
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    assert [cache.seq_length for cache in caches] == [3, 2, 1]


def test_last_logits_only_unless_asked(tiny_models):
    runner = _runner(_load(tiny_models, "llama"), "native")
    ids = torch.randint(0, runner.config.vocab_size, (1, 30), generator=_gen(12))
    last = _prefill(runner, _cache(runner), ids, chunk=30)
    every = _prefill(runner, _cache(runner), ids, chunk=30, all_logits=True)
    assert last.shape == (1, 1, runner.config.vocab_size) and every.shape == (1, 30, runner.config.vocab_size)
    torch.testing.assert_close(every[:, -1:], last, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache", ["tiered", "quantized", "host", "offloaded"])
def test_every_strategy_prefills_natively(tiny_models, kv_cache, monkeypatch):
    runner = _runner(_load(tiny_models, "llama"), "native")
    counts = _count_calls(monkeypatch)
    c = runner.config
    spec = KVSpec(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, CPU, max_tokens=c.max_position_embeddings)
    cache = create_cache(KVConfig(kv_cache=kv_cache), spec)
    ids = torch.randint(0, c.vocab_size, (1, 20), generator=_gen(13))
    logits = _prefill(runner, cache, ids, chunk=20)
    assert counts["prefill_chunks"] == 1 and torch.isfinite(logits).all()

    uncounted = _NotInPlace(spec)  # a cache the kernels cannot read prefills through PyTorch
    _prefill(runner, uncounted, ids, chunk=20)
    assert counts["prefill_chunks"] == 1 and uncounted.seq_length == 20


# ---- one copy of the int4 weights ---------------------------------------------------------------
def test_native_int4_linear_holds_the_same_weights():
    module = Int4Linear.from_float(torch.randn(112, 96, generator=_gen(14)), torch.randn(112, generator=_gen(15)))
    held = NativeInt4Linear.from_int4_linear(module)
    assert torch.equal(held.unpack_codes(), module.unpack_codes())
    assert torch.equal(held.scales_and_zeros, module.scales_and_zeros)
    assert torch.equal(held.dequantize(), module.dequantize())
    packed = module.weight.numel() * module.weight.element_size() + module.scales_and_zeros.numel() * 2
    assert held.weight.numel() == packed == 112 * 96 // 32 * 20  # 20 bytes per 32 weights either way
    x = torch.randn(2, 5, 96, generator=_gen(16))  # any leading shape, both products
    expected = x @ module.dequantize().T + module.bias
    for rows in (x[:, :1], x):
        out = held(rows)
        assert out.shape == rows.shape[:-1] + (112,)
        scale = expected.abs().max().item()  # integer dots over two int8 digits per activation
        torch.testing.assert_close(out, expected[:, : rows.shape[1]], atol=1e-3 * scale, rtol=0)
    with pytest.raises(ConfigError, match="native int4 layer"):
        held.to("meta")


def test_host_int4_layers_are_held_once(tiny_models):
    model = _load(tiny_models, "llama", "int4")
    placement = Placement.all_on_device(model.config.n_layers)
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    int4_bytes = sum(t.numel() * t.element_size() for m in int4 for t in (*m.buffers(), *m.parameters()))
    before = weight_bytes_per_tier(model, placement)
    assert _runner(model, "native").report.build.whole_step
    held = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(held) == len(int4) and all(type(m) is NativeInt4Linear for m in held)
    # the same int4 bytes (20 per 32 weights), held once; the int8 table in tiles sheds PyTorch's
    # ones vector; a decode step reads every byte held
    assert sum(t.numel() * t.element_size() for m in held for t in (*m.buffers(), *m.parameters())) == int4_bytes
    after = weight_bytes_per_tier(model, placement)
    assert after["device"] <= before["device"] and after["host"] == before["host"]
    assert decode_weight_bytes(model, placement) == sum(after.values())
    assert hold_natively(model) == 0  # nothing left to convert


def test_int4_model_prefill_and_decode_after_holding(tiny_models):
    """The held model answers as the model with PyTorch's int4 layout does (within PyTorch's bf16
    rounding), and greedy tokens agree."""
    reference = _runner(_load(tiny_models, "llama", "int4"), "eager")
    runner = _runner(_load(tiny_models, "llama", "int4"), "native")
    ids = torch.randint(0, runner.config.vocab_size, (1, 24), generator=_gen(17))
    expected = _prefill(reference, _cache(reference), ids, chunk=24)
    logits = _prefill(runner, _cache(runner), ids, chunk=24)
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, atol=3e-2 * scale, rtol=0)
    assert int(logits.argmax()) == int(expected.argmax())
