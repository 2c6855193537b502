"""What every drafter shares: a sequence's speculation state, its draft length, its figures.

    state = SequenceSpeculation(DraftPacer(draft_max=16, draft_min=0))
    k = state.pacer.next_length(limit)     # how many tokens to propose this step (0: none)
    ...                                    # a drafter proposes up to k tokens, the model verifies them
    state.settled(drafted=k, accepted=a)   # the pacer and the figures learn the outcome

A drafter (:class:`Drafter`: :class:`~hybridllm.engine.ngram.NgramDrafter`,
:class:`~hybridllm.engine.draft_model.DraftModelDrafter`) proposes tokens for the decoding
sequences of a step; the request loop verifies them in the step's forward
(:mod:`hybridllm.engine.speculator`, :mod:`hybridllm.engine.verification`).

The draft length adapts per sequence (:class:`DraftPacer`): a verification row of k + 1 tokens
costs more than a one-token decode step (little on a memory-bound step, more once the products
are compute-bound), so a sequence whose proposals are rejected proposes fewer tokens and pauses,
and one whose proposals are all accepted proposes more, up to ``draft_max``. The length never
changes what is generated, only how much work a step does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

FIRST_DRAFT = 4  # tokens a sequence proposes first (at most draft_max)
MAX_PAUSE = 16  # most decode steps a sequence waits after proposals that were all rejected


class DraftPacer:
    """How many tokens one sequence proposes next.

    Starts at ``FIRST_DRAFT`` (at most ``draft_max``); a draft accepted whole doubles the
    length (up to ``draft_max``); a draft accepted in part sets it to one more than the accepted
    part; a draft rejected at its first token drops it to its floor and pauses drafting for 1, 2,
    4 ... ``MAX_PAUSE`` steps (doubling while rejections follow each other; any acceptance ends
    the streak). The floor is ``max(1, draft_min)``.

    Args:
        draft_max: most tokens per proposal.
        draft_min: fewest tokens worth a verification (shorter proposals are not made).
    """

    def __init__(self, draft_max: int, draft_min: int = 0) -> None:
        self.draft_max = draft_max
        self.floor = max(1, draft_min)
        self.length = max(self.floor, min(draft_max, FIRST_DRAFT))
        self.pause = 0  # decode steps left without a proposal
        self.misses = 0  # proposals in a row rejected at their first token

    def next_length(self, limit: int) -> int:
        """Tokens to propose this step, at most ``limit`` (the budget and context left); 0 when
        paused or when ``limit`` is below the floor. A paused step counts down the pause."""
        if self.pause:
            self.pause -= 1
            return 0
        length = min(self.length, limit)
        return length if length >= self.floor else 0

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a verified proposal of ``drafted`` tokens, ``accepted`` of them accepted."""
        if accepted == 0:
            self.misses += 1
            self.length = self.floor
            self.pause = min(MAX_PAUSE, 2 ** (self.misses - 1))
            return
        self.misses = 0
        if accepted == drafted:
            self.length = min(self.draft_max, self.length * 2)
        else:
            self.length = max(self.floor, min(self.draft_max, accepted + 1))


@dataclass
class SpecStats:
    """A sequence's speculation figures (vLLM's spec-decode counters, per request).

    Attributes:
        drafts: verified proposals.
        draft_tokens: tokens proposed and verified.
        accepted_tokens: proposed tokens the model accepted.
        accepted_per_position: how often the i-th token of a proposal was accepted.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (None before any proposal)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def to_dict(self, method: str) -> dict[str, Any]:
        """The request metrics' keys (``generate --json``, the bench, the server's usage)."""
        return {"spec_method": method, "spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_acceptance_rate": self.acceptance_rate}


@dataclass
class SequenceSpeculation:
    """One sequence's speculation state: its draft length, its figures and what its drafter keeps
    for it (an n-gram index, a draft model's KV cache)."""

    pacer: DraftPacer
    stats: SpecStats = field(default_factory=SpecStats)
    drafter_state: Any = None

    def settled(self, drafted: int, accepted: int) -> None:
        """A proposal was verified: the figures and the next draft length follow."""
        self.stats.add(drafted, accepted)
        self.pacer.update(drafted, accepted)


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's call for a proposal.

    Attributes:
        prompt: the sequence's prompt.
        generated: its generated tokens (the last is its pending token, not in its KV yet).
        length: the most tokens to propose.
        state: the sequence's speculation state (its drafter keeps its own part in ``drafter_state``).
    """

    prompt: Sequence[int]
    generated: Sequence[int]
    length: int
    state: SequenceSpeculation

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tokens_from(self, start: int) -> list[int]:
        """The sequence's tokens from position ``start`` on (prompt, then generated)."""
        prompt = self.prompt
        if start >= len(prompt):
            return list(self.generated[start - len(prompt):])
        return [*prompt[start:], *self.generated]


class Drafter(Protocol):
    """Proposes tokens for decoding sequences (one proposal per request, any length up to its
    ``length``, possibly empty), and follows their verified histories."""

    method: str

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's proposal, in order."""
        ...

    def rollback(self, state: SequenceSpeculation, verified: int) -> None:
        """The first ``verified`` tokens of the sequence's tokens plus its last proposal are its
        history now (the tokens it had and the accepted part of the proposal): the drafter
        forgets what it derived from the rest."""
        ...

    def release(self, state: SequenceSpeculation) -> None:
        """The sequence left: free what the drafter holds for it."""
        ...
