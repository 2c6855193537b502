"""Attention on a quantized KV cache's codes (issue 31): the kernels widen int8 / int4 codes in
registers and dequantize them there (code * scale + zero), no float copy of the cache. For every
quantized format (per-token keys and per-channel keys, 8 and 4 bits), several head sizes (a
multiple of the vector width or not) and group sizes (wider and narrower than a vector), on the
native build, the AVX2 build and the portable one, the kernel's output and log-sum-exp equal a
float64 reference that dequantizes the codes in PyTorch and then runs softmax attention."""

from __future__ import annotations

import pytest
import torch

from hybridllm.kernels.host_attention import HostPartialAttention
from hybridllm.kvcache.base import KVFormat

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

N_HEADS, N_KV_HEADS = 6, 2  # three query heads per KV head
TOKENS = 150  # two whole 64-key blocks and a partial one
CAPACITY = 192  # rows per KV head in the buffers (a multiple of every key group below)
FOUR_BITS = (KVFormat.Q4, KVFormat.Q4_CHANNEL_KEYS)
CHANNEL_KEYS = (KVFormat.Q8_CHANNEL_KEYS, KVFormat.Q4_CHANNEL_KEYS)


class QuantizedRun:
    """Random codes with random float16 scales and zeros, laid out as a quantized store holds them
    (B=1 dropped): codes (Hkv, capacity, D or D / 2 bytes), per-token scales (Hkv, capacity,
    D / group), per-channel key scales (Hkv, capacity / key_group, D)."""

    def __init__(self, fmt: KVFormat, head_dim: int, group: int, key_group: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.fmt, self.head_dim, self.group, self.key_group = fmt, head_dim, group, key_group
        self.qmax = 15 if fmt in FOUR_BITS else 255
        shape = (N_KV_HEADS, CAPACITY, head_dim)
        self.key_codes = torch.randint(0, self.qmax + 1, shape, generator=generator, dtype=torch.uint8)
        self.value_codes = torch.randint(0, self.qmax + 1, shape, generator=generator, dtype=torch.uint8)

        def halves(size: tuple[int, ...], low: float, high: float) -> torch.Tensor:
            return (torch.rand(*size, generator=generator) * (high - low) + low).to(torch.float16)

        per_token = (N_KV_HEADS, CAPACITY, head_dim // group)
        key_shape = (N_KV_HEADS, CAPACITY // key_group, head_dim) if fmt in CHANNEL_KEYS else per_token
        span = 4.0 / self.qmax  # values over about [-2, 2], as a layer's keys and values
        self.k_scale, self.k_zero = halves(key_shape, 0.0, span), halves(key_shape, -2.0, 0.0)
        self.v_scale, self.v_zero = halves(per_token, 0.0, span), halves(per_token, -2.0, 0.0)
        self.k = self._packed(self.key_codes)
        self.v = self._packed(self.value_codes)

    def _packed(self, codes: torch.Tensor) -> torch.Tensor:
        if self.fmt not in FOUR_BITS:
            return codes.contiguous()
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()  # element 2i in the low nibble

    def run(self) -> dict[str, int]:
        return {"format": int(self.fmt), "group": self.group, "key_group": self.key_group, "tokens": TOKENS,
                "row0": 0, "capacity": CAPACITY, "k": self.k.data_ptr(), "v": self.v.data_ptr(),
                "k_scale": self.k_scale.data_ptr(), "k_zero": self.k_zero.data_ptr(),
                "v_scale": self.v_scale.data_ptr(), "v_zero": self.v_zero.data_ptr()}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (Hkv, TOKENS, D) in float64: code * scale + zero."""
        if self.fmt in CHANNEL_KEYS:  # (Hkv, capacity / key_group, D) -> one row per token
            k_scale = self.k_scale.double().repeat_interleave(self.key_group, dim=1)
            k_zero = self.k_zero.double().repeat_interleave(self.key_group, dim=1)
        else:  # (Hkv, capacity, D / group) -> one per channel
            k_scale = self.k_scale.double().repeat_interleave(self.group, dim=2)
            k_zero = self.k_zero.double().repeat_interleave(self.group, dim=2)
        v_scale = self.v_scale.double().repeat_interleave(self.group, dim=2)
        v_zero = self.v_zero.double().repeat_interleave(self.group, dim=2)
        keys = self.key_codes.double() * k_scale + k_zero
        values = self.value_codes.double() * v_scale + v_zero
        return keys[:, :TOKENS], values[:, :TOKENS]


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64: q (H, T, D) over keys/values (Hkv, N, D) -> out (H, T, D), lse (H, T)."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)  # (Hkv, N, D) -> (H, N, D)
    values = values.repeat_interleave(group, dim=0)
    scores = q.double() @ keys.transpose(1, 2) * q.shape[-1] ** -0.5  # (H, T, N)
    return torch.softmax(scores, dim=-1) @ values, torch.logsumexp(scores, dim=-1)


CASES = [  # (head_dim, group, key_group)
    (64, 64, 64),  # the default model's head size and the cache's default group
    (64, 16, 32),
    (128, 32, 16),
    (64, 8, 8),  # groups narrower than a vector
    (48, 16, 32),  # a head size of three AVX-512 vectors: the one-key-at-a-time path there
    (40, 8, 32),  # not a multiple of any vector width
]


@pytest.mark.parametrize("fmt", [KVFormat.Q8, KVFormat.Q4, KVFormat.Q8_CHANNEL_KEYS, KVFormat.Q4_CHANNEL_KEYS])
@pytest.mark.parametrize("head_dim,group,key_group", CASES)
@pytest.mark.parametrize("queries", [1, 7])
def test_attention_on_the_codes_equals_dequantized_float_attention(each_build, fmt, head_dim, group, key_group,
                                                                   queries):
    stored = QuantizedRun(fmt, head_dim, group, key_group, seed=head_dim * 1000 + group * 10 + int(fmt))
    q = torch.randn(1, N_HEADS, queries, head_dim, generator=torch.Generator().manual_seed(queries))
    out, lse = HostPartialAttention(threads=2, library=each_build)(q, stored.run(), N_KV_HEADS)
    expected_out, expected_lse = reference(q[0], *stored.dequantized())
    assert out.shape == (1, N_HEADS, queries, head_dim) and lse.shape == (1, N_HEADS, queries)
    torch.testing.assert_close(out[0].double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0].double(), expected_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("fmt", [KVFormat.Q4, KVFormat.Q8_CHANNEL_KEYS])
def test_every_code_counts(fmt):
    """The reference is not blind: one code changed in the last stored row moves the kernel's output."""
    library_out = []
    for change in (False, True):
        stored = QuantizedRun(fmt, 64, 16, 32, seed=5)
        if change:
            stored.value_codes[1, TOKENS - 1, 63] ^= 1
            stored.v = stored._packed(stored.value_codes)
        q = torch.randn(1, N_HEADS, 1, 64, generator=torch.Generator().manual_seed(1))
        out, _ = HostPartialAttention(threads=1)(q, stored.run(), N_KV_HEADS)
        expected_out, _ = reference(q[0], *stored.dequantized())
        torch.testing.assert_close(out[0].double(), expected_out, atol=1e-5, rtol=1e-5)
        library_out.append(out)
    assert not torch.equal(library_out[0][:, 3:, :, 63], library_out[1][:, 3:, :, 63])  # heads of KV head 1
    assert torch.equal(library_out[0][:, :3], library_out[1][:, :3])  # KV head 0's heads untouched
