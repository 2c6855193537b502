"""From sampled tokens to text: detokenization, stop ids, stop strings, the token budget.

One set of rules for the single-request generator and the batching scheduler, so both stop at
the same token and emit the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.config import SamplingParams
from hybridllm.errors import ContextOverflowError


def check_prompt(prompt: Sequence[int], context_length: int, vocab_size: int,
                 context_description: str | None = None) -> None:
    """A prompt must be non-empty, shorter than the context window, and use known token ids.

    ``context_description``: the limit in words (``Runtime.context_description``: the user's
    ``--ctx-size`` cap or the model's window); None: the model's window of ``context_length``.
    """
    if not prompt:
        raise ContextOverflowError("the prompt is empty: give at least one token")
    if len(prompt) >= context_length:
        limit = context_description or f"the model's context window is {context_length} tokens"
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens but {limit}; shorten it to at most {context_length - 1} tokens"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ContextOverflowError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.text = ""  # all text released or held so far
        self.released = 0  # characters of ``text`` already emitted

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return (text safe to emit now, whether a stop string was hit)."""
        search_from = max(0, self.released - max((len(s) for s in self.stops), default=0))
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.released:end]
            self.text = self.text[:end]
            self.released = end
            return out, True
        hold = self._partial_stop_suffix()
        end = len(self.text) - hold
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out, False

    def flush(self) -> str:
        out = self.text[self.released:]
        self.released = len(self.text)
        return out

    def _partial_stop_suffix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best


class RequestOutput:
    """The text of one request as its tokens arrive, and why it finished.

    Args:
        tokenizer: gives the incremental decoder and the end-of-sequence ids.
        params: stop strings, ``ignore_eos``.
        max_tokens: the request's token budget (already capped by the context window).
    """

    def __init__(self, tokenizer, params: SamplingParams, max_tokens: int) -> None:
        self.stop_ids = frozenset() if params.ignore_eos else frozenset(tokenizer.eos_token_ids)
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.matcher = StopStringMatcher(params.stop)
        self.max_tokens = max_tokens
        self.generated: list[int] = []
        self.finish_reason: str | None = None  # "stop" or "length" once finished
        self._hit_stop_string = False

    @property
    def text(self) -> str:
        return self.matcher.text

    def push(self, token: int) -> str:
        """Record a sampled token; returns the text it releases (possibly ""). Afterwards
        ``finish_reason`` says whether the request is done: an end-of-sequence id, a stop string
        (cut from the text), or the budget."""
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return ""
        piece, hit = self.matcher.feed(self.decoder.push(token))
        if hit:
            self.finish_reason, self._hit_stop_string = "stop", True
        elif len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"
        return piece

    def tail(self) -> str:
        """Text held back until the end (an unfinished character or a possible stop-string start)."""
        if self._hit_stop_string:
            return ""
        tail, _ = self.matcher.feed(self.decoder.flush())
        return tail + self.matcher.flush()
