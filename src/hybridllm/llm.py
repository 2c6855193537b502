"""The Python API: ``LLM`` loads a model once and serves requests.

    from hybridllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct, CPU, its 4/8-bit weights kept
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    print(out.text, out.metrics["decode_tps"])
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import psutil

from hybridllm.config import EngineConfig, PrefixCacheConfig, SamplingParams, SpeculativeConfig
from hybridllm.engine.llm_engine import GenerationResult, LLMEngine, StreamEvent
from hybridllm.engine.prefix import build_prefix_cache
from hybridllm.errors import ConfigError
from hybridllm.kernels.native_linear import activation_digits
from hybridllm.kvcache.base import KVCache, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.loading.registry import open_checkpoint
from hybridllm.placement.placement import Placement
from hybridllm.runtime.build import BuildOptions, build_runtime, resolve_decode_backend, resolve_placement
from hybridllm.runtime.migration import PhaseMigration

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    Args:
        model: path of a GGUF file or a Hugging Face folder; None for the default model.
        device: "cpu", "cuda[:N]" or "auto" (cuda when PyTorch sees a GPU): where weights and
            the hot KV cache live.
        dtype: compute dtype: "float32", "bfloat16" or "float16".
        threads: CPU threads for PyTorch (None: PyTorch's default).
        prefill_chunk: prompt tokens per prefill step.
        show_progress: progress bar while loading (default: on a terminal for large files).
        weights: "float" (dequantize to ``dtype``), "auto" (keep the file's 4/8-bit quantization
            where a kernel exists), "int8" or "int4" (see ``hybridllm.models.quantized``).
            None: the placement file's choice, else "auto" (like llama.cpp, the file's
            quantization is what runs).
        placement: a :class:`~hybridllm.placement.Placement` or the path of one saved as JSON
            (``--placement``): per-layer weight tiers, KV policy, decode tier.
        n_gpu_layers: llama.cpp's ``-ngl``: the first N layers on ``device``, the rest on the host
            (more than the model has is clamped with a warning).
        decode_on: "device", or "host" for phase migration: prefill on ``device``, then the KV
            moves to the host and decoding runs there on a host copy of the weights.
        fuse: stack q/k/v and gate/up into one projection each (fewer operator calls per token;
            see ``hybridllm.models.fuse``).
        native_decode: run decode steps of host layers (batch 1, float32 activations) through
            the native C++ kernels (``hybridllm.kernels``; built once with the host compiler,
            PyTorch steps when that is impossible). Build and weight conversion count in the
            cold start.
        compile: ``torch.compile`` the layers' dense parts for decode steps; the compile runs
            in a warm-up step at load and counts in the cold start (the "compiled" backend).
        decode_backend: the decode backend by name ("eager", "compiled", "native", ... see
            ``hybridllm.runtime.backends``); "auto" follows ``native_decode`` and ``compile``.
        activations: how the native kernels' products round their inputs for the weights kept in
            the file's quantized types: "exact" (two int8 digits per value, ~15 bits: logits within
            ~1e-6 nats of float32's) or "int8" (one digit per value with a scale per 32, as
            llama.cpp's Q8_0 activations: half the integer work, so faster prefill; the KL from the
            exact model about llama.cpp's on Q4_0/Q4_1 files, about half of it on K-quant ones).
            Every row still gets one arithmetic (chunked, cached or batched alike).
        ctx_size: llama.cpp's ``-c``: caps the context window (prompt + generated tokens) and
            sizes the KV to it; 0: the model's own window.
        prefix_cache_ram: host RAM for KV pages reused across requests (a size such as "1GiB",
            "auto": min(2 GiB, 10% of RAM); None or 0: no prefix cache unless a disk tier).
        prefix_cache_disk: a directory for the prefix cache's disk tier (survives restarts).
        prefix_cache_disk_size: bytes of page files allowed on disk (default 8 GiB).
        prefix_cache_vram: device memory for the hottest reusable pages (default 0: none).
        spec: speculative decoding: "none", "ngram" (proposals from the prompt and the text so
            far) or "draft" (``model_draft`` proposes); the text is the same, only faster where
            proposals are accepted (see :class:`~hybridllm.config.SpeculativeConfig`).
        spec_ngram_max, spec_ngram_min: the n-gram lengths ``spec="ngram"`` matches, longest first.
        draft_max, draft_min: most tokens proposed per step; fewest worth a verification.
        model_draft: a draft model (GGUF file or Hugging Face folder) with this model's vocabulary;
            giving it turns speculation on (llama.cpp's ``-md``).
        n_gpu_layers_draft: the draft model's layers on ``device`` (llama.cpp's ``-ngld``; None: all).
        spec_max_batch: speculate only in steps where at most this many sequences decode (0: always).
        **kv_options: the KV cache policy, same names as the CLI flags in snake case
            (``kv_cache="tiered"``, ``kv_hot_window=512``, ``vram_budget="8GiB"`` ...); they
            override a placement file's KV policy.
    """

    def __init__(
        self,
        model: str | os.PathLike | Any | None = None,
        device: str = "auto",
        dtype: str = "float32",
        threads: int | None = None,
        prefill_chunk: int = 512,
        show_progress: bool | None = None,
        weights: str | None = None,
        placement: Placement | str | os.PathLike | None = None,
        n_gpu_layers: int | None = None,
        decode_on: str | None = None,
        fuse: bool = True,
        native_decode: bool = True,
        compile: bool = False,
        decode_backend: str = "auto",
        activations: str = "exact",
        ctx_size: int = 0,
        prefix_cache_ram: str | int | None = None,
        prefix_cache_disk: str | os.PathLike | None = None,
        prefix_cache_disk_size: str | int | None = None,
        prefix_cache_vram: str | int | None = None,
        spec: str = "none",
        spec_ngram_max: int = SpeculativeConfig.spec_ngram_max,
        spec_ngram_min: int = SpeculativeConfig.spec_ngram_min,
        draft_max: int = SpeculativeConfig.draft_max,
        draft_min: int = SpeculativeConfig.draft_min,
        model_draft: str | os.PathLike | None = None,
        n_gpu_layers_draft: int | None = None,
        spec_max_batch: int = SpeculativeConfig.spec_max_batch,
        **kv_options: Any,
    ) -> None:
        engine_config = EngineConfig(device=device, dtype=dtype, prefill_chunk=prefill_chunk, threads=threads,
                                     ctx_size=ctx_size)
        activation_digits(activations)  # an unknown mode fails before the slow load
        options = BuildOptions(fuse=fuse, decode_backend=resolve_decode_backend(decode_backend, native_decode, compile),
                               show_progress=show_progress, activations=activations)
        speculative = SpeculativeConfig(spec=spec, spec_ngram_max=spec_ngram_max, spec_ngram_min=spec_ngram_min,
                                        draft_max=draft_max, draft_min=draft_min,
                                        model_draft=None if model_draft is None else os.fspath(model_draft),
                                        n_gpu_layers_draft=n_gpu_layers_draft, spec_max_batch=spec_max_batch)
        checkpoint = open_checkpoint(model)
        if speculative.model_draft is not None:
            open_checkpoint(speculative.model_draft)  # a missing draft model fails before the slow load
        chosen = resolve_placement(checkpoint.config.n_layers, placement, n_gpu_layers, decode_on, weights, kv_options)
        self.runtime = build_runtime(checkpoint, engine_config, chosen, options, speculative)
        prefix_config = PrefixCacheConfig.parse(prefix_cache_ram, prefix_cache_disk, prefix_cache_disk_size,
                                                total_ram=psutil.virtual_memory().total, vram=prefix_cache_vram)
        self.prefix_cache = build_prefix_cache(self.runtime, prefix_config)
        self.engine = LLMEngine(self.runtime, prefix_cache=self.prefix_cache)

    # ---- what was built -----------------------------------------------------------------
    @property
    def checkpoint(self) -> Any:
        return self.runtime.checkpoint

    @property
    def config(self):
        return self.runtime.config

    @property
    def engine_config(self) -> EngineConfig:
        return self.runtime.engine_config

    @property
    def placement(self) -> Placement:
        return self.runtime.placement

    @property
    def kv_config(self):
        return self.runtime.kv_config

    @property
    def speculative(self) -> SpeculativeConfig:
        """Speculative decoding's settings (``spec="none"``: off)."""
        return self.runtime.speculative

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    @property
    def runner(self):
        """The model runner as placed (``runner(ids, cache, start_pos)`` -> logits)."""
        return self.runtime.runner

    @property
    def model(self):
        """The loaded model (pure: no devices or tiers of its own; run it through :attr:`runner`)."""
        return self.runtime.runner.model

    @property
    def cold_start(self):
        return self.runtime.cold_start

    @property
    def weight_bytes(self) -> dict[str, int]:
        return self.runtime.weight_bytes

    @property
    def decode_weight_bytes(self) -> int:
        return self.runtime.decode_weight_bytes

    @property
    def weights_format(self) -> str:
        return self.runtime.weights_format

    # ---- public API ---------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, token ids, or chat messages)."""
        return self.engine.generate(self.encode_prompt(prompt), params or SamplingParams())

    def generate_all(self, prompt: Prompt, params: SamplingParams) -> list[GenerationResult]:
        """Generate ``params.n`` completions of ``prompt`` (they share the prompt's KV), by index."""
        return self.engine.generate_all(self.encode_prompt(prompt), params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               cancel: threading.Event | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated; setting ``cancel`` stops it (the
        stream ends before the next step, its KV freed)."""
        for event in self.engine.stream(self.encode_prompt(prompt), params or SamplingParams(), cancel):
            if event.text:
                yield event.text

    def stream_events(self, prompt: Prompt, params: SamplingParams | None = None,
                      cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """Like :meth:`stream`, but the last event also carries the full result and metrics (no
        result when ``cancel`` stopped the request)."""
        yield from self.engine.stream(self.encode_prompt(prompt), params or SamplingParams(), cancel)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's own template."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text is encoded as is, messages through the chat template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self.tokenizer.encode(self.apply_chat_template(items), add_special_tokens=False)
        if all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        raise ConfigError("a prompt is a string, a list of token ids, or a list of chat messages")

    def new_cache(self, ledger: MemoryLedger | None = None) -> KVCache:
        """An empty KV cache following this engine's KV policy and budgets.

        ``ledger``: account the cache in this ledger (a server shares one across all its
        sequences); None gives the cache a fresh ledger with this engine's budgets.
        """
        return self.runtime.new_cache(ledger)

    def new_host_cache(self, ledger: MemoryLedger | None = None) -> DynamicCache:
        """An empty cache with every layer's KV in host RAM (where decoding continues after
        phase migration)."""
        return self.runtime.new_host_cache(ledger)

    def phase_migration(self) -> PhaseMigration:
        """Decoding on the host: the host runner (weights copied once) and host caches."""
        return self.runtime.migration()
