"""A decode row's attention is the same bits however the kernels share its blocks out.

The decode attention gives a team items: where the (row, KV head) pairs give every thread at least
four, each pair is one item that merges its blocks as it goes; else runs of a few blocks, each
block's result kept and merged in order after a barrier (`decode_blocks_per_item` in
kernels/attention.h). Both merge a row's blocks in position order with the same arithmetic, so a
row's output and log-sum-exp may not depend on which way was taken: here one row alone with two
KV heads on two threads (two pairs: runs of 4 of its 16 blocks), the same row among four (eight
pairs: whole items) and on one thread (two pairs: runs again, of 4), and with four KV heads on one
thread (four pairs: whole).
"""

from __future__ import annotations

import pytest
import torch

from hybridllm.kernels.host_attention import HostPartialAttention
from hybridllm.kvcache.base import KVFormat

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

TOKENS = 1000  # 16 blocks of 64 keys (the last one partial)


def attend(library, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_kv_heads: int, threads: int):
    fmt = KVFormat.F16 if keys.dtype == torch.float16 else KVFormat.F32
    run = {"format": int(fmt), "tokens": TOKENS, "row0": 0, "capacity": TOKENS, "k": keys.data_ptr(),
           "v": values.data_ptr()}
    return HostPartialAttention(threads=threads, library=library)(q, run, n_kv_heads)


def kv(n_kv_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator):
    shape = (n_kv_heads, TOKENS, head_dim)
    return ((torch.rand(shape, generator=generator) * 4 - 2).to(dtype),
            (torch.rand(shape, generator=generator) * 4 - 2).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_whole_pair_items_and_runs_of_blocks_give_the_same_bits(each_build, dtype, head_dim, group):
    generator = torch.Generator().manual_seed(head_dim + group)
    keys, values = kv(2, head_dim, dtype, generator)
    rows = torch.randn(1, 2 * group, 4, head_dim, generator=generator)  # (1, H, rows, D)
    alone = attend(each_build, rows[:, :, :1], keys, values, 2, threads=2)  # 2 pairs on 2 threads: runs
    together = attend(each_build, rows, keys, values, 2, threads=2)  # 8 pairs: whole items
    one_thread = attend(each_build, rows[:, :, :1], keys, values, 2, threads=1)  # 2 pairs: runs
    for out, lse in (together, one_thread):
        assert torch.equal(out[:, :, :1], alone[0]) and torch.equal(lse[:, :, :1], alone[1])
    assert not torch.equal(together[0][:, :, 1], together[0][:, :, 0])  # other rows, other outputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_whole_pairs_on_one_thread_equal_runs_on_three(each_build, dtype):
    generator = torch.Generator().manual_seed(7)
    keys, values = kv(4, 128, dtype, generator)
    q = torch.randn(1, 8, 1, 128, generator=generator)
    whole = attend(each_build, q, keys, values, 4, threads=1)  # 4 pairs on 1 thread: whole items
    runs = attend(each_build, q, keys, values, 4, threads=3)  # 4 pairs on 3 threads: runs of blocks
    assert torch.equal(whole[0], runs[0]) and torch.equal(whole[1], runs[1])
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, keys.float().repeat_interleave(2, 0)[None], values.float().repeat_interleave(2, 0)[None])
    torch.testing.assert_close(whole[0], reference, rtol=1e-4, atol=1e-5)
