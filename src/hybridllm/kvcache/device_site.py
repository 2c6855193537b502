"""Where many queries attend KV kept in host RAM: on the compute device, the stored rows crossing.

A cache whose KV (or part of it) lives on the host attends a few query rows (decode) there: the
queries cross, the output comes back. A prefill chunk has thousands of query rows: the host's
work grows with them while the stored bytes do not, so the rows cross to the device instead, in
slices of whole storage granules (quantized rows as codes, decoded there), each slice's partial
attention merged by log-sum-exp into one running partial (no more than one slice on the device at
a time). Used by ``tiered`` (its cold pages) and ``host`` (all of its KV, for plain layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridllm.kvcache.attention import lower_right_partial_attention, merge_partials_with_lse, partial_attention
from hybridllm.kvcache.storage import TokenStore

# Query rows (queries x query heads per KV head) from which the stored rows cross to the device
# instead of the queries to the host. Per host key the host does ~4 D flops per query row; the bus
# moves 4 Hkv D bytes (bfloat16 K and V; less when quantized). With a host of ~1 TFLOP/s and a bus
# of ~25 GB/s the two cost the same at ~40 rows: decode (1 query, 4-8 rows) stays on the host.
QUERY_ROWS_ON_DEVICE = 64
SLICE_TOKENS = 16384  # stored tokens per slice on the device (whole pages and key groups)
SITES = ("auto", "host", "device")


def attends_on_device(q: torch.Tensor, n_kv_heads: int, host_device: torch.device, site: str = "auto") -> bool:
    """Whether queries q (B, H, T, D) attend host-held rows on their own device: ``site``
    "device" or "host" says so; "auto" when q is not on the host and has many query rows."""
    if site != "auto":
        return site == "device"
    query_rows = q.shape[2] * (q.shape[1] // n_kv_heads)
    return q.device != host_device and query_rows >= QUERY_ROWS_ON_DEVICE


def attend_on_device(q: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor, store: TokenStore, end: int,
                     count_h2d: Callable[[int], None]) -> torch.Tensor:
    """Attention of q (B, H, T, D) on its device over its most recent keys ``recent_k/v`` (B, Hkv,
    S >= T, D) already there (the queries' own last: lower-right causal), then over tokens
    0 .. end-1 of ``store`` (before every query), read onto q's device slice by slice and merged
    into one running partial (``count_h2d`` gets each slice's stored bytes). Returns (B, H, T, D)
    in q's dtype."""
    merged = lower_right_partial_attention(q, recent_k, recent_v)  # out (B, H, T, D), lse (B, H, T)
    granule = store.token_granule
    step = max(granule, SLICE_TOKENS // granule * granule)
    for start in range(0, end, step):
        stop = min(end, start + step)
        keys, values = store.read(start, stop, device=q.device)  # (B, Hkv, stop-start, D)
        count_h2d(store.stored_bytes(start, stop))
        merged = merge_partials_with_lse([merged, partial_attention(q, keys, values)])
    return merged[0].to(q.dtype)
