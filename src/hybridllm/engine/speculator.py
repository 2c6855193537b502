"""Speculative decoding in the request loop: proposals into the plan, verdicts out of the step.

    speculator = Speculator.of(runtime)          # drafts nothing when the runtime does not speculate
    plan = speculator.propose(plan)              # decode rows -> verification rows (pending + draft)
    results = executor.execute(plan)             # unchanged: a row of k + 1 tokens, every position's logits
    verdict = verify_draft(...)                  # the output processor, per verification row
    speculator.settle(seq, row, verdict)         # the rejected part rolled back (KV, drafter), figures

A decoding sequence asks its drafter (:class:`~hybridllm.engine.ngram.NgramDrafter`, or
:class:`~hybridllm.engine.draft_model.DraftModelDrafter` for ``--model-draft``) for up to k tokens,
k from its :class:`~hybridllm.engine.drafting.DraftPacer` within ``--draft-max``, the token budget
left and the context; a proposal shorter than ``--draft-min`` is dropped and the row stays a
one-token decode row. A step where more than ``--spec-max-batch`` sequences decode drafts
nothing (its weights are already read once for all of them). Each sequence drafts for itself, so one step verifies rows of different
lengths next to plain decode rows and prefill chunks, in one forward per runner. A request with
``speculative=False`` (the server's ``"speculative": false``) never drafts.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.draft_model import DraftModelDrafter
from hybridllm.engine.drafting import DraftPacer, Drafter, DraftRequest, SequenceSpeculation
from hybridllm.engine.ngram import NgramDrafter
from hybridllm.engine.sequence import SequenceState
from hybridllm.engine.step_plan import ScheduledRow, StepPlan
from hybridllm.engine.verification import Verdict

logger = logging.getLogger(__name__)


class Speculator:
    """Drafts for a request loop's decoding sequences and settles their verified rows.

    Args:
        config: the speculative settings (``--spec``, ``--draft-max`` ...).
        drafter: what proposes the tokens (None: the loop does not speculate; plans pass unchanged).
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None) -> None:
        self.config = config
        self.drafter = drafter

    @classmethod
    def of(cls, runtime: Any) -> Speculator:
        """The speculator of a built runtime: its ``speculative`` settings, a draft model's
        runtime in ``runtime.draft``."""
        config: SpeculativeConfig = runtime.speculative
        if config.method == "ngram":
            return cls(config, NgramDrafter(config.spec_ngram_min, config.spec_ngram_max))
        if config.method == "draft":
            return cls(config, DraftModelDrafter(runtime.draft, runtime.engine_config.prefill_chunk))
        return cls(config, None)

    @property
    def method(self) -> str:
        return self.config.method

    def propose(self, plan: StepPlan) -> StepPlan:
        """``plan`` with its decode rows' proposals: each row that gets one feeds its pending
        token and the proposal, with every position's logits (the other rows are unchanged)."""
        if self.drafter is None:
            return plan
        limit = self.config.spec_max_batch
        if limit and plan.decode_rows > limit:
            return plan
        requests: list[DraftRequest] = []
        where: list[int] = []
        for i, row in enumerate(plan.rows):
            seq = row.seq
            if row.is_prompt or not seq.params.speculative:
                continue
            if seq.speculation is None:
                seq.speculation = SequenceSpeculation(DraftPacer(self.config.draft_max, self.config.draft_min))
            length = seq.speculation.pacer.next_length(self.draft_limit(seq, len(row.token_ids)))
            if length:
                requests.append(DraftRequest(seq.prompt_ids, seq.generated, length, seq.speculation))
                where.append(i)
        if not requests:
            return plan
        try:
            proposals = self.drafter.propose(requests)
        except Exception:  # speculation only saves time: the step runs without it
            logger.exception("drafting failed; this step decodes without proposals")
            for request in requests:
                self.drafter.release(request.state)
            return plan
        rows = list(plan.rows)
        shortest = max(1, self.config.draft_min)
        for i, request, proposal in zip(where, requests, proposals):
            proposal = proposal[:request.length]
            if len(proposal) >= shortest:
                row = rows[i]
                rows[i] = ScheduledRow(row.seq, [*row.token_ids, *proposal], all_logits=True, draft=tuple(proposal))
        return StepPlan(rows)

    def draft_limit(self, seq: SequenceState, n_pending: int) -> int:
        """Most tokens ``seq`` may propose now: the token budget left, less the token the model
        adds after the accepted ones (so the KV never outgrows the sequence's reservation), and
        for a longrope model the room before its rotation switch (a verification row does not
        take a sequence across it: only the forward that must cross re-encodes its cache)."""
        limit = min(self.config.draft_max, seq.max_new_tokens - len(seq.generated) - 1)
        room = seq.runner.rope_switch_room(seq.cache.seq_length)
        if room is not None:
            limit = min(limit, room - n_pending)
        return max(0, limit)

    def settle(self, seq: SequenceState, row: ScheduledRow, verdict: Verdict) -> None:
        """After the verdict on ``row``'s proposal, before its tokens are appended: the KV of the
        rejected drafted tokens rolled back (``KVCache.truncate``), the drafter told what was
        kept, the sequence's figures and draft length updated."""
        rejected = len(row.draft) - verdict.accepted
        if rejected:
            seq.cache.truncate(seq.cache.seq_length - rejected)
        state = seq.speculation
        self.drafter.rollback(state, len(seq.prompt_ids) + len(seq.generated) + verdict.accepted)
        state.settled(len(row.draft), verdict.accepted)

    def release(self, seq: SequenceState) -> None:
        """The sequence left: what its drafter held for it is freed."""
        if seq.speculation is not None and self.drafter is not None:
            self.drafter.release(seq.speculation)
