"""The static decode step run one step ahead, on the device's own greedy guess.

A decode step on a GPU is the device's work (~1.1 ms for a 1B model at 4K on an H200) plus the
host's: the engine plans the step, the backend writes the inputs and launches the graph, the
engine samples, appends tokens and sends events (~0.45 ms at one row). The host needs the step's
token before it can plan the next one, so without help the two add up and the device idles a
third of the time (the H200 run of 2026-11-28: 1.1 ms of CUDA time in a 1.56 ms step).

So, right after a step, the backend launches the next one on a side stream with the argmax of
the step's logits as every row's next token (the guess a greedy request makes; the tokens go
from the logits to the input block on the device, no host sync). The host then samples and
processes the step while the device already runs the next. When the engine asks for that next
step, the backend compares: the same rows at the next positions and the tokens the engine chose
equal to the guess (greedy rows always do) -> the step ran already, its logits are taken as
they are; anything else -> the guess is dropped and the step runs as usual. A dropped step cost
only device time: it wrote each row's key and value at the next position, which the real step
overwrites (the static step writes a row's column ``position``), and nothing reads past a row's
length. The guessed step is the very graph the real step would replay, over the same inputs, so
its logits are the same bits.

:class:`LookaheadPolicy` backs off where guesses miss (sampled requests): after a miss it skips
1, 2, 4 ... steps (at most :data:`MAX_SKIP`) before guessing again, so a sampling batch wastes at
most about one step in :data:`MAX_SKIP` of device time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SKIP = 64  # the longest run of steps without a guess after misses
ARGMAX_PARTS = (64, 32, 16, 8)  # the vocabulary is cut in this many parts (the first that divides it)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(-1)`` of (R, V) in two passes: the maximum of each of ``P`` parts of a row
    (P blocks per row, not one), then the first part holding the row's maximum. The first index of
    the maximum, as ``torch.argmax`` (NaN aside: a guess that differs only costs a miss).
    One block per 128K-entry row took 27 us on the H200, on the path to the next step."""
    rows, vocab = scores.shape
    parts = next((p for p in ARGMAX_PARTS if vocab % p == 0 and vocab // p >= 2), None)
    if parts is None:
        return scores.argmax(dim=-1)
    width = vocab // parts
    best, where = scores.view(rows, parts, width).max(dim=-1)  # (R, P) each: the parts' maxima, first index
    part = best.argmax(dim=-1, keepdim=True)  # (R, 1): the first part with the row's maximum
    return (part * width + where.gather(1, part))[:, 0]  # (R,)


@dataclass
class AheadStep:
    """A decode step launched ahead of the engine's call.

    Attributes:
        key: (pool generation, batch bucket, ((slot, position), ...)) of the rows it decoded.
        guess: (bucket,) int64 on the host: the token each slot was given (pinned on CUDA; its
            copy is done once ``copied`` is).
        copied: the event after the guess's copy to the host (None on the CPU: already there).
        logits: (bucket, 1, vocab) its output (the captured graph's own buffer on CUDA: read it
            only after the stream that replayed it).
    """

    key: tuple
    guess: torch.Tensor
    copied: torch.cuda.Event | None
    logits: torch.Tensor

    def guessed(self, slots: list[int]) -> list[int]:
        """The tokens it assumed for ``slots`` (waits for the guess's copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        return [int(self.guess[slot]) for slot in slots]


@dataclass
class LookaheadPolicy:
    """When to guess: always while guesses hit; after a run of misses, every 2^k-th step."""

    skip: int = 0  # steps left before the next guess
    misses_in_a_row: int = 0
    hits: int = 0
    misses: int = 0

    def wants_guess(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def hit(self) -> None:
        self.hits += 1
        self.misses_in_a_row = 0

    def miss(self) -> None:
        self.misses += 1
        self.misses_in_a_row += 1
        self.skip = min(MAX_SKIP, 1 << (self.misses_in_a_row - 1))
