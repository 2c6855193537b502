"""The host part of a split attention through the kernels: a tiered cache's cold pages in host RAM
attended in place, in their own format (float32/float16 rows, or int8/int4 codes with per-channel
keys), with no float copy of them per step.

    host = HostPartialAttention(threads=8)
    out, lse = host(q_host, run, n_kv_heads)   # (B=1, H, T, D) float32, (1, H, T)

The tiered cache calls it (``KVSpec.host_attention``) while the device attends its hot window:
the device's kernels run asynchronously, so the kernels' own team of host threads works on the
cold pages at the same time, and the two parts merge by log-sum-exp
(:func:`hybridllm.kvcache.attention.merge_partials`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch

from hybridllm.kernels.abi import HLKVSegment, kernels
from hybridllm.kvcache.base import KVFormat

# head sizes and query heads per KV head the kernels take (abi.h's MAX_HEAD_DIM, attention.h's MAX_GROUP)
MAX_HEAD_DIM = 512
MAX_GROUP = 16
READABLE_DENSE = (torch.float32, torch.float16)  # dense cold rows the kernels read (KVFormat.F32, F16)


class HostPartialAttention:
    """``hl_partial_attention``: queries over every key of one run of host KV (plain scores:
    q . k / sqrt(D), the only attention the tiered cache serves).

    Args:
        threads: the kernels' team size (None: PyTorch's thread count).
        library: a loaded kernel library (None: the process's, built on first use).
    """

    def __init__(self, threads: int | None = None, library: ctypes.CDLL | None = None) -> None:
        self.threads = threads
        self.library = library if library is not None else kernels()

    @staticmethod
    def reads(n_heads: int, n_kv_heads: int, head_dim: int, batch_size: int) -> bool:
        """Whether the kernel takes these shapes (one sequence; even head size up to 512; at most
        16 query heads per KV head)."""
        return (batch_size == 1 and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
                and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= MAX_GROUP)

    def __call__(self, q: torch.Tensor, run: Mapping[str, int], n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` (1, H, T, D) on the host over the run's ``tokens`` keys (a run as
        :data:`~hybridllm.kvcache.base.RUN_FIELDS` describes it, one layer's) -> out (1, H, T, D)
        float32 and lse (1, H, T) float32."""
        _, n_heads, n_queries, head_dim = q.shape
        if not self.reads(n_heads, n_kv_heads, head_dim, q.shape[0]) or run["tokens"] <= 0:
            raise ValueError(f"hl_partial_attention takes no {tuple(q.shape)} queries over {run['tokens']} "
                             f"tokens of {n_kv_heads} KV heads")
        KVFormat(run["format"])  # an unknown format raises here, not in the kernel
        rows = q[0].transpose(0, 1).float().contiguous()  # (1, H, T, D) -> (T, H, D): one row per query
        out = torch.empty_like(rows)
        lse = torch.empty(n_queries, n_heads, dtype=torch.float32)  # (T, H)
        segment = HLKVSegment(run["format"], run.get("group", 0), run.get("key_group", 0), 0, 0, run["tokens"],
                              run.get("row0", 0), run["capacity"], run["k"], run["v"], run.get("k_scale", 0),
                              run.get("k_zero", 0), run.get("v_scale", 0), run.get("v_zero", 0))
        self.library.hl_partial_attention(rows.data_ptr(), n_queries, ctypes.byref(segment), n_heads, n_kv_heads,
                                          head_dim, head_dim ** -0.5, 0.0, out.data_ptr(), lse.data_ptr(),
                                          self.threads or torch.get_num_threads())
        return out.transpose(0, 1).unsqueeze(0), lse.transpose(0, 1).unsqueeze(0)  # (1, H, T, D), (1, H, T)
