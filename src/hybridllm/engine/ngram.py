"""Model-free drafting (``--spec ngram``): propose what followed the last match of the newest tokens.

    index = NgramIndex(n_min=2, n_max=4)
    index.extend(prompt, generated)        # the tokens not seen yet (the history only grows)
    index.propose(8)                       # what followed the latest earlier occurrence of the
                                           # last 4, else 3, else 2 tokens; [] when none occurred

Text that repeats its input (editing code, rewriting, extracting, quoting) continues the way the
prompt did, so its proposals are accepted most of the time; where nothing matches, nothing is
proposed and the step is a plain one-token decode.

The index maps every n-gram of the sequence (n in ``[n_min, n_max]``) to where it last ended and
is kept up to date as tokens arrive (a few dictionary writes per token), so a proposal never
rescans the history. The continuation of a match that ends near the present repeats itself
(the match's continuation read through the proposal: a loop continues as a loop).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.engine.drafting import DraftRequest, SequenceSpeculation


class NgramIndex:
    """The n-grams of one sequence's tokens and where each last ended.

    Args:
        n_min, n_max: the n-gram lengths matched (longest first).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> exclusive end of its latest occurrence
        self._indexed = 0  # every n-gram ending at or before this position is in ``_last_end``

    def extend(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Take the sequence's tokens (prompt, then generated) beyond those already held."""
        held = len(self.tokens)
        if held < len(prompt):
            self.tokens.extend(prompt[held:])
            held = len(prompt)
        self.tokens.extend(generated[held - len(prompt):])

    def propose(self, length: int) -> list[int]:
        """Up to ``length`` tokens: what followed the latest earlier occurrence of the longest
        suffix (``n_max`` down to ``n_min`` tokens) that occurred before; [] when none did."""
        tokens = self.tokens
        end = len(tokens)
        self._index_until(end - 1)  # every n-gram but the suffixes themselves
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            match_end = self._last_end.get(tuple(tokens[end - n:]))
            if match_end is not None:
                return self._continuation(match_end, length)
        return []

    def _index_until(self, end: int) -> None:
        """Record the n-grams ending at positions ``_indexed + 1 .. end`` (exclusive ends)."""
        tokens, last_end = self.tokens, self._last_end
        for stop in range(self._indexed + 1, end + 1):
            for n in range(self.n_min, min(self.n_max, stop) + 1):
                last_end[tuple(tokens[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)

    def _continuation(self, start: int, length: int) -> list[int]:
        """``length`` tokens from ``start`` of the tokens followed by the proposal itself."""
        tokens, end = self.tokens, len(self.tokens)
        proposal: list[int] = []
        for position in range(start, start + length):
            proposal.append(tokens[position] if position < end else proposal[position - end])
        return proposal


class NgramDrafter:
    """Proposes each sequence's n-gram continuation (:class:`NgramIndex`, one per sequence).

    Args:
        n_min, n_max: ``--spec-ngram-min`` and ``--spec-ngram-max``.
    """

    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        proposals = []
        for request in requests:
            index = request.state.drafter_state
            if index is None:
                index = request.state.drafter_state = NgramIndex(self.n_min, self.n_max)
            index.extend(request.prompt, request.generated)
            proposals.append(index.propose(request.length))
        return proposals

    def rollback(self, state: SequenceSpeculation, verified: int) -> None:
        return None  # the index holds the sequence's own tokens only, never a proposal

    def release(self, state: SequenceSpeculation) -> None:
        state.drafter_state = None
