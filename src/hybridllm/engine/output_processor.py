"""From a step's logits to tokens, text, events and metrics.

    processor.process(plan, results)   # after the executor ran the plan's forwards

For each planned row: a failed forward ends its sequence with the error; a prefill chunk
records its prompt log-probabilities, and the chunk that completes a prompt migrates the
sequence (``--decode-on host``), forks the request's other ``n - 1`` sequences and samples
their first tokens; a decode row samples its next token. Every row that needs a token is sampled
at once (:func:`~hybridllm.engine.sampling.sample_rows`: the grammar masks, the logits
processors and the draw, vectorized over rows), then :meth:`OutputProcessor.append_tokens` gives
each sequence its tokens: log-probabilities, timing, the stop rules over one or several
appended tokens (EOS ids, stop strings, the budget, a complete grammar: a sequence stops at the
first token that ends it), its events and, when it finishes, its metrics, the prefix cache's
pages and its KV released before its last event is sent. A verification row (a decode row with
a proposal, speculative decoding) gets its verdict (:func:`~hybridllm.engine.verification.verify_draft`),
its rejected part rolled back (:meth:`~hybridllm.engine.speculator.Speculator.settle`), then its
tokens appended the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridllm.engine.executor import RowResult
from hybridllm.engine.logprobs import TokenLogprob, sequence_logprobs, token_logprob
from hybridllm.engine.metrics import HostPeakMemory
from hybridllm.engine.observer import SchedulerObserver
from hybridllm.engine.output import RequestOutput
from hybridllm.engine.policies import LoopPolicies
from hybridllm.engine.request_record import sequence_metrics
from hybridllm.engine.sampling import Sampler, sample_rows
from hybridllm.engine.sequence import SeqEvent, SequenceState
from hybridllm.engine.speculator import Speculator
from hybridllm.engine.step_plan import ScheduledRow, StepPlan
from hybridllm.engine.verification import verify_draft
from hybridllm.errors import HybridLLMError
from hybridllm.kvcache.base import MemoryLedger
from hybridllm.timing import synchronize

logger = logging.getLogger(__name__)


class OutputProcessor:
    """The output side of one request loop.

    Args:
        runtime: the built model (tokenizer, weight bytes, placement).
        ledger: the loop's KV ledger (peak device bytes when the CPU plays the device).
        policies: migrate, fork, keep pages.
        release: frees a sequence's KV and takes it out of the running set (the scheduler's).
        add_running: puts a forked sequence into the running set (the scheduler's).
        observer: the metrics hooks.
        speculator: settles verification rows.
    """

    def __init__(self, runtime: Any, ledger: MemoryLedger, policies: LoopPolicies,
                 release: Callable[[SequenceState], None], add_running: Callable[[SequenceState], None],
                 observer: SchedulerObserver, speculator: Speculator) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.device = runtime.engine_config.torch_device
        self.ledger = ledger
        self.policies = policies
        self.release = release
        self.add_running = add_running
        self.observer = observer
        self.speculator = speculator
        self.host_memory = HostPeakMemory()

    def prepare(self, seq: SequenceState) -> None:
        """Give a sequence its sampler and its output (text, stop rules, budget)."""
        seq.sampler = Sampler(seq.params, seq.prompt_ids)
        seq.output = RequestOutput(self.tokenizer, seq.params, seq.max_new_tokens)

    def start(self, seq: SequenceState, alone: bool) -> None:
        """Give an admitted sequence its sampler, stop rules and KV cache on the placed runner
        (``alone``: nothing else runs, so the peak-memory figures restart with it)."""
        seq.scheduled_time = time.perf_counter()
        self.prepare(seq)
        seq.adopt(self.policies.new_cache(seq, on_host=False), self.runtime.runner)
        if alone:
            self.reset_peaks()
        self.observer.on_scheduled(seq)
        seq.start_time = time.perf_counter()
        self.policies.relieve(seq)
        self.report_actions(seq)

    def reset_peaks(self) -> None:
        """Restart the peak-memory figures (process- and ledger-wide: when nothing else runs)."""
        self.host_memory.reset()
        self.ledger.reset_peaks()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def report_actions(self, seq: SequenceState) -> None:
        """Tell the observer about the adaptive actions of ``seq`` it has not heard of."""
        for action in seq.actions[seq.reported_actions:]:
            self.observer.on_adaptive_action(seq, action)
        seq.reported_actions = len(seq.actions)

    # ---- a step's results ----------------------------------------------------------------------
    @torch.inference_mode()
    def process(self, plan: StepPlan, results: Sequence[RowResult]) -> None:
        """Tokens, events and endings of every planned row (``results``: the executor's, in plan order)."""
        to_sample: list[tuple[SequenceState, torch.Tensor]] = []
        prompts_done: list[SequenceState] = []
        for row, result in zip(plan.rows, results):
            seq = row.seq
            self.report_actions(seq)
            if result.error is not None:
                self.fail(seq, result.error, "prefill failed" if row.is_prompt else "decode failed")
            elif row.draft:
                seq.pending = []
                self._verify(row, result.logits[-len(row.draft) - 1:])
            elif not row.is_prompt:
                seq.pending = []
                to_sample.append((seq, result.logits[-1]))
            else:
                siblings = self._prompt_chunk_done(row, result.logits)
                to_sample += [(sibling, result.logits[-1]) for sibling in siblings]
                prompts_done += siblings[:1]
        if to_sample:
            self._sample([seq for seq, _ in to_sample], [logits for _, logits in to_sample])
        for seq in prompts_done:
            self.policies.keep_pages(seq, seq.prompt_ids)  # after the first token: not in its TTFT

    def _prompt_chunk_done(self, row: ScheduledRow, logits: torch.Tensor) -> list[SequenceState]:
        """A prefill chunk ran: its prompt log-probabilities; when it completes the prompt, the
        phase migration and the request's forks. Returns the sequences to sample a first token
        for (the sequence, then its forks; none before the prompt is done or after a failure)."""
        seq = row.seq
        seq.prefilled = row.prompt_end
        if seq.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, row.prompt_start, row.prompt_end, logits)
        if not row.completes_prompt:
            return []
        try:
            if self.runtime.placement.decode_on == "host":
                self.policies.migrate(seq)
            self.observer.on_prompt_done(seq)
            forks = self.policies.fork(seq)
        except Exception as exc:
            self.fail(seq, exc, "prefill failed")
            return []
        for fork in forks:
            self.prepare(fork)
            fork.grammar = None if seq.grammar is None else seq.grammar.copy()
            self.add_running(fork)
        return [seq, *forks]

    def _record_prompt_logprobs(self, seq: SequenceState, start: int, end: int, logits: torch.Tensor) -> None:
        """Log-probabilities of prompt tokens ``start + 1 .. end`` (the first has none) from a
        chunk's logits (T, vocab): row i predicts the token after position ``start + i``."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        targets = seq.prompt_ids[start + 1:end + 1]  # the last chunk's last row predicts a generated token
        seq.prompt_logprobs.extend(sequence_logprobs(logits[:len(targets)], targets, seq.params.prompt_logprobs))

    def _sample(self, seqs: list[SequenceState], rows: list[torch.Tensor]) -> None:
        """The next token of each sequence from its row of logits (vocab,), all rows at once; then
        each sequence's token appended (its pending token when it goes on)."""
        raw = _stack_rows(rows)  # (R, vocab): the model's own logits (log-probabilities read them)
        allowed: dict[int, torch.Tensor] = {}
        for i, seq in enumerate(seqs):
            if seq.grammar is not None:
                try:
                    allowed[i] = seq.grammar.allowed()  # (vocab,) bool
                except HybridLLMError as exc:
                    self.fail(seq, exc, "structured output")
        kept = [i for i, seq in enumerate(seqs) if seq.grammar is None or i in allowed]
        if not kept:
            return
        if len(kept) < len(seqs):
            raw, seqs = raw[kept], [seqs[i] for i in kept]
            allowed = {j: allowed[i] for j, i in enumerate(kept) if i in allowed}
        processed = allowed or any(seq.sampler.processes_logits for seq in seqs)
        wants_logprobs = any(seq.params.logprobs is not None for seq in seqs)
        logits = raw.clone() if processed and wants_logprobs else raw
        for i, mask in allowed.items():
            logits[i].masked_fill_(~mask, float("-inf"))
        tokens = sample_rows(logits, [seq.sampler for seq in seqs])
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            self.append_tokens(seq, [token], raw[i:i + 1])
            if seq.finish_reason is None:
                seq.pending = [token]

    def _verify(self, row: ScheduledRow, logits: torch.Tensor) -> None:
        """A verification row's verdict from its logits (k + 1, vocab): the rejected part rolled
        back, then the accepted tokens and the model's own appended; the last is its pending token."""
        seq = row.seq
        try:
            verdict = verify_draft(logits, row.draft, seq.sampler, seq.grammar)
            self.speculator.settle(seq, row, verdict)
        except Exception as exc:
            self.fail(seq, exc, "structured output" if isinstance(exc, HybridLLMError) else "speculative decoding")
            return
        self.observer.on_draft_verified(seq, len(row.draft), verdict.accepted)
        self.append_tokens(seq, verdict.tokens, logits)
        if seq.finish_reason is not None:
            return
        if not verdict.has_own_token:  # an accepted token completed the grammar: the append ends the sequence
            self.fail(seq, RuntimeError("a completed grammar did not end the sequence"), "speculative decoding")
            return
        seq.pending = [verdict.tokens[-1]]

    # ---- appending tokens ------------------------------------------------------------------------
    def append_tokens(self, seq: SequenceState, tokens: Sequence[int], logits: torch.Tensor) -> int:
        """Append ``tokens`` to ``seq`` in order, each with its log-probability from its row of
        ``logits`` (len(tokens), vocab), its timing, its stop rules and its event; stops at the
        first token that ends the sequence (then finished, or failed on a grammar dead end).
        Returns how many tokens were taken. Tokens of one step share its interval evenly (those
        arriving with a sequence's first token have none: their time is its TTFT)."""
        now = time.perf_counter()
        share = None if seq.last_token_time is None else (now - seq.last_token_time) / len(tokens)
        params = seq.params
        for taken, token in enumerate(tokens, start=1):
            if params.logprobs is not None:
                entry = token_logprob(logits[taken - 1], token, params.logprobs)
                seq.logprobs.append(entry)
                seq.unsent_logprobs.append(entry)
            interval = share if seq.first_token_time is not None else None
            if interval is not None:
                seq.token_intervals.append(interval)
            if seq.first_token_time is None:
                seq.first_token_time, share = now, 0.0
            seq.last_token_time = now
            self.host_memory.sample()
            piece = seq.output.push(token)
            seq.sampler.record([token])
            self.observer.on_token(seq, interval)
            reason = seq.output.finish_reason
            if seq.grammar is not None:
                try:
                    if seq.grammar.advance(token):
                        reason = "stop"  # the grammar is complete: nothing but the end of the sequence may follow
                except HybridLLMError as exc:
                    self.fail(seq, exc, "structured output")
                    return taken
            finishing = reason is not None
            # with logprobs every token gets its event (the last one rides on the finishing event)
            if piece or (seq.unsent_logprobs and not finishing):
                first = len(seq.generated) == 1
                self.emit(seq, SeqEvent(seq.request_id, piece, token_id=token, index=seq.index,
                                         logprobs=_take_unsent_logprobs(seq),
                                         prompt_logprobs=seq.prompt_logprobs if first else None))
            if finishing:
                self._finish(seq, reason)
                return taken
        return len(tokens)

    # ---- endings ---------------------------------------------------------------------------------
    def _finish(self, seq: SequenceState, reason: str) -> None:
        tail = seq.output.tail()
        seq.finish_reason = reason
        metrics = self._metrics(seq)
        self.policies.keep_pages(seq, seq.prompt_ids + seq.generated)  # a next turn resends these tokens
        self.release(seq)  # the KV is free before the client hears the end
        self.emit(seq, SeqEvent(
            seq.request_id, tail, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.generated), token_ids=list(seq.generated), full_text=seq.output.text,
            metrics=metrics, index=seq.index, logprobs=_take_unsent_logprobs(seq),
            prompt_logprobs=seq.prompt_logprobs,
            all_logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        ))
        self.observer.on_finished(seq)

    def fail(self, seq: SequenceState, exc: Exception, context: str) -> None:
        """End ``seq`` with an error: the user's (a budget, the prompt) in one line, anything else
        logged with its traceback as an internal error."""
        if isinstance(exc, HybridLLMError):
            logger.info("%s: %s: %s", seq.request_id, context, exc)
            self.finish_error(seq, exc, str(exc))
        else:
            logger.exception("%s: %s", seq.request_id, context, exc_info=exc)
            self.finish_error(seq, exc, f"internal error: {context}: {exc}")

    def fail_all(self, seqs: Sequence[SequenceState], exc: Exception, context: str) -> None:
        """End every sequence of ``seqs`` with ``exc`` (a step that failed as a whole)."""
        for seq in seqs:
            self.fail(seq, exc, context)

    def finish_error(self, seq: SequenceState, exc: BaseException | None, message: str) -> None:
        """End ``seq`` (running or still queued) with ``message``: its KV freed, its error event sent."""
        seq.finish_reason = "error"
        self.release(seq)
        self.emit(seq, SeqEvent(seq.request_id, error=message, exception=exc, prompt_tokens=len(seq.prompt_ids),
                                 completion_tokens=len(seq.generated), index=seq.index))
        self.observer.on_finished(seq)

    def _metrics(self, seq: SequenceState) -> dict[str, Any]:
        """The request's figures (the keys ``generate --json`` and the bench promise)."""
        synchronize(self.device)
        if self.device.type == "cuda":
            peak_device = torch.cuda.max_memory_allocated(self.device)
        else:  # the CPU stands in for the device: report what the engine placed on the device tier
            peak_device = self.runtime.weight_bytes["device"] + self.ledger.peak("device")
        return sequence_metrics(seq, self.runtime, self.host_memory.peak(), peak_device)

    def emit(self, seq: SequenceState, event: SeqEvent) -> None:
        """Send ``event`` to the sequence's consumer (one that is gone is not an error)."""
        try:
            seq.sink(event)
        except Exception:  # a consumer that is gone (closed event loop) must not stop the scheduler
            logger.debug("dropping an event of %s", seq.request_id, exc_info=True)


def _take_unsent_logprobs(seq: SequenceState) -> list[TokenLogprob]:
    taken, seq.unsent_logprobs = seq.unsent_logprobs, []
    return taken


def _stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of logits (vocab,) as one (R, vocab) tensor: a view when they already lie one after
    another in one buffer (a decode batch's output), else a copy."""
    first = rows[0]
    vocab = first.shape[-1]
    consecutive = first.is_contiguous() and all(
        row.is_contiguous() and row.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and row.data_ptr() == first.data_ptr() + i * vocab * first.element_size() for i, row in enumerate(rows))
    if consecutive:
        return first.as_strided((len(rows), vocab), (vocab, 1))
    return torch.stack(rows)
