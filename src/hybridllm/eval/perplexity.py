"""Perplexity of a configuration (weights, KV cache) against the float model of the same file.

The text is tokenized once and cut into non-overlapping windows of ``context`` tokens; each
window starts with an empty KV cache and is fed in chunks of ``chunk`` tokens (so a quantized or
tiered cache holds the older tokens of the window the way it would in a conversation). Every
token after the first of a window is scored. Both configurations see the same chunks, and for
each scored token we add the negative log-likelihood of the true next token and the KL
divergence ``KL(p_ref || p_test)`` of the next-token distributions.

    perplexity = exp(mean NLL)        delta_percent = 100 * (ppl / ppl_ref - 1)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridllm.errors import ConfigError

DEFAULT_TEXT_NAME = "varied_prose.txt"


def default_text_path() -> Path:
    """The evaluation text shipped in the repository (``data/eval/``)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "data" / "eval" / DEFAULT_TEXT_NAME
        if candidate.is_file():
            return candidate
    raise ConfigError(f"the default evaluation text data/eval/{DEFAULT_TEXT_NAME} is not found next to this "
                      f"installation; give a text file with --text")


def load_text(path: str | os.PathLike | None = None) -> str:
    """The text at ``path`` (None: the default evaluation text)."""
    target = default_text_path() if path is None else Path(path).expanduser()
    if not target.is_file():
        raise ConfigError(f"text file not found: {target}")
    text = target.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"{target} is empty")
    return text


@dataclass
class PerplexityResult:
    """Perplexity of the tested configuration, of the reference, and their divergence."""

    perplexity: float
    reference_perplexity: float
    delta_percent: float
    kl_divergence: float  # mean over scored tokens of KL(p_ref || p_test), in nats
    tokens: int  # scored tokens

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def windows(token_ids: Sequence[int], context: int) -> list[list[int]]:
    """Non-overlapping windows of ``context`` tokens (a last, shorter one if it has >= 2 tokens)."""
    if context < 2:
        raise ConfigError(f"context must be >= 2 tokens, got {context}")
    ids = list(token_ids)
    out = [ids[i:i + context] for i in range(0, len(ids), context)]
    return [w for w in out if len(w) >= 2]


class _Runner:
    """Feeds one window, chunk by chunk, through an engine; yields the chunks' logits."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.device = llm.engine_config.torch_device

    def logits(self, window: list[int], chunk: int):
        cache = self.llm.new_cache()
        cache.reserve(len(window))
        try:
            for start in range(0, len(window), chunk):
                ids = torch.tensor([window[start:start + chunk]], dtype=torch.long, device=self.device)  # (1, T)
                out = self.llm.runner(ids, cache, start_pos=cache.seq_length, all_logits=True)  # (1, T, V)
                yield out[0].float().cpu()  # (T, V)
        finally:
            cache.reset()


def evaluate_perplexity(
    test,
    reference,
    token_ids: Sequence[int],
    context: int = 512,
    chunk: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity and KL of ``test`` vs ``reference`` (two ``LLM`` objects) over ``token_ids``.

    ``reference`` may be ``test`` itself (then its figures are reported twice and KL is 0).
    ``progress(done_windows, total_windows)`` is called after each window.
    """
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    parts = windows(token_ids, context)
    if not parts:
        raise ConfigError("the text has fewer than 2 tokens")
    vocab = test.config.vocab_size
    if reference.config.vocab_size != vocab:
        raise ConfigError("the reference model has another vocabulary")
    same = reference is test
    nll = nll_ref = kl = 0.0
    scored = 0
    with torch.inference_mode():
        for index, window in enumerate(parts):
            targets = torch.tensor(window[1:], dtype=torch.long)  # next token of each position
            runs = [_Runner(test).logits(window, chunk)]
            if not same:
                runs.append(_Runner(reference).logits(window, chunk))
            pos = 0
            for chunk_logits in zip(*runs):
                n = min(chunk_logits[0].shape[0], len(targets) - pos)  # the window's last token has no target
                tgt = targets[pos:pos + n, None]  # (n, 1)
                logp = F.log_softmax(chunk_logits[0][:n], dim=-1)  # (n, V)
                nll -= logp.gather(-1, tgt).sum().item()
                if same:
                    nll_ref = nll
                else:
                    logp_ref = F.log_softmax(chunk_logits[1][:n], dim=-1)  # (n, V)
                    nll_ref -= logp_ref.gather(-1, tgt).sum().item()
                    kl += F.kl_div(logp, logp_ref, log_target=True, reduction="sum").item()
                pos += n
                scored += n
            if progress is not None:
                progress(index + 1, len(parts))
    ppl, ppl_ref = math.exp(nll / scored), math.exp(nll_ref / scored)
    return PerplexityResult(
        perplexity=ppl,
        reference_perplexity=ppl_ref,
        delta_percent=100.0 * (ppl / ppl_ref - 1.0),
        kl_divergence=max(0.0, kl / scored),
        tokens=scored,
    )


def encode_text(llm, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of ``text`` (with BOS when the tokenizer adds one), cut to ``max_tokens``."""
    ids = llm.tokenizer.encode(text, add_special_tokens=True)
    return ids[:max_tokens] if max_tokens else ids


def is_reference_config(weights: str, dtype: str, kv_options: dict) -> bool:
    """Whether a configuration is the reference itself (float32 weights, dynamic KV cache)."""
    return weights == "float" and dtype == "float32" and kv_options.get("kv_cache", "dynamic") == "dynamic"
