"""Verifying a proposal: which drafted tokens the model accepts, and the token it adds.

    verdict = verify_draft(logits, draft, sampler, grammar)   # logits (k + 1, vocab): the row's forward
    verdict.tokens      # the accepted drafted tokens, then one of the model's own
    verdict.accepted    # how many drafted tokens were accepted

A verification row feeds the sequence's pending token and its k drafted tokens; its logits row i
is the model's next-token distribution after drafted token i (row 0: after the pending token).
Each position goes through the sampling pipeline a one-token step uses
(:mod:`hybridllm.engine.sampling`: the grammar's mask, the logits processors over the tokens
accepted so far, then greedy or the probabilities), so:

- greedy: a drafted token is accepted while it is the argmax; the first position where it is not
  gives the argmax instead, and after a fully accepted draft the last row gives one more token.
  On the native kernels each row's logits are bitwise those of a one-token step, so the text is
  the text of plain decoding.
- sampled: the rule of Leviathan et al. (2023) and Chen et al. (2023) for a proposal that is a
  point mass (an n-gram continuation, a draft model's argmax): accept drafted token d with
  probability p(d); on rejection draw from p with d removed, renormalized; after a fully accepted
  draft draw from the last row. Every token then has the target distribution p exactly.

Penalties and the grammar advance over each accepted drafted token while the later positions are
processed, and are taken back before returning (``Sampler.forget``, ``GrammarMatcher.rollback``):
the verdict changes no state; appending its tokens does (``OutputProcessor.append_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.sampling import Sampler, draw, greedy_tokens, probabilities, process_logits
from hybridllm.engine.structured import GrammarError, GrammarMatcher


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verified proposal.

    Attributes:
        tokens: the accepted drafted tokens, then the model's own token (absent when an accepted
            drafted token completed the grammar: nothing may follow it).
        accepted: how many drafted tokens were accepted.
    """

    tokens: list[int]
    accepted: int

    @property
    def has_own_token(self) -> bool:
        """Whether the model added a token after the accepted ones (not when the grammar ended)."""
        return len(self.tokens) > self.accepted


def verify_draft(logits: torch.Tensor, draft: Sequence[int], sampler: Sampler,
                 grammar: GrammarMatcher | None = None) -> Verdict:
    """The verdict on ``draft`` (k tokens) from its row's ``logits`` (k + 1, vocab) float32 on
    the CPU, the model's own (not processed; left unchanged), by the sequence's sampler (its
    parameters, generator and penalty counts) and grammar.

    Raises:
        GrammarError: the grammar is in an error state (no token can continue it).
    """
    if len(logits) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} rows of logits, got {len(logits)}")
    if grammar is None and not sampler.processes_logits:  # every position's distribution is known now
        return _verify_unprocessed(logits, draft, sampler.params, sampler.generator)
    return _verify_stepwise(logits, draft, sampler, grammar)


def _verify_unprocessed(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
                        generator: torch.Generator) -> Verdict:
    """Rows without logits processors: every position at once."""
    if params.greedy:
        targets = greedy_tokens(logits)  # (k + 1,) argmaxes
        accepted = 0
        while accepted < len(draft) and targets[accepted] == draft[accepted]:
            accepted += 1
        return Verdict([*draft[:accepted], targets[accepted]], accepted)
    probs = probabilities(logits, params)  # (k + 1, vocab)
    for position, token in enumerate(draft):
        choice = _accept_or_replace(probs[position], token, generator)
        if choice is not None:
            return Verdict([*draft[:position], choice], position)
    return Verdict([*draft, draw(probs[-1:], [generator])[0]], len(draft))


def _verify_stepwise(logits: torch.Tensor, draft: Sequence[int], sampler: Sampler,
                     grammar: GrammarMatcher | None) -> Verdict:
    """Rows whose processing depends on the tokens before (penalties, a grammar): position by
    position, the accepted drafted tokens recorded and fed to the grammar for the next one, then
    taken back."""
    params = sampler.params
    recorded: list[int] = []
    fed = 0  # tokens the grammar took
    try:
        for position in range(len(draft) + 1):
            row = logits[position:position + 1].clone()  # (1, vocab)
            if grammar is not None:
                row[0].masked_fill_(~grammar.allowed(), float("-inf"))
            process_logits(row, [sampler])
            token = draft[position] if position < len(draft) else None
            if params.greedy:
                target = greedy_tokens(row)[0]
                choice = None if target == token else target
            else:
                probs = probabilities(row, params)[0]  # (vocab,)
                choice = (draw(probs[None], [sampler.generator])[0] if token is None
                          else _accept_or_replace(probs, token, sampler.generator))
            if choice is not None:
                return Verdict([*draft[:position], choice], position)
            sampler.record([token])
            recorded.append(token)
            if grammar is not None:
                try:
                    complete = grammar.advance(token)
                except GrammarError:  # allowed but refused: the append fails the sequence at this token
                    return Verdict(list(draft[:position + 1]), position + 1)
                fed += 1
                if complete:  # nothing but the end may follow
                    return Verdict(list(draft[:position + 1]), position + 1)
        raise AssertionError("unreachable: the last position always gives a token")
    finally:
        sampler.forget(recorded)
        if grammar is not None:
            grammar.rollback(fed)


def _accept_or_replace(probs: torch.Tensor, token: int, generator: torch.Generator) -> int | None:
    """Accept ``token`` with probability ``probs[token]`` (None), else a token drawn from
    ``probs`` (vocab,) without it."""
    if float(torch.rand((), generator=generator)) < float(probs[token]):
        return None
    residual = probs.clone()
    residual[token] = 0.0
    return int(torch.multinomial(residual, 1, generator=generator))

