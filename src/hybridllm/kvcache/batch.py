"""A batch of independent caches seen by the model as one cache (continuous batching).

Every sequence of a batch keeps its own paged KV cache (its own length, tiers and pages); the
model runs its projections and MLPs for all rows at once and this adapter routes each row's
queries/keys/values to that row's cache, so the large matmuls are batched while attention stays
per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridllm.kvcache.base import InPlaceRows, KVCache


class BatchedCaches:
    """Row ``i`` of every ``attend`` call goes to ``caches[i]``.

    Only the part of the :class:`~hybridllm.kvcache.base.KVCache` interface that the model uses
    is provided: :meth:`attend`, the per-row start positions :attr:`seq_lengths`, :meth:`truncate`
    (each row to its own length), and in-place rows for a batch of one (its sequence's cache's).
    The native decode step reads :attr:`caches` to claim each row's own in-place rows (a batch
    decodes natively in one call).

    Args:
        caches: one cache per batch row, each holding a single sequence (batch size 1).
    """

    def __init__(self, caches: Sequence[KVCache]) -> None:
        if not caches:
            raise ValueError("BatchedCaches needs at least one cache")
        self.caches = list(caches)

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def seq_lengths(self) -> list[int]:
        """Tokens cached per row: the position of each row's next token."""
        return [cache.seq_length for cache in self.caches]

    def start_positions(self) -> torch.Tensor:
        """The rows' next positions as a (B,) tensor, the model's per-row ``start_pos``."""
        return torch.tensor(self.seq_lengths, dtype=torch.long)

    def supports_in_place(self, layer_idx: int) -> bool:
        return len(self.caches) == 1 and self.caches[0].supports_in_place(layer_idx)

    def in_place_rows(self, layer_indices: Sequence[int], n_new: int) -> InPlaceRows:
        if len(self.caches) != 1:
            raise ValueError(f"in-place rows serve a batch of one, not {len(self.caches)}")
        return self.caches[0].in_place_rows(layer_indices, n_new)

    def attend(self, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """Split the batch by row, let each sequence's cache attend, and stack the outputs.

        Args:
            q: (B, H, T, D); k_new, v_new: (B, Hkv, T, D), row i at caches[i]'s positions.
        Returns:
            (B, H, T, D).
        """
        if q.shape[0] != len(self.caches):
            raise ValueError(f"batch of {q.shape[0]} rows for {len(self.caches)} caches")
        outs = [
            cache.attend(layer_idx, q[i:i + 1], k_new[i:i + 1], v_new[i:i + 1])  # (1, H, T, D)
            for i, cache in enumerate(self.caches)
        ]
        return torch.cat(outs, dim=0)  # (B, H, T, D)

    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Roll each row's cache back to its first ``lengths[i]`` tokens (an int: the same for
        every row), as :meth:`KVCache.truncate` (a failed step's rows, a rejected draft's)."""
        if isinstance(lengths, int):
            lengths = [lengths] * len(self.caches)
        if len(lengths) != len(self.caches):
            raise ValueError(f"{len(lengths)} lengths for a batch of {len(self.caches)} rows")
        for cache, length in zip(self.caches, lengths):
            cache.truncate(length)
