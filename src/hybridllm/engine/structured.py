"""Structured output: a grammar that masks the logits of one sequence, token by token.

A :class:`~hybridllm.config.StructuredOutput` (a JSON schema) is compiled by llguidance into a
matcher that follows what the sequence has generated so far and knows which tokens may come
next. Before each sampling step the request loop sets every other token's logit to -inf, so
greedy and sampled decoding alike can only produce text the grammar accepts; when the grammar
is complete, the sequence stops. Each sequence has its own matcher (the ``n`` sequences of a
request each a copy), so the rows of a decode batch follow their own grammars; a matcher rolls
back tokens it was fed (:meth:`GrammarMatcher.rollback`: a rejected draft).

The llguidance tokenizer is built once per model from our own tokenizer's ``tokenizer.json``
description (GGUF vocabularies included), on the first constrained request. JSON is generated
in ``json.dumps``'s default layout (``", "`` and ``": "``, no other whitespace): a model cannot
wander into endless blank lines, and the layout is the one models have seen most.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import llguidance
import torch

from hybridllm.config import StructuredOutput
from hybridllm.errors import HybridLLMError

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher"]

logger = logging.getLogger(__name__)

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32*word + i


class GrammarError(HybridLLMError):
    """A constraint that cannot be compiled (an invalid or unsupported JSON schema), or a grammar
    that reached a dead end while generating. Its message is one short line: the grammar
    engine's own report (its parser state, the grammar) goes to the debug log only."""


MAX_REASON_CHARS = 160
DEAD_END = ("the output cannot follow the JSON schema: no token can continue it (is the schema satisfiable? "
            "a required property that refers to its own object never ends)")


def short_reason(report: str | None) -> str:
    """The first line of the grammar engine's report, cut to :data:`MAX_REASON_CHARS` characters."""
    line = next((line.strip() for line in (report or "").splitlines() if line.strip()), "unknown reason")
    return line if len(line) <= MAX_REASON_CHARS else line[:MAX_REASON_CHARS - 3] + "..."


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next, and whether it is complete.

    Args:
        matcher: the compiled llguidance matcher, at the start of the output.
        vocab_size: the length of the logits it masks.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar accepts next: a (vocab,) bool tensor on the CPU.

        Raises:
            GrammarError: If the grammar is in an error state (no token can continue it).
        """
        if self._matcher.is_error():
            logger.debug("structured output: %s", self._matcher.get_error())
            raise GrammarError(DEAD_END)
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)  # (ceil(V/32),)
        bits = (words.unsqueeze(1) >> _BIT_SHIFTS) & 1  # (ceil(V/32), 32)
        return bits.reshape(-1)[: self.vocab_size].bool()  # (vocab,)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with every token the grammar forbids set to -inf (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> bool:
        """Feed the sampled token; returns True when the grammar is complete (nothing may follow
        but the end of the sequence), so the sequence stops.

        Raises:
            GrammarError: If the grammar does not accept ``token``.
        """
        if not self._matcher.consume_token(token):
            logger.debug("structured output at token %d: %s", token, self._matcher.get_error())
            raise GrammarError(DEAD_END)
        return self._matcher.is_stopped()

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` tokens fed with :meth:`advance` (the rejected part of a draft).

        Raises:
            GrammarError: If the matcher cannot go back that far.
        """
        if n and not self._matcher.rollback(n):
            raise GrammarError(f"structured output cannot roll back {n} tokens: {self._matcher.get_error()}")

    def copy(self) -> GrammarMatcher:
        """An independent matcher in this one's state (each of a request's ``n`` sequences gets one)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)

    @property
    def is_complete(self) -> bool:
        """Whether the text so far is a whole match (the sequence may end here)."""
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Compiles :class:`~hybridllm.config.StructuredOutput` constraints for one model.

    Args:
        tokenizer: the model's :class:`~hybridllm.loading.tokenizer.Tokenizer`.
        vocab_size: the length of the model's logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # requests are submitted from several threads

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the tokenizer, built on first use (about 0.2 s for 50k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                n_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
                eos = sorted(self.tokenizer.eos_token_ids)
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self.tokenizer.to_json(), n_vocab=n_vocab, eos_token=eos or None
                    )
                except ValueError as exc:
                    raise GrammarError(f"structured output is not available for this tokenizer: {exc}") from exc
            return self._ll_tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The llguidance grammar of ``spec``.

        Raises:
            GrammarError: If the schema is not valid JSON.
        """
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.json_schema), defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {short_reason(str(exc))}") from None

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher of ``spec`` for one sequence.

        Raises:
            GrammarError: If the schema is invalid, uses what the grammar engine does not support,
                or forces an output that never ends (the tokens it forces from the start are
                followed on a copy of the matcher).
        """
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid JSON schema: {short_reason(matcher.get_error())}")
        probe = matcher.deep_copy()
        forced = probe.compute_ff_tokens()
        if probe.is_error() or (forced and not probe.consume_tokens(forced)) or probe.is_error():
            logger.debug("structured output: the schema's forced start fails: %s", probe.get_error())
            raise GrammarError(DEAD_END)
        return GrammarMatcher(matcher, self.vocab_size)
