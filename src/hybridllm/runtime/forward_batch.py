"""What one forward runs: rows of any length, each continuing its own KV cache.

    batch = ForwardBatch([
        ForwardRow(cache_a, [token], cache_a.seq_length),                         # a decode step
        ForwardRow(cache_b, prompt[512:1024], 512),                               # a prefill chunk
        ForwardRow(cache_c, [token, *draft], cache_c.seq_length, all_logits=True),  # k + 1 rows to verify
    ])
    logits = runner.step(batch)   # logits[i]: (len(tokens of row i) if all_logits else 1, vocab) float32

A row is one sequence's tokens for this step: one token, a prompt chunk, or several generated
tokens at once (speculative decoding's verification, multi-token prediction). The backend decides
how the rows run (one kernel call for many rows, the model's layers row by row); each row's
logits and KV are those of its forward alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hybridllm.kvcache.base import KVCache
from hybridllm.kvcache.batch import BatchedCaches


@dataclass(frozen=True)
class ForwardRow:
    """One sequence's tokens in a forward.

    Attributes:
        cache: the sequence's own KV cache (a batch of one); the tokens are appended to it.
        token_ids: the tokens to run, at positions ``start .. start + len(token_ids) - 1``.
        start: the position of the first token: the cache's length (the runner checks it).
        all_logits: logits of every token of the row, else of its last one only.
    """

    cache: KVCache
    token_ids: Sequence[int]
    start: int
    all_logits: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a forward row needs at least one token")

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_logits(self) -> int:
        """Rows of logits this row gets back."""
        return len(self.token_ids) if self.all_logits else 1


@dataclass(frozen=True)
class ForwardBatch:
    """The rows of one forward, in the order their logits come back."""

    rows: Sequence[ForwardRow]

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a forward batch needs at least one row")
        object.__setattr__(self, "rows", tuple(self.rows))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ForwardRow]:
        return iter(self.rows)

    @property
    def n_tokens(self) -> int:
        """Tokens of every row together."""
        return sum(row.n_tokens for row in self.rows)

    def check_positions(self) -> None:
        """Raise ValueError unless every row starts where its cache ends."""
        for i, row in enumerate(self.rows):
            if row.start != row.cache.seq_length:
                raise ValueError(f"row {i} starts at position {row.start} but its cache holds "
                                 f"{row.cache.seq_length} tokens")


def one_token_inputs(rows: Sequence[ForwardRow]) -> tuple[torch.Tensor, KVCache | BatchedCaches, int | torch.Tensor]:
    """Rows of one token each as one (B, 1) forward's inputs: the ids (B, 1), the cache (a row's
    own for a batch of one, else a :class:`BatchedCaches`) and the start (an int, or (B,) per row)."""
    ids = torch.tensor([[row.token_ids[0]] for row in rows], dtype=torch.long)  # (B, 1)
    if len(rows) == 1:
        return ids, rows[0].cache, rows[0].start
    return ids, BatchedCaches([row.cache for row in rows]), torch.tensor([row.start for row in rows])
