"""A tiered cache attends a prefill chunk's cold pages on the compute device (the first H100 run:
a 32K-token prompt with 90% of its KV on the host timed out, every 8192-query chunk attending the
cold pages on the host). Many query rows: the cold pages cross to the device slice by slice (as
stored: quantized pages as codes, decoded there) and one running partial merges them; few rows
(decode): the queries cross to the host as before.

The CPU stands in for the device (the same code runs with CUDA tensors): both sites give the
dense cache's attention, the bus counts the stored bytes of every slice, and the rule picks the
device only for many query rows on a device that is not the host. The CUDA kernel behind the
partials is checked against the explicit one by ``pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch

from hybridllm.kvcache import KVSpec, device_site, host
from hybridllm.kvcache.attention import (
    causal_attention,
    fused_cuda_partial_attention,
    lower_right_partial_attention,
    merge_partials_with_lse,
    reference_partial_attention,
)
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.host import HostCache
from hybridllm.kvcache.device_site import QUERY_ROWS_ON_DEVICE, attends_on_device
from hybridllm.kvcache.tiered import TieredCache

CPU = torch.device("cpu")
N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 2, 8, 2, 32


def _spec() -> KVSpec:
    return KVSpec(N_LAYERS, N_KV_HEADS, HEAD_DIM, torch.float32, CPU, max_tokens=4096)


def _chunks(cache, generator: torch.Generator, sizes: list[int]) -> list[torch.Tensor]:
    """Attend chunks of ``sizes`` new tokens in every layer; the last layer's outputs."""
    outputs = []
    for n_new in sizes:
        for layer in range(N_LAYERS):
            q = torch.randn(1, N_HEADS, n_new, HEAD_DIM, generator=generator)
            k = torch.randn(1, N_KV_HEADS, n_new, HEAD_DIM, generator=generator)
            v = torch.randn(1, N_KV_HEADS, n_new, HEAD_DIM, generator=generator)
            out = cache.attend(layer, q, k, v)
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("cold_bits", [16, 8, 4])
def test_chunks_attend_cold_pages_on_the_device_as_on_the_host(monkeypatch, cold_bits):
    monkeypatch.setattr(device_site, "SLICE_TOKENS", 32)  # several slices (whole key groups of 16)
    sizes = [96, 40, 1, 33, 7, 1]
    caches = {site: TieredCache(_spec(), page_size=16, hot_window=32, sink_tokens=4, cold_bits=cold_bits,
                                group_size=16, cold_attention=site) for site in ("host", "device")}
    outputs = {site: _chunks(cache, torch.Generator().manual_seed(5), sizes) for site, cache in caches.items()}
    device_cache = caches["device"]
    assert device_cache.cold_tokens(1) > 3 * 32  # the last chunks read more than three slices
    for on_host, on_device in zip(outputs["host"], outputs["device"]):
        torch.testing.assert_close(on_device, on_host, atol=2e-5, rtol=1e-4)
    if cold_bits == 16:  # lossless cold pages: the dense cache's attention too
        dense = _chunks(DynamicCache(_spec()), torch.Generator().manual_seed(5), sizes)
        for expected, on_device in zip(dense, outputs["device"]):
            torch.testing.assert_close(on_device, expected, atol=2e-5, rtol=1e-4)


def test_the_bus_counts_each_slices_stored_bytes(monkeypatch):
    monkeypatch.setattr(device_site, "SLICE_TOKENS", 64)
    cache = TieredCache(_spec(), page_size=16, hot_window=32, cold_bits=4, group_size=16, cold_attention="device")
    _chunks(cache, torch.Generator().manual_seed(1), [200])
    cold = cache._cold[0]
    before = dict(cache.bus_bytes)
    _chunks(cache, torch.Generator().manual_seed(2), [16])  # cold pages are read once per layer
    moved = cache.bus_bytes["h2d"] - before["h2d"]
    per_layer = [cache._cold[layer].stored_bytes(0, cache._cold[layer].length) for layer in range(N_LAYERS)]
    assert cold.length > 64 and moved == sum(per_layer)


def test_the_rule_sends_many_query_rows_to_the_device_and_decode_to_the_host():
    spec = KVSpec(N_LAYERS, N_KV_HEADS, HEAD_DIM, torch.float32, torch.device("meta"), max_tokens=64,
                  host_device=CPU)
    cache = TieredCache(spec, page_size=16, hot_window=32)
    groups = N_HEADS // N_KV_HEADS

    def rows(n_queries: int, device: torch.device) -> bool:
        return attends_on_device(torch.empty(1, N_HEADS, n_queries, HEAD_DIM, device=device), N_KV_HEADS, CPU)

    many = -(-QUERY_ROWS_ON_DEVICE // groups)
    assert rows(many, torch.device("meta")) and not rows(many - 1, torch.device("meta")) and not rows(1, spec.device)
    assert not rows(many, CPU)  # the host computes: nothing to move
    assert attends_on_device(torch.empty(1, N_HEADS, 1, HEAD_DIM), N_KV_HEADS, CPU, site="device")
    with pytest.raises(ValueError, match="cold_attention"):
        TieredCache(spec, cold_attention="gpu")


def test_the_host_cache_attends_a_chunk_on_the_device_as_on_the_host(monkeypatch):
    """The ``host`` strategy's prefill chunks (all of its KV in host RAM) take the same site rule:
    forced here (the CPU is both sites), the chunk's own keys as they came, then the stored
    tokens slice by slice; the dense cache's attention either way, every slice's bytes counted."""
    monkeypatch.setattr(device_site, "SLICE_TOKENS", 32)
    sizes = [96, 40, 1, 33, 7, 1]
    on_host = _chunks(HostCache(_spec(), page_size=16), torch.Generator().manual_seed(5), sizes)
    monkeypatch.setattr(host, "attends_on_device", lambda q, n_kv_heads, host_device: q.shape[2] > 1)
    cache = HostCache(_spec(), page_size=16)
    on_device = _chunks(cache, torch.Generator().manual_seed(5), sizes)
    dense = _chunks(DynamicCache(_spec()), torch.Generator().manual_seed(5), sizes)
    for expected, a, b in zip(dense, on_host, on_device):
        torch.testing.assert_close(a, expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b, expected, atol=2e-5, rtol=1e-4)
    before = cache.bus_bytes["h2d"]
    _chunks(cache, torch.Generator().manual_seed(6), [20])  # a chunk over 178 stored tokens, in 6 slices
    assert cache.bus_bytes["h2d"] - before == N_LAYERS * cache._stores[0].stored_bytes(0, 178)


@pytest.mark.parametrize("past", [0, 1, 37])
def test_lower_right_partial_equals_the_masked_attention(past):
    generator = torch.Generator().manual_seed(past)
    q = torch.randn(1, N_HEADS, 9, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, N_KV_HEADS, past + 9, HEAD_DIM, generator=generator) for _ in range(2))
    out, lse = lower_right_partial_attention(q, k, v)
    torch.testing.assert_close(out, causal_attention(q, k, v, query_start=past).float(), atol=1e-5, rtol=1e-4)
    mask = torch.ones(9, past + 9, dtype=torch.bool).tril(diagonal=past)  # (T, S) lower-right causal
    torch.testing.assert_close(lse, reference_partial_attention(q, k, v, mask)[1], atol=1e-5, rtol=1e-5)


def test_a_running_merge_keeps_the_unions_log_sum_exp():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, N_HEADS, 3, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, N_KV_HEADS, 50, HEAD_DIM, generator=generator) for _ in range(2))
    merged = reference_partial_attention(q, k[:, :, :10], v[:, :, :10])
    for start in (10, 30):
        merged = merge_partials_with_lse([merged, reference_partial_attention(q, k[:, :, start:start + 20],
                                                                              v[:, :, start:start + 20])])
    expected_out, expected_lse = reference_partial_attention(q, k, v)
    torch.testing.assert_close(merged[0], expected_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(merged[1], expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_the_cuda_kernels_partial_equals_the_explicit_one(dtype, causal):
    cuda = torch.device("cuda")
    generator = torch.Generator(device=cuda).manual_seed(0)
    q = torch.randn(1, N_HEADS, 40, HEAD_DIM, device=cuda, dtype=dtype, generator=generator)
    k, v = (torch.randn(1, N_KV_HEADS, 40 if causal else 300, HEAD_DIM, device=cuda, dtype=dtype, generator=generator)
            for _ in range(2))
    mask = torch.ones(40, 40, dtype=torch.bool, device=cuda).tril() if causal else None
    out, lse = fused_cuda_partial_attention(q, k, v, causal=causal)
    expected_out, expected_lse = reference_partial_attention(q, k, v, mask)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(lse, expected_lse, **tolerance)
