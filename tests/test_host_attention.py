"""The host part of split attention through the kernels (issue 31): a tiered cache whose compute
device is not the host attends its cold pages in host RAM where they lie, in their format (float32
or float16 rows, int8/int4 codes with per-channel keys), through ``hl_partial_attention``, and
merges the result with the device's part by log-sum-exp. Here the CPU stands in for the device
(the same code runs with CUDA tensors on the device side): the kernel's out and log-sum-exp equal
PyTorch's over the rows read out, and a whole tiered decode with it equals the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from hybridllm.kernels.host_attention import HostPartialAttention
from hybridllm.kvcache import KVSpec
from hybridllm.kvcache.attention import partial_attention
from hybridllm.kvcache.tiered import TieredCache
from hybridllm.runtime.build import host_attention

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

CPU = torch.device("cpu")
N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 2, 8, 2, 64


class CountingHostAttention(HostPartialAttention):
    """The kernels, counting their calls (how a test sees which path the cache took)."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.calls = 0

    def __call__(self, q, run, n_kv_heads):
        self.calls += 1
        return super().__call__(q, run, n_kv_heads)


def _spec(dtype: torch.dtype, host: HostPartialAttention | None) -> KVSpec:
    return KVSpec(N_LAYERS, N_KV_HEADS, HEAD_DIM, dtype, CPU, max_tokens=4096, host_attention=host)


def _filled(cold_bits: int, dtype: torch.dtype, host: HostPartialAttention | None, tokens: int) -> TieredCache:
    """A tiered cache of ``tokens`` seeded tokens: most of them in cold pages on the host."""
    cache = TieredCache(_spec(dtype, host), page_size=16, hot_window=32, sink_tokens=4, cold_bits=cold_bits,
                        group_size=16)
    generator = torch.Generator().manual_seed(tokens)
    for layer in range(N_LAYERS):
        keys = torch.randn(1, N_KV_HEADS, tokens, HEAD_DIM, generator=generator).to(dtype)
        values = torch.randn(1, N_KV_HEADS, tokens, HEAD_DIM, generator=generator).to(dtype)
        cache.extend(layer, keys, values)
    return cache


@pytest.mark.parametrize("cold_bits,dtype", [(16, torch.float32), (16, torch.float16), (8, torch.float32),
                                             (4, torch.float32)])
@pytest.mark.parametrize("queries", [1, 5])
def test_the_kernel_attends_cold_pages_in_place_as_pytorch_does_over_their_rows(cold_bits, dtype, queries):
    kernel = HostPartialAttention(threads=2)
    cache = _filled(cold_bits, dtype, None, 350)  # 304 cold tokens: not a whole number of 64-key blocks
    cold = cache._cold[1]
    assert cold.length > 64 * 4 and cold.length % 64  # more than one item of blocks, a partial last one
    q = torch.randn(1, N_HEADS, queries, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    out, lse = kernel(q, cache._cold_run(cold, 0), N_KV_HEADS)
    keys, values = cold.read()  # (1, Hkv, n_cold, D): what PyTorch attends
    expected_out, expected_lse = partial_attention(q, keys.float(), values.float())
    assert out.shape == expected_out.shape and lse.shape == expected_lse.shape
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cold_bits", [16, 8, 4])
def test_a_tiered_cache_with_host_kernels_attends_as_its_pytorch_path(cold_bits):
    """Decode steps and a prefill chunk through ``attend``: the cold part through the kernels
    (counted), the hot part and the merge as before; the outputs equal the PyTorch path's."""
    counting = CountingHostAttention()
    with_kernels = _filled(cold_bits, torch.float32, counting, 200)
    without = _filled(cold_bits, torch.float32, None, 200)
    generator = torch.Generator().manual_seed(3)
    for n_new in (1, 1, 7, 1):
        q = torch.randn(1, N_HEADS, n_new, HEAD_DIM, generator=generator)
        k = torch.randn(1, N_KV_HEADS, n_new, HEAD_DIM, generator=generator)
        v = torch.randn(1, N_KV_HEADS, n_new, HEAD_DIM, generator=generator)
        for layer in range(N_LAYERS):
            ours = with_kernels.attend(layer, q, k, v)
            theirs = without.attend(layer, q, k, v)
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert counting.calls == 4 * N_LAYERS
    assert with_kernels.cold_tokens(0) == without.cold_tokens(0) > 0


def test_shapes_the_kernel_does_not_take_keep_the_pytorch_path():
    counting = CountingHostAttention()
    cache = _filled(16, torch.bfloat16, counting, 200)  # bfloat16 rows: no kernel format
    q = torch.randn(1, N_HEADS, 1, HEAD_DIM).to(torch.bfloat16)
    cache.attend(0, q, torch.zeros(1, N_KV_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16),
                 torch.zeros(1, N_KV_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16))
    assert counting.calls == 0
    assert not HostPartialAttention.reads(n_heads=40, n_kv_heads=2, head_dim=64, batch_size=1)  # 20 per KV head
    assert not HostPartialAttention.reads(n_heads=8, n_kv_heads=2, head_dim=64, batch_size=2)
    with pytest.raises(ValueError, match="no"):
        HostPartialAttention(threads=1)(torch.zeros(1, 8, 1, 64), {"tokens": 0, "format": 0}, 2)


def test_the_runtime_gives_the_kernels_where_the_device_is_not_the_host():
    assert host_attention(torch.device("cpu"), 2) is None  # the native steps read every store already
    assert isinstance(host_attention(torch.device("cuda"), 2), HostPartialAttention)
