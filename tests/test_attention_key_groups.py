"""A key's score is the same bits whichever of the attention kernels' key groupings computes it.

The kernels score a block's keys in groups whose size depends on the build, the head size, the
query heads per KV head and how many keys the block's run holds (on AVX2: three, two or four keys
at a time, and a lone last key); each key's dot is FMAs in order over the head and a fixed
reduction of its own lanes, so a key's score may not depend on its group. Here the same keys are
attended with one to six extra keys past them whose scores are so low that they add
nothing (exp clamps to ~1e-38: the softmax sum and every output sum stay the same floats): the
extra keys move the last block's keys into other groups (17 keys on AVX2 at d >= 96: five threes and
a pair; 18: six threes; 19: and a lone key), and the outputs and log-sum-exps must stay bitwise
equal. (The block's softmax sum adds whole vectors of 8 or 16 lanes, then the rest one by one: the
extra keys stay within the same whole vectors, 17 to 23 keys, so that sum's order is the same.)
The values' passes (how many of a query's output vectors are summed at once, and which queries
together) change with the same shapes; every sum's FMAs are in key order either way.
"""

from __future__ import annotations

import pytest
import torch

from hybridllm.kernels.host_attention import HostPartialAttention
from hybridllm.kvcache.base import KVFormat

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

TOKENS = 145  # two whole 64-key blocks and 17 keys of a third
CAPACITY = 160


def attend(library, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tokens: int, n_kv_heads: int):
    fmt = KVFormat.F16 if keys.dtype == torch.float16 else KVFormat.F32
    run = {"format": int(fmt), "tokens": tokens, "row0": 0, "capacity": CAPACITY,
           "k": keys.data_ptr(), "v": values.data_ptr()}
    return HostPartialAttention(threads=2, library=library)(q, run, n_kv_heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)])  # 1 to 4 queries per KV head
def test_a_keys_score_does_not_depend_on_its_key_group(each_build, dtype, head_dim, n_heads, n_kv_heads):
    generator = torch.Generator().manual_seed(head_dim + 10 * n_heads + n_kv_heads)
    q = torch.rand(1, n_heads, 1, head_dim, generator=generator) + 0.1  # positive: the extra keys score low
    keys = (torch.rand(n_kv_heads, CAPACITY, head_dim, generator=generator) * 4 - 2).to(dtype)
    values = (torch.rand(n_kv_heads, CAPACITY, head_dim, generator=generator) * 4 - 2).to(dtype)
    keys[:, TOKENS:] = -1000.0  # scores ~ -1000 sqrt(D) / 2: exp clamped, ~1e-38 of the others
    out, lse = attend(each_build, q, keys, values, TOKENS, n_kv_heads)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for extra in range(1, 7):
        more_out, more_lse = attend(each_build, q, keys, values, TOKENS + extra, n_kv_heads)
        assert torch.equal(more_out, out), f"{extra} extra keys changed the output"
        assert torch.equal(more_lse, lse), f"{extra} extra keys changed the log-sum-exp"


def test_the_extra_keys_are_seen(each_build):
    """Not blind: an extra key that scores high changes the output."""
    generator = torch.Generator().manual_seed(0)
    q = torch.rand(1, 8, 1, 128, generator=generator) + 0.1
    keys = (torch.rand(2, CAPACITY, 128, generator=generator) * 4 - 2).to(torch.float16)
    values = (torch.rand(2, CAPACITY, 128, generator=generator) * 4 - 2).to(torch.float16)
    keys[:, TOKENS] = 2.0
    out, _ = attend(each_build, q, keys, values, TOKENS, 2)
    more_out, _ = attend(each_build, q, keys, values, TOKENS + 1, 2)
    assert not torch.equal(more_out, out)
