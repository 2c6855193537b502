"""Runs a step plan's forwards: one ``step(batch)`` per runner, the KV-budget rollback, longrope.

    results = executor.execute(plan)   # per row: its logits on the CPU, or the error that ended it

The rows of a plan that share a runner (the placed runner; the host runner for sequences that
moved there) go to it as one :class:`~hybridllm.runtime.forward_batch.ForwardBatch`: decode
rows, prefill chunks and rows of several generated tokens together, the backend running each
row as alone. Around each forward:

- longrope (Phi-3 128K): the forward that takes a sequence past the switch re-encodes its
  cached tokens first (the row starts at 0 with them), so all of its keys rotate with the long
  factors, as transformers' generate recomputes its cache;
- a forward that fails (a device budget exhausted mid-step: ``KVBudgetError``, or anything else)
  is rolled back in every row's cache (``KVCache.truncate`` to where it started) and each row
  runs alone; a row that still cannot fit moves to the host (``--kv-adaptive``) and runs there;
- after a row's forward the adaptive policy may re-plan it (relieve a full tier);
- the hidden-state bytes a forward moved between tiers count for the loop and, by tokens, for
  each row's sequence.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hybridllm.engine.policies import LoopPolicies
from hybridllm.engine.step_plan import ScheduledRow, StepPlan
from hybridllm.kvcache.base import KVBudgetError
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.runtime.forward_batch import ForwardBatch, ForwardRow

logger = logging.getLogger(__name__)


class RowResult(NamedTuple):
    """What one planned row's forward gave: ``logits`` (len(tokens) if ``all_logits`` else 1,
    vocab) float32 on the CPU, or the ``error`` that stopped it (its sequence must then fail)."""

    logits: torch.Tensor | None
    error: Exception | None = None


class Executor:
    """Runs the forwards of one request loop.

    Args:
        policies: the loop's policies (relieve after a forward, move to the host).
    """

    def __init__(self, policies: LoopPolicies) -> None:
        self.policies = policies
        self.hop_bytes = 0  # hidden-state bytes moved by every forward so far
        self.decode_batch_sizes: collections.Counter[int] = collections.Counter()  # decode rows per forward

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[RowResult]:
        """Each planned row's result, in plan order (one forward per runner)."""
        results: list[RowResult | None] = [None] * len(plan.rows)
        by_runner: dict[int, list[int]] = {}
        for i, row in enumerate(plan.rows):
            by_runner.setdefault(id(row.seq.runner), []).append(i)
        for indices in by_runner.values():
            rows = [plan.rows[i] for i in indices]
            decoding = sum(not row.is_prompt for row in rows)
            if decoding:
                self.decode_batch_sizes[decoding] += 1
            for i, result in zip(indices, self._run_together(rows)):
                results[i] = result
        return results

    def _run_together(self, rows: list[ScheduledRow]) -> list[RowResult]:
        """``rows`` (one runner) in one forward; on failure rolled back and run one by one."""
        forwards = [self._forward_row(row) for row in rows]
        if len(rows) == 1:
            return [self._run_alone(rows[0], forwards[0])]
        runner = rows[0].seq.runner
        try:
            logits = self._sharing_hops(runner, rows, forwards, lambda: runner.step(ForwardBatch(forwards)))
        except Exception:  # a budget or any other error: undo what it appended, run each row alone
            logger.debug("a forward of %d rows failed; running them one by one", len(rows), exc_info=True)
            BatchedCaches([f.cache for f in forwards]).truncate([f.start for f in forwards])
            return [self._run_alone(row, forward) for row, forward in zip(rows, forwards)]
        results = []
        for row, forward, row_logits in zip(rows, forwards, _on_host(logits)):
            try:
                self.policies.relieve(row.seq)
            except Exception as exc:
                results.append(RowResult(None, exc))
                continue
            results.append(RowResult(_own_logits(row, forward, row_logits)))
        return results

    def _run_alone(self, row: ScheduledRow, forward: ForwardRow) -> RowResult:
        """One row's forward; a device budget exhausted mid-way is rolled back and the row re-run on
        the host (when the adaptive policy is on)."""
        seq = row.seq
        try:
            try:
                logits = self._sharing_hops(seq.runner, [row], [forward], lambda: seq.runner.step(ForwardBatch([forward])))
            except KVBudgetError:
                forward.cache.truncate(forward.start)  # undo the layers that appended before the budget ran out
                if not self.policies.move_to_host(seq, "device KV budget exhausted mid-step"):
                    raise
                forward = ForwardRow(seq.cache, forward.token_ids, forward.start, forward.all_logits)
                logits = self._sharing_hops(seq.runner, [row], [forward], lambda: seq.runner.step(ForwardBatch([forward])))
            self.policies.relieve(seq)
        except Exception as exc:
            return RowResult(None, exc)
        return RowResult(_own_logits(row, forward, _on_host(logits)[0]))

    @staticmethod
    def _forward_row(row: ScheduledRow) -> ForwardRow:
        """The forward row of a planned row: its tokens after the cache, or, on the forward that
        takes a longrope sequence past the switch, every cached token before them (the cache
        emptied), so that all of its keys rotate with the long factors."""
        seq, cache = row.seq, row.seq.cache
        if seq.runner.crosses_rope_switch(cache.seq_length, len(row.token_ids)):
            cached = seq.cached_ids
            cache.truncate(0)
            return ForwardRow(cache, cached + row.token_ids, 0, row.all_logits)
        return ForwardRow(cache, row.token_ids, cache.seq_length, row.all_logits)

    def _sharing_hops(self, runner: Any, rows: Sequence[ScheduledRow], forwards: Sequence[ForwardRow],
                      forward: Callable[[], Any]) -> Any:
        """``forward()`` on ``runner``; the hidden-state bytes it moved count for the loop and, by
        their tokens, for each row's sequence."""
        hops_before = runner.hop_bytes
        result = forward()
        moved = runner.hop_bytes - hops_before
        self.hop_bytes += moved
        if moved:
            tokens = sum(f.n_tokens for f in forwards)
            for row, f in zip(rows, forwards):
                row.seq.hop_bytes += moved * f.n_tokens // tokens
        return result


def _own_logits(row: ScheduledRow, forward: ForwardRow, logits: torch.Tensor) -> torch.Tensor:
    """The planned row's logits: a re-encoded row's every-position logits end with its own tokens'."""
    return logits[-len(row.token_ids):] if forward.all_logits else logits


def _on_host(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every row's logits on the CPU (one transfer for all rows from a device)."""
    if all(t.device.type == "cpu" for t in logits):
        return logits
    return list(torch.cat(logits).cpu().split([t.shape[0] for t in logits]))

