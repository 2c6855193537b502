"""The Python API: ``LLM`` loads a model once and serves requests.

    from hybridllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct, CPU, its 4/8-bit weights kept
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    print(out.text, out.metrics["decode_tps"])
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from hybridllm.config import EngineConfig, KVConfig, SamplingParams
from hybridllm.engine.generator import GenerationResult, Generator, StreamEvent
from hybridllm.engine.metrics import ColdStart
from hybridllm.engine.migration import PhaseMigration
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.dynamic import DynamicCache
from hybridllm.kvcache.factory import create_cache
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.quantized import check_weights_mode, weights_format
from hybridllm.placement.adaptive import AdaptivePolicy
from hybridllm.placement.apply import (
    TierDevices,
    all_on_host,
    decode_weight_bytes,
    host_decode_model,
    place_tied_head,
    weight_bytes_per_tier,
    weight_device_for,
)
from hybridllm.placement.placement import TIER_NAMES, Placement
from hybridllm.runtime.backends import AUTO, check_backend_name
from hybridllm.runtime.runner import ModelRunner, build_runner

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    Args:
        model: path of a GGUF file or a Hugging Face folder; None for the default model.
        device: "cpu" or "cuda[:N]": where weights and the hot KV cache live.
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
        fuse: stack q/k/v and gate/up into one matrix each at load (fewer operator calls per
            token; see ``hybridllm.models.fuse``); False keeps the parts' separate kernels.
        native_decode: with ``decode_backend="auto"``, run decode steps of host layers (batch 1,
            float32 activations) through the native C++ kernels (``hybridllm.kernels``; built
            once with the host compiler, PyTorch steps when that is impossible); False: the
            eager backend. Build and weight conversion count in the cold start.
        compile: the "compiled" decode backend: ``torch.compile`` the layers' dense parts for
            decode steps; the compile runs in a warm-up step at load and counts in the cold start.
        decode_backend: how decode steps run (``hybridllm.runtime.backends``): "auto" (native
            where layers are on the host, else eager), "eager", "compiled" or "native".
        **kv_options: the KV cache policy, same names as the CLI flags in snake case
            (``kv_cache="tiered"``, ``kv_hot_window=512``, ``vram_budget="8GiB"`` ...); they
            override a placement file's KV policy.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "cpu",
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
        decode_backend: str = AUTO,
        **kv_options: Any,
    ) -> None:
        if weights is not None:
            check_weights_mode(weights)
        self.engine_config = EngineConfig(device=device, dtype=dtype, prefill_chunk=prefill_chunk, threads=threads)
        unknown = set(kv_options) - set(KVConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown LLM options: {', '.join(sorted(unknown))}")
        if placement is not None and n_gpu_layers is not None:
            raise ConfigError("give a placement file or --n-gpu-layers, not both")
        if decode_on is not None and decode_on not in TIER_NAMES:
            raise ConfigError(f"--decode-on must be 'device' or 'host', got {decode_on!r}")
        self.decode_backend = resolve_decode_backend(decode_backend, native_decode, compile)
        if threads is not None:
            torch.set_num_threads(threads)
        self.cold_start = ColdStart()
        self.checkpoint = open_checkpoint(model)
        self.config = self.checkpoint.config
        self.placement = resolve_placement(self.config.n_layers, placement, n_gpu_layers, decode_on, weights,
                                           kv_options)
        self.kv_config = self.placement.kv
        weights = self.placement.weights
        check_weights_mode(weights)
        self.devices = TierDevices(self.engine_config.torch_device)
        self.model = load_model(
            self.checkpoint, self.engine_config.torch_dtype, weight_device_for(self.placement, self.devices),
            self.cold_start, show_progress, weights=weights, fuse=fuse,
        )
        place_tied_head(self.model, self.placement, self.devices)
        self.runner: ModelRunner = build_runner(self.model, self.placement, self.devices, self.decode_backend)
        self.cold_start.compile_s = self.runner.report.seconds
        self.weights_format = weights_format(self.model)
        t0 = time.perf_counter()
        self.tokenizer = self.checkpoint.tokenizer()
        self.cold_start.tokenizer_s = time.perf_counter() - t0
        self.weight_bytes = weight_bytes_per_tier(self.model, self.placement, self.runner.backend)
        self._migration: PhaseMigration | None = None
        if self.placement.decode_on == "host":
            t0 = time.perf_counter()
            self.phase_migration()
            self.cold_start.host_copy_s = time.perf_counter() - t0
        # What a decode step reads (the decoding model's weights; native layers read their own copy).
        decoding = self._migration.decode_model if self._migration else self.runner
        self.decode_weight_bytes = decode_weight_bytes(decoding.model, decoding.placement, decoding.backend)
        self._generator = Generator(
            self.runner,
            self.tokenizer,
            self.new_cache,
            device=self.devices.device,
            prefill_chunk=prefill_chunk,
            weight_bytes=self.weight_bytes,
            decode_weight_bytes=self.decode_weight_bytes,
            cold_start_s=self.cold_start.total_s,
            weights_format=self.weights_format,
            migration=self._migration,
            adaptive=AdaptivePolicy(self.phase_migration) if self.kv_config.kv_adaptive else None,
        )
        if self.decode_backend == "compiled":
            self._warm_up()

    # ---- public API ---------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, token ids, or chat messages)."""
        return self._generator.generate(self.encode_prompt(prompt), params or SamplingParams())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated."""
        for event in self._generator.stream(self.encode_prompt(prompt), params or SamplingParams()):
            if event.text:
                yield event.text

    def stream_events(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Like :meth:`stream`, but the last event also carries the full result and metrics."""
        yield from self._generator.stream(self.encode_prompt(prompt), params or SamplingParams())

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
        return create_cache(self.kv_config, self._kv_spec(), ledger if ledger is not None else self._kv_ledger(),
                            layer_tiers=self.placement.layer_tiers)

    def new_host_cache(self, ledger: MemoryLedger | None = None) -> DynamicCache:
        """An empty cache with every layer's KV in host RAM (where decoding continues after
        phase migration)."""
        return DynamicCache(self._kv_spec(), ledger if ledger is not None else self._kv_ledger(),
                            page_size=self.kv_config.kv_page_size, tier="host")

    def phase_migration(self) -> PhaseMigration:
        """Decoding on the host: a host copy of the device weights (made once) and host caches."""
        if self._migration is None:
            host_model = host_decode_model(self.model, self.devices)
            decode_runner = build_runner(host_model, all_on_host(self.placement), self.devices, self.decode_backend)
            self.weight_bytes["host"] = weight_bytes_per_tier(host_model, decode_runner.placement,
                                                              decode_runner.backend)["host"]
            self._migration = PhaseMigration(decode_runner, self.new_host_cache)
        return self._migration

    # ---- internals ----------------------------------------------------------------------
    def _warm_up(self) -> None:
        """One short request, so torch.compile's compile lands in the cold start, not in TTFT."""
        t0 = time.perf_counter()
        self._generator.generate([0, 0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        self.cold_start.compile_s += time.perf_counter() - t0
        self._generator.cold_start_s = self.cold_start.total_s

    def _kv_spec(self) -> KVSpec:
        cfg = self.config
        return KVSpec(
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.engine_config.torch_dtype,
            device=self.devices.device,
            host_device=self.devices.host,
            max_tokens=cfg.max_position_embeddings,
        )

    def _kv_ledger(self) -> MemoryLedger:
        """The KV ledger: the device tier gets what the VRAM budget leaves after the weights."""
        budget = self.kv_config.vram_budget
        if budget is None:
            return MemoryLedger(threshold=self.kv_config.kv_threshold)
        kv_budget = budget - self.weight_bytes["device"]
        if kv_budget <= 0:
            raise ConfigError(
                f"the weights on the device take {self.weight_bytes['device']} bytes, more than the VRAM budget "
                f"of {budget} bytes; raise --vram-budget or place fewer layers on the device"
            )
        return MemoryLedger({"device": kv_budget}, threshold=self.kv_config.kv_threshold)


def resolve_decode_backend(decode_backend: str, native_decode: bool, compile: bool) -> str:
    """The decode backend's name: ``compile=True`` means "compiled", ``native_decode=False``
    turns "auto" into "eager"; an unknown name is a ConfigError listing the names."""
    check_backend_name(decode_backend)
    if compile:
        return "compiled"
    if decode_backend == AUTO and not native_decode:
        return "eager"
    return decode_backend


def resolve_placement(n_layers: int, placement: Placement | str | os.PathLike | None, n_gpu_layers: int | None,
                      decode_on: str | None, weights: str | None, kv_options: dict[str, Any]) -> Placement:
    """The run's placement: a given one (object or JSON file), else ``-ngl``, else all on the
    device; explicit ``decode_on``, ``weights`` and KV options override what it says."""
    if placement is None:
        if n_gpu_layers is None:
            chosen = Placement.all_on_device(n_layers, weights="auto")
        else:
            chosen = Placement.from_n_gpu_layers(n_layers, n_gpu_layers, weights="auto")
    elif isinstance(placement, Placement):
        chosen = placement.check_layer_count(n_layers)
    else:
        chosen = Placement.load(placement, n_layers)
    kv = replace(chosen.kv, **kv_options) if kv_options else chosen.kv
    return replace(chosen, kv=kv, decode_on=decode_on or chosen.decode_on, weights=weights or chosen.weights)
