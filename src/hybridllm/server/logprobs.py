"""The engine's log-probabilities in OpenAI's two response shapes.

Chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
Legacy completions: ``choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, one entry per position; a position without a log-probability (the first
prompt token under ``echo``) has ``null`` in ``token_logprobs`` and ``top_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridllm.engine.logprobs import TokenLogprob


class TokenText:
    """Each token id's text as the logprob entries spell it (special tokens included), cached.

    Args:
        tokenizer: the model's tokenizer (its ``decode`` spells a token).
        raw_bytes: a token id's exact bytes; used where the token alone is not whole UTF-8 (its
            text then holds U+FFFD, and OpenAI's ``bytes`` field must carry the real bytes).
    """

    def __init__(self, tokenizer: Any, raw_bytes: Callable[[int], bytes] | None = None) -> None:
        self.tokenizer = tokenizer
        self.raw_bytes = raw_bytes
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's bytes as OpenAI's ``bytes`` field lists them."""
        text = self(token_id)
        if "\ufffd" in text and self.raw_bytes is not None:
            return list(self.raw_bytes(token_id))
        return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """``{"content": [...]}`` of the generated tokens ``entries``."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": token_text.bytes(token_id)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], token_text: TokenText,
                        text_offset: int = 0) -> dict[str, Any]:
    """The legacy shape of the positions ``token_ids``, whose entries are ``entries`` (None: no
    log-probability there); offsets count characters from ``text_offset``."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        top_logprobs.append(None if entry is None else {token_text(t): lp for t, lp in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def join_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The positions of ``first`` then ``second`` (an echoed prompt, then the completion)."""
    return {key: first[key] + second[key] for key in first}
