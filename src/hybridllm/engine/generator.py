"""One request end to end: chunked prefill, the decode loop, stop rules, streaming, metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridllm.config import SamplingParams
from hybridllm.engine.metrics import HostPeakMemory, RequestMetrics, RequestTimer, synchronize
from hybridllm.engine.migration import PhaseMigration
from hybridllm.engine.output import RequestOutput, StopStringMatcher, check_prompt  # noqa: F401 (re-exported)
from hybridllm.engine.sampling import Sampler
from hybridllm.kvcache.base import KVBudgetError, KVCache
from hybridllm.runtime.runner import ModelRunner
from hybridllm.placement.adaptive import AdaptivePolicy


@dataclass
class GenerationResult:
    """What a request produced. ``finish_reason`` is "stop" (EOS or a stop string) or "length"."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamEvent:
    """A piece of streamed output. The last event of a request carries the ``result``."""

    text: str
    token_id: int | None = None
    result: GenerationResult | None = None


@dataclass
class _Run:
    """Where a request runs now: its cache and runner change when it migrates to the host."""

    cache: KVCache
    model: ModelRunner
    caches: list[KVCache]  # every cache the request used, the first one first
    actions: list[str]  # what the adaptive policy did
    reserve_tokens: int  # prompt + token budget
    hop_bytes: int = 0  # hidden-state bytes that crossed tiers

    def adopt(self, cache: KVCache, model: ModelRunner) -> None:
        self.cache, self.model = cache, model
        self.caches.append(cache)


class Generator:
    """Runs requests on a loaded model.

    Args:
        model: the model's runner (placement, hops, decode backend).
        tokenizer: its tokenizer (``stream_decoder``, ``eos_token_ids``).
        cache_factory: builds an empty KV cache for a request.
        device: where the model's inputs go (its embedding's device).
        prefill_chunk: prompt tokens per prefill forward.
        weight_bytes: bytes of weights per tier, for the peak-memory figures.
        decode_weight_bytes: weight bytes one decode step reads (reported as is; None: unknown).
        migration: decode on the host after prefill (``--decode-on host``); None decodes where
            the prefill ran.
        adaptive: re-plans when a memory tier fills up during a request (None: never).
    """

    def __init__(
        self,
        model: ModelRunner,
        tokenizer,
        cache_factory: Callable[[], KVCache],
        device: torch.device,
        prefill_chunk: int = 512,
        weight_bytes: dict[str, int] | None = None,
        decode_weight_bytes: int | None = None,
        cold_start_s: float = 0.0,
        weights_format: str | None = None,
        migration: PhaseMigration | None = None,
        adaptive: AdaptivePolicy | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache_factory = cache_factory
        self.device = device
        self.prefill_chunk = prefill_chunk
        self.weight_bytes = weight_bytes or {"device": 0, "host": 0}
        self.decode_weight_bytes = decode_weight_bytes
        self.cold_start_s = cold_start_s
        self.weights_format = weights_format  # "int4", "int8", "float32", ... (None: not reported)
        self.host_memory = HostPeakMemory()
        self.migration = migration
        self.adaptive = adaptive

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Run a request to completion."""
        for event in self.stream(prompt_ids, params):
            if event.result is not None:
                return event.result
        raise RuntimeError("generation ended without a result")  # unreachable: stream always ends with one

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StreamEvent]:
        """Run a request, yielding text pieces as they are decided; the last event has the result."""
        prompt = [int(t) for t in prompt_ids]
        self._check_prompt(prompt)
        budget = min(params.max_tokens, self.context_length - len(prompt))
        sampler = Sampler(params)
        output = RequestOutput(self.tokenizer, params, budget)
        cache = self.cache_factory()
        run = _Run(cache, self.model, [cache], [], len(prompt) + budget)
        cache.reserve(run.reserve_tokens)
        self._reset_peaks(cache)
        timer = RequestTimer(self.device)
        history = torch.tensor(prompt, dtype=torch.long)
        try:
            with torch.inference_mode():
                self._relieve(run)
                logits = self._prefill(prompt, run)
                if self.migration is not None:
                    run.adopt(self.migration.migrate(run.cache, run.reserve_tokens), self.migration.decode_model)
                while True:
                    token = sampler(logits[0, -1], history if params.repetition_penalty != 1.0 else None)
                    timer.token()
                    self.host_memory.sample()
                    piece = output.push(token)
                    if piece:
                        yield StreamEvent(piece, token)
                    if output.finish_reason is not None:
                        break
                    if params.repetition_penalty != 1.0:
                        history = torch.cat([history, torch.tensor([token])])
                    logits = self._forward([token], run)
            tail = output.tail()
            if tail:
                yield StreamEvent(tail, None)
            metrics = self._metrics(prompt, output.generated, timer, run)
            yield StreamEvent("", None, GenerationResult(output.text, output.generated, prompt, output.finish_reason,
                                                         metrics))
        finally:
            for used in run.caches:
                used.reset()

    # ---- internals ----------------------------------------------------------------------
    def _check_prompt(self, prompt: list[int]) -> None:
        check_prompt(prompt, self.context_length, self.model.config.vocab_size)

    def _prefill(self, prompt: list[int], run: _Run) -> torch.Tensor:
        logits = None
        for start in range(0, len(prompt), self.prefill_chunk):
            logits = self._forward(prompt[start:start + self.prefill_chunk], run)
        return logits

    def _forward(self, tokens: list[int], run: _Run) -> torch.Tensor:
        """One forward of ``tokens`` on the request's current model and cache, then re-plan if a
        memory tier filled up."""
        ids = torch.tensor([tokens], dtype=torch.long)  # (1, T); the model moves it to its embedding
        start = run.cache.seq_length
        try:
            logits = self._run_model(ids, run, start)
        except KVBudgetError:
            if self.adaptive is None:
                raise
            run.cache.truncate(start)  # undo the layers that appended before the budget ran out
            run.adopt(*self.adaptive.move_to_host(run.cache, run.reserve_tokens, run.actions,
                                                  "device KV budget exhausted mid-step"))
            logits = self._run_model(ids, run, start)
        self._relieve(run)
        return logits.cpu()

    @staticmethod
    def _run_model(ids: torch.Tensor, run: _Run, start: int) -> torch.Tensor:
        hops_before = run.model.hop_bytes
        logits = run.model(ids, run.cache, start_pos=start)  # (1, 1, vocab)
        run.hop_bytes += run.model.hop_bytes - hops_before
        return logits

    def _relieve(self, run: _Run) -> None:
        if self.adaptive is not None:
            cache, model = self.adaptive.relieve(run.cache, run.model, run.reserve_tokens, run.actions)
            if cache is not run.cache:
                run.adopt(cache, model)

    def _reset_peaks(self, cache: KVCache) -> None:
        self.host_memory.reset()
        cache.ledger.reset_peaks()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _metrics(self, prompt: list[int], generated: list[int], timer: RequestTimer, run: _Run) -> dict[str, Any]:
        caches, cache = run.caches, run.caches[0]
        synchronize(self.device)
        if self.device.type == "cuda":
            peak_device = torch.cuda.max_memory_allocated(self.device)
        else:  # the CPU stands in for the device: report what the engine placed on the device tier
            peak_device = self.weight_bytes["device"] + cache.ledger.peak("device")
        bus = {direction: sum(c.bus_bytes[direction] for c in caches) for direction in ("h2d", "d2h")}
        bus["hidden_states"] = run.hop_bytes
        record = RequestMetrics(
            cold_start_s=self.cold_start_s,
            prompt_tokens=len(prompt),
            generated_tokens=len(generated),
            ttft_s=timer.ttft_s,
            token_intervals_s=timer.intervals,
            peak_host_bytes=self.host_memory.peak(),
            peak_device_bytes=peak_device,
            extra={
                "kv_cache": cache.name,
                "kv_bytes": cache.bytes_per_tier(),
                "kv_peak_bytes": cache.peak_bytes_per_tier(),
                "kv_pages_moved": sum(c.pages_moved for c in caches),
                "decode_on": "device" if len(caches) == 1 else "host",
                "migration_bytes": sum(c.bus_bytes["d2h"] for c in caches[1:]),
                "adaptive_actions": list(run.actions),
                "bus_bytes": sum(bus.values()),
                "bus_bytes_detail": bus,
                "weight_bytes": dict(self.weight_bytes),
                "decode_weight_bytes": self.decode_weight_bytes,
                "weights_format": self.weights_format or str(self.model.compute_dtype).removeprefix("torch."),
            },
        )
        return record.to_dict()
