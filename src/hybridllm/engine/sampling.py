"""Next-token selection: greedy, or temperature / top-k / top-p / min-p sampling, after
OpenAI's ``logit_bias``, the repetition penalty and OpenAI's presence / frequency penalties.
Filters run in Hugging Face's order (penalty, temperature, top-k, top-p, min-p) so seeded
results are comparable with it.
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
        # the bias as (ids, values), added in one indexed op per token
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None,
                 generated: torch.Tensor | None = None) -> int:
        """Choose the next token from ``logits`` (vocab,).

        Args:
            logits: the model's next-token logits (vocab,).
            history: every id seen so far, prompt included (N,): the repetition penalty's.
            generated: the ids generated so far (M,): the presence / frequency penalties'.
        """
        p = self.params
        logits = logits.float()
        if self.bias_ids.numel():
            logits = logits.index_add(0, self.bias_ids.to(logits.device), self.bias_values.to(logits.device))
        if p.repetition_penalty != 1.0 and history is not None and history.numel():
            logits = apply_repetition_penalty(logits, history.to(logits.device), p.repetition_penalty)
        if p.penalizes_generated and generated is not None and generated.numel():
            logits = apply_presence_frequency_penalty(logits, generated.to(logits.device), p.presence_penalty,
                                                      p.frequency_penalty)
        if p.greedy:
            return greedy_token(logits)
        logits = logits.cpu() / p.temperature
        if p.top_k > 0:
            logits = top_k_filter(logits, p.top_k)
        if p.top_p < 1.0:
            logits = top_p_filter(logits, p.top_p)
        if p.min_p > 0.0:
            logits = min_p_filter(logits, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit (the first one on a tie, as ``torch.argmax``): NumPy's argmax
    on the CPU, ~20x faster there than PyTorch's for a vocabulary-sized row (it is run per
    sequence per step)."""
    if logits.device.type == "cpu":
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' positive logits are divided, negative ones multiplied. A
    penalty so small that float32 rounds it to 0 makes the largest finite logit, not +inf (which
    would turn the probabilities into NaN)."""
    seen = torch.unique(history)
    scores = logits[seen]
    logits = logits.clone()
    penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
    logits[seen] = torch.nan_to_num(penalized, posinf=torch.finfo(logits.dtype).max)
    return logits


def apply_presence_frequency_penalty(logits: torch.Tensor, generated: torch.Tensor, presence: float,
                                     frequency: float) -> torch.Tensor:
    """OpenAI's penalties: ``logit -= frequency * count + presence * (count > 0)`` for every token
    by its count among the generated ids."""
    counts = torch.bincount(generated, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)  # (vocab,)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits."""
    k = min(k, logits.shape[-1])
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p`` (at
    least the most likely one, however small ``top_p``: a float32 comparison rounds a subnormal
    ``top_p`` to 0)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
    remove_sorted[0] = False
    remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` x the top token's probability."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
