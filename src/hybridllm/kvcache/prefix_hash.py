"""Content addresses of KV pages: a chain hash over the token ids of each full page.

Page ``i`` of a sequence holds tokens ``i*P .. (i+1)*P - 1``. Its address hashes its parent's
address and its own token ids, so two sequences share page ``i``'s address exactly when they share
every token up to the end of that page (the keys and values of a token depend on all the tokens
before it). The first page's parent is the *salt*: the model's identity and the KV format, so
pages of another model, or of a format that stores different numbers, never match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

PAGE_TOKENS = 32  # tokens per reusable page: a prompt is reused up to its last whole page
DIGEST_BYTES = 16


def salt(*parts: str) -> bytes:
    """The root of every chain: a digest of what makes two caches' numbers comparable
    (model identity, KV format), each part a string."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=DIGEST_BYTES).digest()


def page_hashes(token_ids: Sequence[int], root: bytes, page_tokens: int = PAGE_TOKENS) -> list[bytes]:
    """The addresses of the whole pages of ``token_ids`` (a partial last page has none).

    Args:
        token_ids: the sequence's tokens, oldest first.
        root: the chain's root (:func:`salt`).
        page_tokens: tokens per page.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    hashes = []
    parent = root
    for page in range(len(ids) // page_tokens):
        chunk = ids[page * page_tokens:(page + 1) * page_tokens]
        parent = hashlib.blake2b(parent + chunk.tobytes(), digest_size=DIGEST_BYTES).digest()
        hashes.append(parent)
    return hashes
