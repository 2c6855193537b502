"""Drafting with a smaller model (``--model-draft``): its greedy continuation, k tokens ahead.

    drafter = DraftModelDrafter(draft_runtime, prefill_chunk=512)
    proposals = drafter.propose(requests)     # each sequence's draft model cache caught up, then
                                              # its argmax token by token
    drafter.rollback(state, verified)         # its cache cut back to the verified tokens

The draft model is a runtime of its own (built beside the target by
:func:`~hybridllm.runtime.build.build_runtime`, with the target's vocabulary, ``-ngld`` of its
layers on the device), and each sequence has its own draft KV cache, in the draft runtime's own
ledger (outside the target's KV budgets). A step's drafting is batched over the sequences: one
forward brings every sequence's draft cache up to its history (the tokens it has not seen: the
whole prompt at first, in chunks of ``prefill_chunk``, then the accepted tokens and the pending
one) and gives each its first proposed token; then one-token forwards for the sequences that
want more, until each has its length. The proposal is a point mass (the argmax), which is what
the verifier's accept/reject rule expects. The rejected part of a proposal is rolled back with
``KVCache.truncate`` in the draft cache too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridllm.engine.drafting import DraftRequest, SequenceSpeculation
from hybridllm.engine.sampling import greedy_tokens
from hybridllm.kvcache.base import KVCache
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow


class DraftModelDrafter:
    """Proposes the draft model's greedy continuation of each sequence.

    Args:
        draft: the draft model's runtime.
        prefill_chunk: most tokens a draft cache catches up in one forward.
    """

    method = "draft"

    def __init__(self, draft: Any, prefill_chunk: int) -> None:
        self.runtime = draft
        self.runner = draft.runner
        self.prefill_chunk = prefill_chunk
        self.ledger = draft.kv_ledger()  # the draft's KV: its own ledger, outside the target's budgets
        self.context_length = draft.context_length

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        lengths = [self._length(request) for request in requests]
        active = [i for i, length in enumerate(lengths) if length]
        proposals: list[list[int]] = [[] for _ in requests]
        if not active:
            return proposals
        caches = {i: self._cache(requests[i].state) for i in active}
        rows = [ForwardRow(caches[i], self._catch_up(requests[i], caches[i]), caches[i].seq_length) for i in active]
        for i, token in zip(active, self._argmax(rows)):
            proposals[i].append(token)
        active = [i for i in active if len(proposals[i]) < lengths[i]]
        while active:  # one proposed token per forward, each continuing its own cache
            rows = [ForwardRow(caches[i], [proposals[i][-1]], caches[i].seq_length) for i in active]
            for i, token in zip(active, self._argmax(rows)):
                proposals[i].append(token)
            active = [i for i in active if len(proposals[i]) < lengths[i]]
        return proposals

    def rollback(self, state: SequenceSpeculation, verified: int) -> None:
        cache: KVCache | None = state.drafter_state
        if cache is not None and cache.seq_length > verified:
            cache.truncate(verified)

    def release(self, state: SequenceSpeculation) -> None:
        cache: KVCache | None = state.drafter_state
        state.drafter_state = None
        if cache is not None:
            cache.reset()

    # ---- helpers -------------------------------------------------------------------------------
    def _length(self, request: DraftRequest) -> int:
        """The request's length within the draft model's context (its cache holds the sequence's
        tokens and all but the last proposed one)."""
        return max(0, min(request.length, self.context_length - request.n_tokens + 1))

    def _cache(self, state: SequenceSpeculation) -> KVCache:
        if state.drafter_state is None:
            state.drafter_state = self.runtime.new_cache(self.ledger)
        return state.drafter_state

    def _catch_up(self, request: DraftRequest, cache: KVCache) -> list[int]:
        """The tokens the draft cache has not seen; all but the last ``prefill_chunk`` of them are
        run here, in chunks (a long prompt's first proposal); the rest go in the batched forward."""
        missing = request.tokens_from(cache.seq_length)
        while len(missing) > self.prefill_chunk:
            chunk, missing = missing[:self.prefill_chunk], missing[self.prefill_chunk:]
            self.runner.step(ForwardBatch([ForwardRow(cache, chunk, cache.seq_length)]))
        return missing

    def _argmax(self, rows: list[ForwardRow]) -> list[int]:
        """One forward of ``rows``; each row's greedy next token."""
        logits = self.runner.step(ForwardBatch(rows))  # each (1, vocab)
        return greedy_tokens(torch.cat([row_logits[-1:] for row_logits in logits]).float().cpu())
