"""Next-token selection over rows: logits processors, probabilities, then a draw.

    tokens = sample_rows(logits, samplers)   # logits (R, vocab) float32 on the CPU, one Sampler per row

1. Logits processors change the rows that need them, in place (rows with the same parameter
   values together): OpenAI's ``logit_bias``, the repetition penalty (CTRL, over the prompt and
   the generated tokens) and OpenAI's presence / frequency penalties (over the generated tokens).
   A grammar's mask (structured output) is the caller's processor
   (:meth:`~hybridllm.engine.structured.GrammarMatcher.allowed`), applied before these.
2. Greedy rows take the argmax of their processed logits.
3. Sampled rows become probabilities (:func:`probabilities`: temperature, top-k, top-p, min-p in
   Hugging Face's order, so seeded results are comparable with it, then softmax), rows with the
   same parameters in one tensor op each, then each row draws from its own generator
   (:func:`draw`). A verifier (speculative decoding) reads the same probabilities.

A row's result never depends on the other rows: every op works row by row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch

from hybridllm.config import SamplingParams


class Sampler:
    """One sequence's sampling state: its parameters, its own random generator (no global RNG
    state), its logit bias, and the token counts its penalties read.

    Args:
        params: the request's sampling parameters.
        prompt_ids: the prompt (the repetition penalty counts it).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        # the bias as (ids, values), added in one indexed op per step
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self._prompt_ids = prompt_ids if params.repetition_penalty != 1.0 else ()
        self._generated: list[int] = []  # tokens recorded before the counts exist
        self._seen: torch.Tensor | None = None  # (vocab,) prompt + generated counts (repetition penalty)
        self._generated_counts: torch.Tensor | None = None  # (vocab,) generated counts (presence, frequency)

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty reads the tokens seen so far."""
        return self.params.repetition_penalty != 1.0 or self.params.penalizes_generated

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor changes this row."""
        return bool(self.params.logit_bias) or self.counts_tokens

    def record(self, tokens: Sequence[int]) -> None:
        """Generated tokens the penalties count from now on."""
        if not self.counts_tokens:
            return
        if self._seen is None:
            self._generated.extend(tokens)
            return
        ids = torch.tensor(list(tokens), dtype=torch.long)
        self._seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._generated_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def forget(self, tokens: Sequence[int]) -> None:
        """Take back recorded tokens (the rejected part of a draft)."""
        if not self.counts_tokens:
            return
        if self._seen is None:
            for token in tokens:
                self._generated.remove(token)
            return
        ids = torch.tensor(list(tokens), dtype=torch.long)
        self._seen.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        self._generated_counts.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))

    def token_counts(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt + generated, generated) counts of every token id, each (vocab,) int32."""
        if self._seen is None:
            generated = torch.tensor(self._generated, dtype=torch.long)
            self._generated_counts = torch.bincount(generated, minlength=vocab_size)[:vocab_size].to(torch.int32)
            prompt = torch.tensor(list(self._prompt_ids), dtype=torch.long)
            self._seen = self._generated_counts + torch.bincount(prompt, minlength=vocab_size)[:vocab_size].to(torch.int32)
            self._generated, self._prompt_ids = [], ()
        return self._seen, self._generated_counts

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token of one row, ``logits`` (vocab,) (the loop samples many rows at once with
        :func:`sample_rows`)."""
        return sample_rows(logits.float()[None].clone(), [self])[0]


# ---- the whole pipeline ----------------------------------------------------------------------
def sample_rows(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """The next token of every row of ``logits`` (R, vocab) float32 on the CPU, row i by
    ``samplers[i]``; the rows are processed in place."""
    process_logits(logits, samplers)
    tokens = [0] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    if greedy:
        for i, token in zip(greedy, greedy_tokens(logits if len(greedy) == len(samplers) else logits[greedy])):
            tokens[i] = token
    for key, rows in _groups(samplers, lambda s: None if s.params.greedy else _filters(s.params)).items():
        if key is None:
            continue
        probs = probabilities(logits[rows], samplers[rows[0]].params)  # (rows, vocab)
        for i, token in zip(rows, draw(probs, [samplers[i].generator for i in rows])):
            tokens[i] = token
    return tokens


def process_logits(logits: torch.Tensor, samplers: Sequence[Sampler]) -> None:
    """The logits processors, in place on ``logits`` (R, vocab): each row's logit bias, then its
    repetition penalty, then its presence / frequency penalties (rows sharing values at once)."""
    biased = [i for i, s in enumerate(samplers) if s.bias_ids.numel()]
    if biased:
        vocab = logits.shape[-1]
        flat_ids = torch.cat([samplers[i].bias_ids + i * vocab for i in biased])  # rows' ids in the flat view
        logits.view(-1).index_add_(0, flat_ids, torch.cat([samplers[i].bias_values for i in biased]))
    counting = [i for i, s in enumerate(samplers) if s.counts_tokens]
    if not counting:
        return
    vocab = logits.shape[-1]
    counts = {i: samplers[i].token_counts(vocab) for i in counting}
    for penalty, rows in _groups(samplers, lambda s: s.params.repetition_penalty, counting).items():
        if penalty != 1.0:
            seen = torch.stack([counts[i][0] for i in rows])  # (rows, vocab)
            logits[rows] = apply_repetition_penalty(logits[rows], seen, penalty)
    for (presence, frequency), rows in _groups(samplers, lambda s: (s.params.presence_penalty,
                                                                    s.params.frequency_penalty), counting).items():
        if presence or frequency:
            generated = torch.stack([counts[i][1] for i in rows])  # (rows, vocab)
            logits[rows] = apply_presence_frequency_penalty(logits[rows], generated, presence, frequency)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: ``logits`` (..., vocab) over the temperature,
    then top-k, top-p and min-p (Hugging Face's order), then softmax.

    At float32's edges the division can leave the finite range: a small temperature overflows a
    logit to +-inf (one the repetition penalty already pushed to the largest float, say), and a
    huge one (cast to float32: inf) turns a masked -inf into NaN; any of them would make the
    softmax NaN. So a finite logit stays finite (at the nearest finite value, the order kept) and
    a masked one stays masked."""
    finfo = torch.finfo(logits.dtype)
    masked = torch.isneginf(logits)  # a grammar's mask: stays masked
    logits = torch.nan_to_num(logits / params.temperature, posinf=finfo.max, neginf=finfo.min)
    logits = logits.masked_fill(masked, float("-inf"))
    if params.top_k > 0:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0.0:
        logits = min_p_filter(logits, params.min_p)
    return torch.softmax(logits, dim=-1)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token of each row of ``probs`` (R, vocab), row i from ``generators[i]``."""
    return [int(torch.multinomial(row, 1, generator=generator)) for row, generator in zip(probs, generators)]


# ---- the pieces ------------------------------------------------------------------------------
def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit of a row (vocab,) (the first one on a tie, NaN the largest,
    as ``torch.argmax``)."""
    return greedy_tokens(logits[None])[0]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` (R, vocab): NumPy's on the CPU, many times faster there
    than PyTorch's for vocabulary-sized rows (first index on a tie, NaN counts as the largest, as
    ``torch.argmax``)."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: the positive logits of tokens seen (``seen`` > 0, counts of the same
    shape) are divided by ``penalty``, the negative ones multiplied.

    At float32's edges (a penalty that rounds to 0 or overflows to inf) a finite logit stays
    finite, at the nearest finite value, and 0 stays 0 (0 x inf would be NaN): a seen token is
    pushed as far as floats go but never masked, so a grammar whose allowed tokens were all seen
    still has one to pick. A masked token (-inf) stays masked."""
    finfo = torch.finfo(logits.dtype)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    penalized = torch.nan_to_num(penalized, nan=0.0, posinf=finfo.max, neginf=finfo.min)
    return torch.where((seen > 0) & torch.isfinite(logits), penalized, logits)


def apply_presence_frequency_penalty(logits: torch.Tensor, generated: torch.Tensor, presence: float,
                                     frequency: float) -> torch.Tensor:
    """OpenAI's penalties: ``logit -= frequency * count + presence * (count > 0)`` for every token,
    ``generated`` its count among the generated ids (the shape of ``logits``)."""
    counts = generated.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row."""
    k = min(k, logits.shape[-1])
    threshold = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens of each row whose probability mass reaches
    ``top_p`` (at least the most likely one, however small ``top_p``: a float32 comparison rounds
    a subnormal ``top_p`` to 0)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` x the row's top token's probability."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _filters(params: SamplingParams) -> tuple[float, int, float, float]:
    return params.temperature, params.top_k, params.top_p, params.min_p


def _groups(samplers: Sequence[Sampler], key, rows: Sequence[int] | None = None) -> dict[Hashable, list[int]]:
    """Row indices (among ``rows``, else all) by ``key(sampler)``, in order."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i in range(len(samplers)) if rows is None else rows:
        groups[key(samplers[i])].append(i)
    return groups
