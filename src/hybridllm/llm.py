"""The Python API: ``LLM`` loads a model once and serves requests.

    from hybridllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct, CPU, float32
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    print(out.text, out.metrics["decode_tps"])
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridllm.config import EngineConfig, KVConfig, SamplingParams
from hybridllm.engine.generator import GenerationResult, Generator, StreamEvent
from hybridllm.engine.metrics import ColdStart
from hybridllm.errors import ConfigError
from hybridllm.kvcache.base import KVCache, KVSpec, MemoryLedger
from hybridllm.kvcache.factory import create_cache
from hybridllm.loading.loader import load_model
from hybridllm.loading.registry import open_checkpoint
from hybridllm.models.quantized import check_weights_mode, weights_format

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
        **kv_options: the KV cache policy, same names as the CLI flags in snake case
            (``kv_cache="tiered"``, ``kv_hot_window=512``, ``vram_budget="8GiB"`` ...).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        prefill_chunk: int = 512,
        show_progress: bool | None = None,
        weights: str = "float",
        **kv_options: Any,
    ) -> None:
        check_weights_mode(weights)
        self.engine_config = EngineConfig(device=device, dtype=dtype, prefill_chunk=prefill_chunk, threads=threads)
        unknown = set(kv_options) - set(KVConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown LLM options: {', '.join(sorted(unknown))}")
        self.kv_config = KVConfig(**kv_options)
        if threads is not None:
            torch.set_num_threads(threads)
        self.cold_start = ColdStart()
        self.checkpoint = open_checkpoint(model)
        self.config = self.checkpoint.config
        device_obj = self.engine_config.torch_device
        self.model = load_model(
            self.checkpoint, self.engine_config.torch_dtype, lambda _name: device_obj, self.cold_start, show_progress,
            weights=weights,
        )
        self.weights_format = weights_format(self.model)
        t0 = time.perf_counter()
        self.tokenizer = self.checkpoint.tokenizer()
        self.cold_start.tokenizer_s = time.perf_counter() - t0
        self.weight_bytes = _weight_bytes_per_tier(self.model, device_obj)
        self._generator = Generator(
            self.model,
            self.tokenizer,
            self.new_cache,
            device=device_obj,
            prefill_chunk=prefill_chunk,
            weight_bytes=self.weight_bytes,
            cold_start_s=self.cold_start.total_s,
            weights_format=self.weights_format,
        )

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
        cfg = self.config
        spec = KVSpec(
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.engine_config.torch_dtype,
            device=self.engine_config.torch_device,
            max_tokens=cfg.max_position_embeddings,
        )
        return create_cache(self.kv_config, spec, ledger if ledger is not None else self._kv_ledger())

    # ---- internals ----------------------------------------------------------------------
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


def _weight_bytes_per_tier(model: torch.nn.Module, device: torch.device) -> dict[str, int]:
    """Bytes of parameters on the compute device vs elsewhere (tied weights counted once).

    Quantized weights are buffers (codes and scales): they count too; rotary tables do not.
    """
    out = {"device": 0, "host": 0}
    seen: set[int] = set()
    buffers = (b for name, b in model.named_buffers() if not name.startswith("rotary."))
    for param in itertools.chain(model.parameters(), buffers):
        if id(param) in seen:
            continue
        seen.add(id(param))
        tier = "device" if param.device == device else "host"
        out[tier] += param.numel() * param.element_size()
    return out
