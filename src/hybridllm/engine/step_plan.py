"""What the scheduler decides for one step, as data: which sequences run which tokens.

    plan = scheduler.schedule()          # StepPlan: the rows of this step
    results = executor.execute(plan)     # each row's logits (or its error)
    processor.process(plan, results)     # tokens, stop rules, events, metrics

A row is one sequence's tokens for this step: its pending generated token(s) (decode), or a
chunk of its prompt (prefill). A feature that brings several tokens per row (speculative
decoding's drafts, multi-token prediction) plans a row with those tokens and ``all_logits``;
the executor runs it unchanged, in the same forward as every other row
(:class:`~hybridllm.engine.speculator.Speculator` turns decode rows into verification rows:
the pending token plus a ``draft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridllm.engine.sequence import SequenceState


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's part of a step.

    Attributes:
        seq: the sequence.
        token_ids: the tokens fed to the model, continuing the sequence's cache.
        prompt_start: where the chunk starts in the prompt (a prefill row), None for generated tokens.
        all_logits: every position's logits (prompt log-probabilities, verification), else the last one's.
        draft: the proposed tokens that end ``token_ids`` (speculative decoding: the row verifies them).
    """

    seq: SequenceState
    token_ids: list[int]
    prompt_start: int | None = None
    all_logits: bool = False
    draft: tuple[int, ...] = ()

    @property
    def is_prompt(self) -> bool:
        return self.prompt_start is not None

    @property
    def prompt_end(self) -> int:
        """The prompt tokens in the cache after this row (a prefill row)."""
        return self.prompt_start + len(self.token_ids)

    @property
    def completes_prompt(self) -> bool:
        return self.is_prompt and self.prompt_end == len(self.seq.prompt_ids)


@dataclass
class StepPlan:
    """The rows of one step, in the order they are processed (decode rows first)."""

    rows: list[ScheduledRow] = field(default_factory=list)

    @property
    def decode_rows(self) -> int:
        """Rows of generated tokens."""
        return sum(not row.is_prompt for row in self.rows)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the step runs."""
        return sum(len(row.token_ids) for row in self.rows if row.is_prompt)
