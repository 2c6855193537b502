"""Which prompt chunks a step prefills: the prefill rows appended to a step's plan."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.engine.policies import LoopPolicies
from hybridllm.engine.sequence import SequenceState
from hybridllm.engine.step_plan import ScheduledRow, StepPlan

# Prompt tokens a step may prefill, in chunks, while no sequence is decoding: a burst of requests starts with its
# prompts prefilled in fewer, larger forwards (the chunks stay ``prefill_chunk`` long: no forward changes).
IDLE_PREFILL_CHUNKS = 4


def add_prefill_chunks(plan: StepPlan, batch: Sequence[SequenceState], prefill_chunk: int,
                       policies: LoopPolicies) -> StepPlan:
    """Append to ``plan`` the next chunk of each prefilling sequence of ``batch``, in order, within
    the step's prompt-token budget (one chunk while sequences decode, ``IDLE_PREFILL_CHUNKS``
    otherwise; the first chunk always fits). A chunk ends on a multiple of ``prefill_chunk``, so
    a prompt is cut the same way whatever else runs. Two prompts whose first page is the same
    are not started in one step: the second waits to reuse the first's pages from the prefix
    cache."""
    budget = prefill_chunk * (1 if plan.rows else IDLE_PREFILL_CHUNKS)
    used = 0
    in_flight: set[bytes] = set()  # first pages being prefilled (not cached yet) in this step
    for seq in [s for s in batch if s.in_prefill]:
        first_page = policies.first_page(seq)
        if first_page in in_flight:
            continue
        policies.reuse_prefix(seq)
        start = seq.prefilled
        end = min(len(seq.prompt_ids), (start // prefill_chunk + 1) * prefill_chunk)
        if used and used + (end - start) > budget:
            break
        used += end - start
        plan.rows.append(ScheduledRow(seq, seq.prompt_ids[start:end], start,
                                      all_logits=seq.params.prompt_logprobs is not None))
        if first_page is not None and start == 0:
            in_flight.add(first_page)
        if used >= budget:
            break
    return plan
