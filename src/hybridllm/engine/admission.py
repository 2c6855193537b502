"""Admission arithmetic of the request loop: plain numbers, testable without tensors."""

from __future__ import annotations

from hybridllm.errors import HybridLLMError
from hybridllm.kvcache.base import KVBudgetError


class AdmissionError(HybridLLMError, ValueError):
    """The request's KV can never fit in the budgets (the server answers 400)."""


class DeviceRoomError(AdmissionError, KVBudgetError):
    """The device budget cannot hold a new sequence's first prefill chunk (and the tokens that
    must stay hot with it), with no adaptive policy to move it to the host."""


class QueueFullError(HybridLLMError):
    """The waiting queue is full (the server answers 503 with Retry-After)."""


def kv_bytes_needed(n_tokens: int, token_bytes: int, page_size: int) -> int:
    """Bytes of KV for ``n_tokens`` in whole pages of ``page_size`` tokens.

    ``token_bytes`` is the KV of one token across all layers (K and V, full precision).
    """
    if n_tokens < 0 or token_bytes < 0 or page_size < 1:
        raise ValueError("n_tokens and token_bytes must be >= 0 and page_size >= 1")
    pages = -(-n_tokens // page_size)
    return pages * page_size * token_bytes


def admission_decision(need: int, reserved: int, capacity: int | None) -> str:
    """"admit" when ``need`` bytes fit next to the ``reserved`` ones, "wait" when they will fit
    once others finish, "reject" when they can never fit."""
    if capacity is None:
        return "admit"
    if need > capacity:
        return "reject"
    return "admit" if reserved + need <= capacity else "wait"


