"""Hooks the request loop calls on its thread (the server's metrics implement them)."""

from __future__ import annotations

from hybridllm.engine.adaptive import AdaptiveAction
from hybridllm.engine.sequence import SequenceState


class SchedulerObserver:
    """Hooks the scheduler calls on its loop thread (the server's metrics implement them)."""

    def on_scheduled(self, seq: SequenceState) -> None:
        """The sequence left the queue and got its KV cache."""

    def on_prompt_done(self, seq: SequenceState) -> None:
        """The whole prompt is in the cache."""

    def on_token(self, seq: SequenceState, interval_s: float | None) -> None:
        """A token was sampled; ``interval_s`` since the previous one (None for the first)."""

    def on_adaptive_action(self, seq: SequenceState, action: AdaptiveAction) -> None:
        """The adaptive policy re-planned the sequence (``action``: its line, and ``action.kind``)."""

    def on_finished(self, seq: SequenceState) -> None:
        """The sequence left (``seq.finish_reason``: stop, length, abort or error); its KV is freed."""

    def on_draft_verified(self, seq: SequenceState, draft_tokens: int, accepted: int) -> None:
        """A proposal of ``draft_tokens`` tokens was verified; ``accepted`` of them (its first ones) were kept."""

    def on_step(self, decode_rows: int, prefill_tokens: int) -> None:
        """A scheduler step ran: ``decode_rows`` sequences decoded, plus prefill tokens."""
