"""llama.cpp's row order for the Q and K projections of ``llama``-architecture GGUF files.

llama.cpp's converter permutes, per attention head, the rows of ``attn_q`` and ``attn_k``
(weights and biases) from Hugging Face's "rotate half" rotary layout to the interleaved layout
its kernels use. Rows are independent, so the permutation commutes with block quantization and
can be undone on raw row blocks as well as on float tensors.
"""

from __future__ import annotations

import torch

# GGUF architectures whose converter permutes Q/K rows: only llama's (Mistral files included).
# qwen2, qwen3 and phi3 keep Hugging Face's order: llama.cpp runs them with NeoX-style rotary.
PERMUTED_ARCHITECTURES = frozenset({"llama"})


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K permutation: per head, rows (2, D/2) -> (D/2, 2) (rotate-half -> interleaved)."""
    rows = w.shape[0]
    # (n_heads, 2, head_dim // 2, *rest) -> (n_heads, head_dim // 2, 2, *rest)
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_rows`: interleaved rotary rows back to the rotate-half layout."""
    rows = w.shape[0]
    # (n_heads, head_dim // 2, 2, *rest) -> (n_heads, 2, head_dim // 2, *rest)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
