"""A request inside the request loop, and the events it sends to its consumer."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import SamplingParams
from hybridllm.engine.drafting import SequenceSpeculation
from hybridllm.engine.logprobs import TokenLogprob
from hybridllm.engine.output import RequestOutput
from hybridllm.engine.sampling import Sampler
from hybridllm.engine.structured import GrammarMatcher
from hybridllm.kvcache.base import KVCache


@dataclass
class SeqEvent:
    """What a sequence produced since its last event. The last one has ``finish_reason`` (or ``error``).

    A request with ``n > 1`` sends the events of its n sequences, each with its ``index``; it
    ends when all n have sent their last event.
    """

    request_id: str
    text: str = ""
    token_id: int | None = None  # the token that completed ``text`` (None for the held-back tail)
    index: int = 0  # which of the request's n sequences
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens this event completes (when asked)
    # every prompt position (None first), on the sequence's first and last events (when asked)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    all_logprobs: list[TokenLogprob] | None = None  # every generated token's, on the last event (when asked)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    error: str | None = None
    exception: BaseException | None = None  # what failed, for in-process callers to re-raise
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # every generated id, on the last event
    full_text: str = ""  # the whole completion, on the last event
    metrics: dict[str, Any] | None = None  # the request's figures, on the last event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class SequenceKV:
    """Where one running sequence's KV is: per layer, its tokens and how many of them the host
    tier holds (the rest are on the device). A read-only snapshot for the server's live view."""

    request_id: str
    index: int  # which of the request's n sequences
    tokens: tuple[int, ...]  # per layer
    host_tokens: tuple[int, ...]  # per layer

    @classmethod
    def of(cls, request_id: str, index: int, cache: KVCache) -> SequenceKV:
        layers = range(cache.spec.n_layers)
        return cls(request_id, index, tuple(cache.length(i) for i in layers),
                   tuple(cache.host_tokens(i) for i in layers))


@dataclass(eq=False)
class SequenceState:
    """A request in the loop: its prompt, where it runs (cache + runner), sampler, stop rules, times.

    A sequence starts on the runtime's placed runner with a cache of the KV policy; phase
    migration or the adaptive policy may move it to the host runner with a host cache
    (:meth:`adopt`), so ``caches`` lists every cache it used, the first one first. Its phase is
    data: ``prefilled`` prompt tokens are in the cache, and ``pending`` holds the generated tokens
    the model has not seen yet (what its next step feeds; one token for plain decoding).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    kv_bytes: int  # reserved for admission: (prompt + max_new_tokens) in whole pages, x n before the fork
    sink: Callable[[SeqEvent], None]
    index: int = 0  # which of the request's n sequences (forks get 1 .. n-1)
    arrival_time: float = field(default_factory=time.perf_counter)
    cache: KVCache | None = None
    runner: Any = None  # hybridllm.runtime.runner.ModelRunner the sequence steps on now
    caches: list[KVCache] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # what the adaptive policy did
    reported_actions: int = 0  # how many of ``actions`` the observer has heard of
    hop_bytes: int = 0  # hidden-state bytes that crossed tiers for this sequence
    sampler: Sampler | None = None  # parameters, generator, penalty counts
    grammar: GrammarMatcher | None = None  # masks the logits when the output is structured
    output: RequestOutput | None = None  # text, stop rules, token budget
    speculation: SequenceSpeculation | None = None  # draft length, figures, the drafter's state (--spec)
    prefilled: int = 0  # prompt tokens already in the cache
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    prefix_looked_up: bool = False  # the prefix cache was asked (right before the first prefill chunk)
    pending: list[int] = field(default_factory=list)  # generated tokens not yet fed to the model
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs is set
    logprobs: list[TokenLogprob] = field(default_factory=list)  # generated tokens' (when params.logprobs is set)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # not carried by an event yet
    scheduled_time: float | None = None
    start_time: float | None = None  # when its first forward could start (TTFT counts from here)
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_intervals: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def reserve_tokens(self) -> int:
        """Prompt plus token budget: the most tokens its KV will hold."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def generated(self) -> list[int]:
        return [] if self.output is None else self.output.generated

    @property
    def in_prefill(self) -> bool:
        return not self.pending and self.prefilled < len(self.prompt_ids)

    @property
    def cached_ids(self) -> list[int]:
        """The tokens its cache holds (prompt, then generated), in order."""
        return (self.prompt_ids + self.generated)[:self.cache.seq_length]

    def adopt(self, cache: KVCache, runner: Any) -> None:
        """Continue on ``cache`` and ``runner`` (after a migration)."""
        self.cache, self.runner = cache, runner
        if not self.caches or self.caches[-1] is not cache:
            self.caches.append(cache)

    def fork(self, index: int) -> SequenceState:
        """Sequence ``index`` of the same request, at this one's point (a prefilled prompt): same
        prompt, budget, reservation, times and prompt log-probabilities; seed + index when a seed
        is given. Its cache, sampler, output and grammar are the caller's to give."""
        params = self.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        fork = SequenceState(self.request_id, self.prompt_ids, params, self.max_new_tokens, self.kv_bytes, self.sink,
                             index=index, arrival_time=self.arrival_time)
        fork.prompt_logprobs = self.prompt_logprobs
        fork.prefilled = self.prefilled
        fork.scheduled_time, fork.start_time = self.scheduled_time, self.start_time
        return fork
