"""Attention kernels shared by the cache strategies.

``causal_attention`` is the fast path over one contiguous KV range (PyTorch SDPA, grouped-query
heads folded into the query axis so K/V are never repeated). ``partial_attention`` returns the
output together with its log-sum-exp so that results over disjoint key sets (e.g. a hot window
on the device and cold pages on the host) can be merged exactly by ``merge_partials``.

Attention by phase (``causal_attention``): a prefill chunk with no past is SDPA with
``is_causal=True`` (no mask: the flash kernels apply); a chunk with a past is causal with
lower-right alignment, expressed as such on CUDA (``causal_lower_right``: flash with GQA, no
(T, S) mask) and on the CPU split into "the past, fully visible" + "the new block, causal" merged
by log-sum-exp (the fused CPU kernel returns it; only a (T, T) mask is built); a decode step
(one query) needs no mask. On CUDA the SDPA backends are named (flash, then memory-efficient,
then math): PyTorch otherwise picks cuDNN at q_len 1, the slowest choice in the issue's profile.
``split_kv_attention`` is flash-decoding in PyTorch: the keys in chunks, each chunk's partial
and log-sum-exp merged, the merged log-sum-exp returned for a further (tier) merge.

A layer may attend otherwise (Gemma): a sliding window, another score scale, tanh soft-capping
of the scores. ``causal_attention`` takes them as keyword options (defaults: plain attention, the
paths above); with any of them set it runs :func:`windowed_attention`. A cache reads each layer's
:class:`AttentionOptions` from its ``KVSpec.attention``: every strategy applies them (a strategy
that could not would declare so, ``KVStrategy.attention_options``, and refuse such a model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

if TYPE_CHECKING:
    from hybridllm.config import ModelConfig

# The SDPA backends allowed on CUDA, in PyTorch's order of preference: flash (bf16/fp16, no mask),
# memory-efficient (any mask), math (last resort, never raises). cuDNN is left out: at q_len 1 it
# took 73% of a decode step's CPU time on the H100 profile.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs from plain causal softmax(q k^T / sqrt(D)) v.

    Attributes:
        scale: the factor of the scores (None: 1 / sqrt(head_dim)); Gemma's
            ``query_pre_attn_scalar ** -0.5``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
        window: a query sees only the ``window`` newest keys, its own included (a sliding-window
            layer); None: every earlier key.
    """

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    @property
    def plain_scores(self) -> bool:
        """Whether the scores are the defaults (no scale, no soft-cap); a window may still apply."""
        return self.scale is None and self.softcap is None

    @property
    def plain(self) -> bool:
        """Whether these are the defaults (every strategy's own path applies)."""
        return self.plain_scores and self.window is None


class HostAttention(Protocol):
    """Attention of queries over one run of KV rows held in host RAM, where they are, in their
    format (the native kernels' :class:`~hybridllm.kernels.host_attention.HostPartialAttention`):
    the host part of a split attention.

    ``q`` (1, H, T, D) on the host, every query after every key of ``run`` (one layer's run as
    :data:`~hybridllm.kvcache.base.RUN_FIELDS` describes it) -> out (1, H, T, D) and lse (1, H, T),
    float32, as :func:`partial_attention` gives them. ``reads`` says which shapes it takes.
    """

    def __call__(self, q: torch.Tensor, run: Mapping[str, int], n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def reads(self, n_heads: int, n_kv_heads: int, head_dim: int, batch_size: int) -> bool:
        ...


PLAIN = AttentionOptions()


def layer_attention(config: ModelConfig, context_length: int | None = None) -> tuple[AttentionOptions, ...]:
    """Every layer's :class:`AttentionOptions` of a model; () when all of them are plain.

    A window that holds the whole context (``context_length`` tokens, when given) never hides a
    key, so it is dropped: a Mistral model (window 4096) run with ``--ctx-size 4096`` attends
    plainly, and every KV strategy and decode backend serves it."""
    def window(i: int) -> int | None:
        size = config.layer_window(i)
        return None if size is None or (context_length is not None and size >= context_length) else size

    options = tuple(AttentionOptions(config.attention_scale, config.attn_logit_softcapping, window(i))
                    for i in range(config.n_layers))
    return () if all(o.plain for o in options) else options


def causal_mask(n_queries: int, n_keys: int, query_start: int, device: torch.device) -> torch.Tensor:
    """Boolean mask (T, S): query t (at position query_start + t) may see key s iff s <= its position."""
    q_pos = torch.arange(query_start, query_start + n_queries, device=device)[:, None]
    k_pos = torch.arange(n_keys, device=device)[None, :]
    return k_pos <= q_pos


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: int, *,
                     scale: float | None = None, softcap: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Causal grouped-query attention.

    Args:
        q: (B, H, T, D) queries at positions ``query_start .. query_start + T - 1``.
        k, v: (B, Hkv, S, D) keys/values at positions ``0 .. S - 1`` (S = query_start + T).
        scale, softcap, window: as :class:`AttentionOptions` (None: plain attention).
    Returns:
        (B, H, T, D).
    """
    if scale is not None or softcap is not None or window is not None:
        return windowed_attention(q, k, v, query_start, AttentionOptions(scale, softcap, window))
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads = k.shape[1]
    groups = n_heads // n_kv_heads
    if n_queries == 1:  # decode: one query sees every key, no mask
        q_grouped = q.reshape(batch, n_kv_heads, groups, head_dim)  # (B, Hkv, G, D)
        out = sdpa(q_grouped, k, v)  # (B, Hkv, G, D)
        return out.reshape(batch, n_heads, 1, head_dim)
    if query_start == 0:  # prefill with no past: causal as such (the flash kernels apply)
        return sdpa(q, k, v, is_causal=True, enable_gqa=groups > 1)  # (B, H, T, D)
    if q.device.type == "cuda":  # chunked prefill: lower-right causal, no (T, S) mask
        return lower_right_causal_attention(q, k, v)
    return split_causal_attention(q, k, v, query_start).to(q.dtype)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: int,
                       options: AttentionOptions, key_start: int = 0) -> torch.Tensor:
    """Causal attention with a sliding window, another scale and/or soft-capped scores, in the
    order of transformers' eager Gemma attention: scores x scale, soft-cap, mask, float32 softmax.

    Keys older than every query's window are not read (a decode step reads ``window`` keys).

    Args:
        q: (B, H, T, D) at positions ``query_start ..``; k, v: (B, Hkv, query_start + T - key_start, D),
            the keys at positions ``key_start ..`` (a cache may leave out the ones no window shows).
        options: the layer's :class:`AttentionOptions`.
    Returns:
        (B, H, T, D) in q's dtype.
    """
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], key_start + k.shape[2]
    first = 0 if options.window is None else max(0, query_start - options.window + 1)  # oldest key any query sees
    if first < key_start:
        raise ValueError(f"keys from position {key_start} on: the queries see position {first}")
    k, v = k[:, :, first - key_start:], v[:, :, first - key_start:]  # (B, Hkv, S', D)
    q_pos = torch.arange(query_start, query_start + n_queries, device=q.device)[:, None]  # (T, 1)
    k_pos = torch.arange(first, n_keys, device=q.device)[None, :]  # (1, S')
    visible = k_pos <= q_pos
    if options.window is not None:
        visible = visible & (k_pos > q_pos - options.window)  # (T, S')
    scale = options.scale if options.scale is not None else head_dim ** -0.5
    q5 = q.float().reshape(batch, n_kv_heads, n_heads // n_kv_heads, n_queries, head_dim)  # (B, Hkv, G, T, D)
    scores = torch.matmul(q5, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, T, S')
    if options.softcap is not None:
        scores = torch.tanh(scores / options.softcap) * options.softcap
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.matmul(probs, v.float().unsqueeze(2))  # (B, Hkv, G, T, D)
    return out.reshape(batch, n_heads, n_queries, head_dim).to(q.dtype)


def lower_right_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last T positions over S keys through ``causal_lower_right``.

    PyTorch runs it in the flash kernel (grouped-query heads native), else in the memory-efficient
    one, which takes equal head counts: K/V heads are repeated only where flash does not apply
    (float32, old GPUs). q: (B, H, T, D); k, v: (B, Hkv, S, D). Returns (B, H, T, D).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    return sdpa(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=groups > 1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the CUDA backends named (:data:`CUDA_SDPA_BACKENDS`);
    on other devices PyTorch's own choice, as before."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **options)


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: int) -> torch.Tensor:
    """Chunked-prefill attention without a (T, S) mask: the past keys (every query sees them all)
    and the new block (causal, a (T, T) mask) as two partials merged by log-sum-exp.

    Args:
        q: (B, H, T, D) at positions ``query_start ..``; k, v: (B, Hkv, query_start + T, D).
    Returns:
        (B, H, T, D) float32.
    """
    n_queries = q.shape[2]
    past = partial_attention(q, k[:, :, :query_start], v[:, :, :query_start])
    block = causal_mask(n_queries, n_queries, 0, q.device)  # (T, T): the new tokens among themselves
    new = partial_attention(q, k[:, :, query_start:], v[:, :, query_start:], block)
    return merge_partials([past, new])


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding in PyTorch: attention of ``q`` over every key, the keys split in chunks of
    ``chunk_tokens``, each chunk's partial output and log-sum-exp merged exactly.

    Args:
        q: (B, H, T, D) (every query sees every key); k, v: (B, Hkv, S, D).
        chunk_tokens: keys per chunk (> 0).
    Returns:
        out (B, H, T, D) and lse (B, H, T), float32: the lse is the whole key set's, so the result
        merges with other key sets (another tier's) by :func:`merge_partials`.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    parts = [partial_attention(q, k[:, :, s:s + chunk_tokens], v[:, :, s:s + chunk_tokens])
             for s in range(0, k.shape[2], chunk_tokens)]
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)  # (B, H, T)
    return merge_partials(parts), lse


def visible_keys(lengths: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(B, 1, 1, S) bool: key s is visible to row b when s < lengths[b] (built on the lengths'
    device from the tensor itself: no host sync, so a CUDA graph can capture it)."""
    key_index = torch.arange(n_keys, device=lengths.device)  # (S,)
    return (key_index[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


def length_masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   lengths: torch.Tensor) -> torch.Tensor:
    """One query per row over a static buffer whose rows hold ``lengths`` valid keys each.

    The mask is built from the tensor ``lengths`` on its device (no host sync, no branch on data:
    the step can be captured in a CUDA graph).

    Args:
        q: (B, H, 1, D); k, v: (B, Hkv, S, D) (a view of the buffer); lengths: (B,) int64,
            each in 1..S (keys 0 .. length - 1 are visible).
    Returns:
        (B, H, 1, D).
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    q_grouped = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)  # (B, Hkv, G, D)
    out = sdpa(q_grouped, k, v, attn_mask=visible_keys(lengths, n_keys))  # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, 1, head_dim)


def batched_products_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      lengths: torch.Tensor) -> torch.Tensor:
    """:func:`length_masked_decode_attention` as two batched matrix products over the (row, KV
    head) pairs, for a graph: the G grouped queries x the keys, then the weights x the values,
    the length mask and the softmax in float32 between them.

    Both products take K and V where they lie: a span shorter than the buffer is a strided view
    whose (row, KV head) batch dimensions still merge into one, so no copy of K or V is made on
    CUDA (the split form's chunked view does not merge and is copied each step: the second H100
    run's strided copies). No host sync, no branch on data; the products run in the buffer's
    dtype, as the split form's.

    Args:
        q: (B, H, 1, D); k, v: (B, Hkv, S, D) (a view of the buffer); lengths: (B,) int64 in 1..S.
    Returns:
        (B, H, 1, D) in q's dtype.
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    q_grouped = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)  # (B, Hkv, G, D)
    scores = torch.matmul(q_grouped, k.transpose(-1, -2)).float() / math.sqrt(head_dim)  # (B, Hkv, G, S)
    scores = torch.where(visible_keys(lengths, n_keys), scores, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # every row sees its first key: a finite max
    out = torch.matmul(weights.to(v.dtype), v).float() / weights.sum(dim=-1, keepdim=True)  # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, 1, head_dim).to(q.dtype)


def split_kv_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                              chunk_tokens: int) -> torch.Tensor:
    """:func:`length_masked_decode_attention` split along the keys (flash-decoding, for a graph).

    One SDPA call over a long buffer runs in few thread blocks at q_len 1 (batch x KV heads);
    here every ``chunk_tokens`` keys are a batch of the two products, so the reads of K and V
    spread over many blocks, and the chunks' partials merge by log-sum-exp. No host sync, no
    branch on data. The products run in the buffer's dtype (no float32 copy of K or V), the
    softmax and the merge in float32.

    Args:
        q: (B, H, 1, D); k, v: (B, Hkv, S, D) with S a multiple of ``chunk_tokens``;
            lengths: (B,) int64 in 1..S.
    Returns:
        (B, H, 1, D) in q's dtype.
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, n_keys = k.shape[1], k.shape[2]
    groups, n_chunks = n_heads // n_kv_heads, n_keys // chunk_tokens
    q5 = q.reshape(batch, n_kv_heads, 1, groups, head_dim)  # (B, Hkv, 1, G, D)
    k5 = k.reshape(batch, n_kv_heads, n_chunks, chunk_tokens, head_dim)  # (B, Hkv, C, chunk, D)
    v5 = v.reshape(batch, n_kv_heads, n_chunks, chunk_tokens, head_dim)
    scores = torch.matmul(q5, k5.transpose(-1, -2)).float() / math.sqrt(head_dim)  # (B, Hkv, C, G, chunk)
    key_index = torch.arange(n_keys, device=lengths.device).reshape(n_chunks, 1, chunk_tokens)  # (C, 1, chunk)
    visible = key_index[None, None] < lengths[:, None, None, None, None]  # (B, 1, C, 1, chunk)
    scores = scores.masked_fill(~visible, float("-inf"))
    chunk_max = scores.amax(dim=-1, keepdim=True)  # (B, Hkv, C, G, 1); -inf for a chunk past the row's length
    weights = torch.exp(scores - torch.where(torch.isfinite(chunk_max), chunk_max, torch.zeros_like(chunk_max)))
    sums = weights.sum(dim=-1, keepdim=True)  # (B, Hkv, C, G, 1)
    outs = torch.matmul(weights.to(v.dtype), v5).float()  # (B, Hkv, C, G, D), unnormalized
    scale = torch.exp(chunk_max - chunk_max.amax(dim=2, keepdim=True))  # (B, Hkv, C, G, 1); 0 for empty chunks
    out = (scale * outs).sum(dim=2) / (scale * sums).sum(dim=2)  # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, 1, head_dim).to(q.dtype)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one subset of the keys, with the log-sum-exp of its scores.

    Args:
        q: (B, H, T, D); k, v: (B, Hkv, S, D); mask: optional bool (T, S), True = may attend.
    Returns:
        out (B, H, T, D) in float32 and lse (B, H, T) in float32. Rows with no visible key get
        out = 0 and lse = -inf, so they drop out of :func:`merge_partials`.
    """
    if q.device.type == "cpu" and _FUSED_CPU is not None and q.dtype == k.dtype == v.dtype:
        return fused_partial_attention(q, k, v, mask)
    if mask is None and _fused_cuda_applies(q, k, v):
        return fused_cuda_partial_attention(q, k, v)
    return reference_partial_attention(q, k, v, mask)


def _fused_cuda_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fused_cuda_partial_attention` takes these tensors (CUDA, one dtype, the op present)."""
    return q.device.type == "cuda" and _FUSED_CUDA is not None and q.dtype == k.dtype == v.dtype


def lower_right_partial_attention(q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` of the last T positions of S keys, causal (lower-right): the
    past keys (every query sees them) and the new block (T x T, causal) as two partials merged
    by log-sum-exp. On CUDA both run in the fused memory-efficient kernel (no (T, S) score
    matrix); elsewhere the block takes a (T, T) mask.

    q: (B, H, T, D); k, v: (B, Hkv, S, D), S >= T. Returns out (B, H, T, D), lse (B, H, T), float32.
    """
    n_queries, n_keys = q.shape[2], k.shape[2]
    past = n_keys - n_queries
    block_k, block_v = k[:, :, past:], v[:, :, past:]  # (B, Hkv, T, D): the queries' own keys
    if _fused_cuda_applies(q, block_k, block_v):
        block = fused_cuda_partial_attention(q, block_k, block_v, causal=True)
    else:
        block = partial_attention(q, block_k, block_v, causal_mask(n_queries, n_queries, 0, q.device))
    if past == 0:
        return block
    return merge_partials_with_lse([partial_attention(q, k[:, :, :past], v[:, :, :past]), block])


# PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp (a private op: if a
# release drops it, the explicit version below takes over).
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` through PyTorch's fused CPU kernel (no (T, S) score matrix)."""
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads = k.shape[1]
    groups = n_heads // n_kv_heads
    q_grouped = q.reshape(batch, n_kv_heads, groups * n_queries, head_dim)  # (B, Hkv, G*T, D)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = bias.repeat(groups, 1)  # (G*T, S)
    out, lse = _FUSED_CPU(q_grouped, k, v, 0.0, False, attn_mask=bias)  # (B, Hkv, G*T, D), (B, Hkv, G*T)
    out = out.float().reshape(batch, n_heads, n_queries, head_dim)
    lse = lse.float().reshape(batch, n_heads, n_queries)
    if mask is not None:
        blind = ~mask.any(dim=-1)  # (T,): queries that see no key here; the kernel reports lse 0
        if bool(blind.any()):
            lse = lse.masked_fill(blind, float("-inf"))
            out = out.masked_fill(blind[:, None], 0.0)
    return out, lse


# PyTorch's memory-efficient CUDA kernel, which returns the log-sum-exp too (a private op: where a
# release lacks it, the explicit version takes over).
_FUSED_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def fused_cuda_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` through PyTorch's memory-efficient CUDA kernel (no (T, S) score
    matrix). Without a mask the grouped query heads fold into the query axis (K/V never repeat);
    ``causal`` (a square T x T block, so upper-left and lower-right alignments agree) needs a K/V
    head per query head, repeated."""
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads = k.shape[1]
    groups = n_heads // n_kv_heads
    if causal:
        if n_queries != k.shape[2]:
            raise ValueError(f"a causal partial needs a square block, got {n_queries} queries over {k.shape[2]} keys")
        q_rows = q
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    else:
        q_rows = q.reshape(batch, n_kv_heads, groups * n_queries, head_dim)  # (B, Hkv, G*T, D)
    out, lse = _FUSED_CUDA(q_rows, k, v, None, True, 0.0, causal)[:2]  # lse (B, heads, rows padded to 32)
    out = out.float().reshape(batch, n_heads, n_queries, head_dim)
    lse = lse[..., :q_rows.shape[2]].float().reshape(batch, n_heads, n_queries)
    return out, lse


def reference_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` in explicit float32 matmuls (any device)."""
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads = k.shape[1]
    groups = n_heads // n_kv_heads
    q5 = q.float().reshape(batch, n_kv_heads, groups, n_queries, head_dim)  # (B, Hkv, G, T, D)
    scores = torch.matmul(q5, k.float().unsqueeze(2).transpose(-1, -2)) / math.sqrt(head_dim)  # (B, Hkv, G, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G, T)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    out = torch.matmul(weights, v.float().unsqueeze(2))  # (B, Hkv, G, T, D)
    return out.reshape(batch, n_heads, n_queries, head_dim), lse.reshape(batch, n_heads, n_queries)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exactly combine partial attentions over disjoint key sets.

    With m = max_i lse_i: out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m).
    Every part must be on the same device; returns (B, H, T, D) float32.
    """
    return merge_partials_with_lse(parts)[0]


def merge_partials_with_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` and the union's log-sum-exp, m + log sum_i e^(lse_i - m), so that the
    result merges further (a running merge over slices of keys keeps one partial in memory)."""
    lses = torch.stack([lse for _, lse in parts])  # (P, B, H, T)
    m = lses.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scale = torch.exp(lses - m)  # (P, B, H, T); parts with lse=-inf get 0
    num = sum(s.unsqueeze(-1) * out for s, (out, _) in zip(scale, parts))
    total = scale.sum(dim=0)  # (B, H, T)
    return num / total.unsqueeze(-1), m + torch.log(total)


def quantized_partial_attention(
    q: torch.Tensor, keys: QuantizedBlock, values: QuantizedBlock, unpack: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` (no mask: every query sees every key) read straight from codes.

    Values are quantized per token in groups of ``values.group`` channels, keys per channel in
    groups of ``keys.group`` tokens or (``keys.per_token``) like the values (``x = code * scale
    + zero``). The scales and zeros are folded into the small side of each product instead of
    dequantizing the cache:

        q . k_t = sum_d (q_d s_gd) c_td + sum_d q_d z_gd                (per channel; g: the token group of t)
        q . k_t = sum_g s_tg (q_g . c_tg) + sum_g z_tg sum_(d in g) q_d (per token; g: a channel group)
        sum_t p_t v_td = sum_t (p_t s_tg) c_td + sum_t p_t z_tg         (g: the channel group of d)

    so the only full-size pass is the codes' conversion to float32.

    Args:
        q: (B, H, T, D).
        keys: codes (B, Hkv, S, D*bits/8) uint8, scale/zero (B, Hkv, S/group, D) per channel or
            (B, Hkv, S, D/group) per token.
        values: codes (B, Hkv, S, D*bits/8) uint8, scale/zero (B, Hkv, S, D/group).
        unpack: packed codes -> (B, Hkv, S, D) uint8 codes (identity for 8 bits).
    Returns:
        out (B, H, T, D) and lse (B, H, T), both float32.
    """
    batch, n_heads, n_queries, head_dim = q.shape
    n_kv_heads = keys.codes.shape[1]
    rows = n_heads // n_kv_heads * n_queries  # query rows per KV head
    q_rows = q.float().reshape(batch, n_kv_heads, rows, head_dim)  # (B, Hkv, GT, D)
    scores_from_codes = _scores_from_token_codes if keys.per_token else _scores_from_codes
    scores = scores_from_codes(q_rows, keys, unpack) * (1.0 / math.sqrt(head_dim))  # (B, Hkv, GT, S)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, GT)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # (B, Hkv, GT, S)
    out = _weighted_values_from_codes(probs, values, unpack)  # (B, Hkv, GT, D)
    return out.reshape(batch, n_heads, n_queries, head_dim), lse.reshape(batch, n_heads, n_queries)


@dataclass(frozen=True)
class QuantizedBlock:
    """Codes with their group-wise scale and zero (float16), as :class:`QuantizedKV` stores them:
    ``per_token`` groups run along each token's channels, otherwise along each channel's tokens."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    per_token: bool = False


def _scores_from_codes(q_rows: torch.Tensor, keys: QuantizedBlock,
                       unpack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """q_rows (B, Hkv, GT, D) against per-channel quantized keys -> raw scores (B, Hkv, GT, S)."""
    batch, n_kv_heads, rows, head_dim = q_rows.shape
    codes = unpack(keys.codes).float()  # (B, Hkv, S, D)
    n_groups = codes.shape[2] // keys.group
    codes = codes.view(batch, n_kv_heads, n_groups, keys.group, head_dim)  # (B, Hkv, Gk, group, D)
    scale, zero = keys.scale.float(), keys.zero.float()  # (B, Hkv, Gk, D)
    q_scaled = q_rows.unsqueeze(2) * scale.unsqueeze(3)  # (B, Hkv, Gk, GT, D)
    scores = torch.matmul(q_scaled, codes.transpose(-1, -2))  # (B, Hkv, Gk, GT, group)
    offsets = torch.matmul(zero, q_rows.transpose(-1, -2))  # (B, Hkv, Gk, GT)
    scores = scores + offsets.unsqueeze(-1)
    return scores.transpose(2, 3).reshape(batch, n_kv_heads, rows, n_groups * keys.group)  # (B, Hkv, GT, S)


def _scores_from_token_codes(q_rows: torch.Tensor, keys: QuantizedBlock,
                             unpack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """q_rows (B, Hkv, GT, D) against per-token quantized keys -> raw scores (B, Hkv, GT, S)."""
    batch, n_kv_heads, rows, head_dim = q_rows.shape
    codes = unpack(keys.codes).float()  # (B, Hkv, S, D)
    n_keys, n_groups = codes.shape[2], head_dim // keys.group
    scale, zero = keys.scale.float(), keys.zero.float()  # (B, Hkv, S, Gk)
    if n_groups == 1:  # one group per token (the usual case): a scale and a zero per key
        dots = torch.matmul(q_rows, codes.transpose(-1, -2))  # (B, Hkv, GT, S)
        return dots * scale.transpose(-1, -2) + q_rows.sum(-1, keepdim=True) * zero.transpose(-1, -2)
    q_groups = q_rows.view(batch, n_kv_heads, rows, n_groups, keys.group).transpose(2, 3)  # (B, Hkv, Gk, GT, g)
    codes = codes.view(batch, n_kv_heads, n_keys, n_groups, keys.group).transpose(2, 3)  # (B, Hkv, Gk, S, g)
    dots = torch.matmul(q_groups, codes.transpose(-1, -2))  # (B, Hkv, Gk, GT, S)
    scores = (dots * scale.permute(0, 1, 3, 2).unsqueeze(3)).sum(2)  # (B, Hkv, GT, S)
    q_sums = q_groups.sum(-1)  # (B, Hkv, Gk, GT)
    return scores + torch.matmul(q_sums.transpose(-1, -2), zero.transpose(-1, -2))  # + (B, Hkv, GT, S)


def _weighted_values_from_codes(probs: torch.Tensor, values: QuantizedBlock,
                                unpack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """probs (B, Hkv, GT, S) times per-token quantized values -> (B, Hkv, GT, D)."""
    batch, n_kv_heads, rows, n_keys = probs.shape
    codes = unpack(values.codes).float()  # (B, Hkv, S, D)
    head_dim = codes.shape[-1]
    n_groups = head_dim // values.group
    scale, zero = values.scale.float(), values.zero.float()  # (B, Hkv, S, Gv)
    if n_groups == 1:  # one group per token (the usual case): a scale per key
        out = torch.matmul(probs * scale.transpose(-1, -2), codes)  # (B, Hkv, GT, D)
        return out + torch.matmul(probs, zero)  # + (B, Hkv, GT, 1)
    codes = codes.view(batch, n_kv_heads, n_keys, n_groups, values.group).transpose(2, 3)  # (B, Hkv, Gv, S, g)
    probs_scaled = probs.unsqueeze(2) * scale.permute(0, 1, 3, 2).unsqueeze(3)  # (B, Hkv, Gv, GT, S)
    out = torch.matmul(probs_scaled, codes)  # (B, Hkv, Gv, GT, g)
    out = out + torch.matmul(probs, zero).transpose(-1, -2).unsqueeze(-1)  # + (B, Hkv, Gv, GT, 1)
    return out.permute(0, 1, 3, 2, 4).reshape(batch, n_kv_heads, rows, head_dim)
