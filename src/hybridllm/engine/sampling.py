"""Next-token selection: greedy, or temperature / top-k / top-p / min-p sampling, with an
optional repetition penalty. Filters run in Hugging Face's order (penalty, temperature,
top-k, top-p, min-p) so seeded results are comparable with it.
"""

from __future__ import annotations

import torch

from hybridllm.config import SamplingParams


class Sampler:
    """Picks token ids from logits. Holds its own random generator (no global RNG state)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """Choose the next token from ``logits`` (vocab,) given the ids seen so far ``history`` (N,)."""
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and history is not None and history.numel():
            logits = apply_repetition_penalty(logits, history.to(logits.device), p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.cpu() / p.temperature
        if p.top_k > 0:
            logits = top_k_filter(logits, p.top_k)
        if p.top_p < 1.0:
            logits = top_p_filter(logits, p.top_p)
        if p.min_p > 0.0:
            logits = min_p_filter(logits, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' positive logits are divided, negative ones multiplied."""
    seen = torch.unique(history)
    scores = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits."""
    k = min(k, logits.shape[-1])
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
    remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` x the top token's probability."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
