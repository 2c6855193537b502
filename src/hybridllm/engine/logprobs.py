"""Log-probabilities of chosen tokens and their most likely alternatives.

They are the float32 log-softmax of the model's own logits at the position that chose the
token, before any sampling transform (bias, penalties, temperature, filters): what the model
assigns, not what the sampler drew from. Computed only for requests that ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the ``k`` most likely tokens.

    Attributes:
        token_id: the token at this position (generated, or the prompt's).
        logprob: its log-probability given everything before it.
        top: (token id, log-probability) of the most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default_factory=tuple)


def token_logprob(logits: torch.Tensor, token_id: int, top_k: int) -> TokenLogprob:
    """The entry of ``token_id`` chosen from ``logits`` (vocab,), with ``top_k`` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab,)
    return TokenLogprob(token_id, float(logprobs[token_id]), _top(logprobs, top_k))


def sequence_logprobs(logits: torch.Tensor, token_ids: list[int], top_k: int) -> list[TokenLogprob]:
    """Entries of ``token_ids`` (T,), each predicted by the row of ``logits`` (T, vocab) at the
    same index (row i is the model's output at the position before token i)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (T, vocab)
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)).squeeze(1)  # (T,)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if top_k > 0:  # one topk for all rows (a prompt scored by lm-eval has many)
        values, ids = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)  # (T, k) each
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(token_id, float(value), top) for token_id, value, top in zip(token_ids, chosen.tolist(), tops)]


def _top(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), values.tolist()))
