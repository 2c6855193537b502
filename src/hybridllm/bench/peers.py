"""Peer engines measured by the same method as ours (see ``measure``).

- llama.cpp through ``llama-cpp-python`` on the same GGUF file: ``Llama.generate`` with a
  greedy sampler, the time to its first token is the prefill, the intervals between the next
  tokens the decode. The KV cache is cleared before each run (no prompt reuse). ``spec="ngram"``
  runs it with llama-cpp-python's prompt lookup (``LlamaPromptLookupDecoding`` with its default
  ``max_ngram_size=2, num_pred_tokens=10``, the way its documentation shows it).
- Hugging Face transformers on the same weights (the GGUF file dequantized by transformers, the
  same Hugging Face folder, or the same random weights), with ``DynamicCache``, its offloading
  variant and ``QuantizedCache`` where the installed version offers them. A manual greedy
  loop: one forward over the whole prompt, then one forward per token (no ``generate``
  overhead; the most favourable way to time it).

A missing package, or a cache kind this version lacks, raises ``PeerUnavailable``: the row is
"skipped" with the reason.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridllm.bench.measure import PeerUnavailable, RunRecord, prompt_ids, synthetic_prompt_ids
from hybridllm.bench.sweep import BenchConfig
from hybridllm.bench.workloads import workload_prompt_ids
from hybridllm.config import parse_dtype
from hybridllm.engine.metrics import HostPeakMemory
from hybridllm.timing import synchronize


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _model_path(config: BenchConfig) -> Path:
    from hybridllm.loading.registry import default_model_path

    return Path(config.model).expanduser() if config.model else default_model_path()


def _our_prompt(config: BenchConfig, n_tokens: int, vocab_size: int) -> list[int]:
    """The prompt ids our engine gets for this model (our tokenizer of the same file)."""
    if config.random_weights:
        return synthetic_prompt_ids(vocab_size, n_tokens, config.seed)
    from hybridllm.loading.registry import open_checkpoint

    tokenizer = open_checkpoint(config.model).tokenizer()
    if config.workload is not None:
        return workload_prompt_ids(config.workload, tokenizer)
    return prompt_ids(tokenizer.encode, n_tokens)


# ---- llama.cpp --------------------------------------------------------------------------------
class LlamaCppRunner:
    """llama.cpp (``llama_cpp.Llama``) on the configuration's GGUF file."""

    # llama.cpp's KV types: (GGML type id, bytes per element); quantized K/V need flash attention.
    KV_TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}

    def __init__(self, config: BenchConfig) -> None:
        if config.random_weights:
            raise PeerUnavailable("llama.cpp needs a GGUF file; a model with random weights has none")
        path = _model_path(config)
        if path.is_dir() or path.suffix == ".safetensors":
            raise PeerUnavailable("llama.cpp needs a GGUF file; this model is a Hugging Face folder")
        try:
            import llama_cpp
        except ImportError:
            raise PeerUnavailable("llama-cpp-python is not installed (run `make bench-peers`)") from None
        from hybridllm.loading.registry import open_checkpoint

        self.config = config
        checkpoint = open_checkpoint(path)
        self.model_config = checkpoint.config
        self._tokenizer = checkpoint.tokenizer()
        self.n_gpu_layers = config.n_gpu_layers if config.n_gpu_layers is not None else 0
        self.gpu = bool(llama_cpp.llama_supports_gpu_offload()) and self.n_gpu_layers != 0
        threads: dict[str, Any] = {}
        if config.threads:
            threads = {"n_threads": config.threads, "n_threads_batch": config.threads}
        kv_name = config.kv_cache if config.kv_cache in self.KV_TYPES else "f16"  # our strategy names: its default
        kv_type, self.kv_bytes_per_element = self.KV_TYPES[kv_name]
        kv = {} if kv_name == "f16" else {"type_k": kv_type, "type_v": kv_type, "flash_attn": True}
        if config.spec not in ("none", "ngram"):
            raise PeerUnavailable(f"llama-cpp-python has no {config.spec!r} speculation here (prompt lookup only)")
        draft, headroom = {}, 0
        if config.spec == "ngram":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            lookup = LlamaPromptLookupDecoding()
            # its proposals need room in n_ctx; logits_all=True as a draft model forces it anyway (0.3.36 sizes
            # its scores buffer from the argument, too small for a prompt longer than n_batch otherwise)
            draft, headroom = {"draft_model": lookup, "logits_all": True}, lookup.num_pred_tokens + 1
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=config.context + config.new_tokens + headroom, n_batch=config.prefill_chunk,
            n_gpu_layers=self.n_gpu_layers, seed=config.seed, verbose=False, **threads, **kv, **draft,
        )
        self.weight_bytes = path.stat().st_size
        self.workload = config.workload
        self.variant = (f"llama-cpp-python {_version('llama_cpp_python')}" + ("" if self.gpu else " (CPU)")
                        + ("" if kv_name == "f16" else f", {kv_name} KV, flash attention")
                        + (", LlamaPromptLookupDecoding" if draft else ""))
        self.memory = HostPeakMemory()

    def prompt(self, n_tokens: int) -> list[int]:
        if self.workload is not None:
            return workload_prompt_ids(self.workload, self._tokenizer)
        return prompt_ids(self._tokenizer.encode, n_tokens)

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        self.llm.reset()  # forget the previous run: no prompt-prefix reuse
        gpu_used = _GpuUsage() if self.gpu else None
        self.memory.reset()
        stamps: list[float] = []
        stop_ids = set(self._tokenizer.eos_token_ids) if self.workload is not None else set()  # as ours
        start = time.perf_counter()
        for token in self.llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            stamps.append(time.perf_counter())
            if token in stop_ids:
                break
            self.memory.sample()
            if gpu_used is not None:
                gpu_used.sample()
            if len(stamps) >= new_tokens:
                break
        kv_total = int(self.model_config.kv_bytes_per_token(self.kv_bytes_per_element) * self.llm.n_ctx())
        if self.gpu:
            n_layers = self.model_config.n_layers
            layers_on = n_layers if self.n_gpu_layers < 0 else min(self.n_gpu_layers, n_layers)
            on_device = kv_total * layers_on // n_layers
            kv = {"device": on_device, "host": kv_total - on_device}
            peak_device = gpu_used.peak if gpu_used is not None else None
        else:  # the CPU is the compute device: report the engine's own accounting, as ours does
            kv = {"device": kv_total, "host": 0}
            peak_device = self.weight_bytes + kv_total
        return RunRecord(
            prompt_tokens=len(prompt), ttft_s=stamps[0] - start,
            intervals_s=[b - a for a, b in itertools.pairwise(stamps)],
            peak_host_bytes=self.memory.peak(), peak_device_bytes=peak_device, kv_bytes=kv, bus_bytes=None,
        ).to_dict()


class _GpuUsage:
    """Device memory in use (all processes) above what was in use at the start, sampled."""

    def __init__(self) -> None:
        self.available = torch.cuda.is_available()
        self.base = self._used() if self.available else 0
        self.peak = 0

    @staticmethod
    def _used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def sample(self) -> None:
        if self.available:
            self.peak = max(self.peak, self._used() - self.base)


# ---- transformers -----------------------------------------------------------------------------
class TransformersRunner:
    """Hugging Face transformers on the same weights, with the cache kind ``config.kv_cache``."""

    def __init__(self, config: BenchConfig) -> None:
        try:
            import transformers
        except ImportError:
            raise PeerUnavailable("transformers is not installed (pip install transformers)") from None
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.make_cache, self.variant = self._cache_factory(config.kv_cache)  # fail before the slow load
        self.model = self._load(config).to(self.device).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())
        self.variant = f"{self.variant}, transformers {_version('transformers')}"
        self.memory = HostPeakMemory()

    def _load(self, config: BenchConfig) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if config.random_weights:
            from hybridllm.bench.random_weights import random_hf_model

            return random_hf_model(config.random_weights, self.dtype, config.seed)
        path = _model_path(config)
        if path.is_dir():
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
        if path.suffix == ".safetensors":
            return AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=self.dtype)
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=self.dtype)

    def _cache_factory(self, kind: str) -> tuple[Callable[[], Any], str]:
        import transformers

        model_config = lambda: self.model.config
        if kind == "dynamic":
            return (lambda: transformers.DynamicCache(config=model_config())), "DynamicCache"
        if kind == "offloaded":
            if self.device.type != "cuda":
                raise PeerUnavailable("transformers' offloaded cache needs a CUDA device (it prefetches on CUDA streams)")
            if "offloading" in inspect.signature(transformers.DynamicCache.__init__).parameters:
                return (lambda: transformers.DynamicCache(config=model_config(), offloading=True)), \
                    "DynamicCache(offloading=True)"
            if hasattr(transformers, "OffloadedCache"):
                return transformers.OffloadedCache, "OffloadedCache"
            raise PeerUnavailable(f"transformers {_version('transformers')} has no offloaded cache")
        if kind == "quantized":
            if not hasattr(transformers, "QuantizedCache"):
                raise PeerUnavailable(f"transformers {_version('transformers')} has no QuantizedCache")
            from transformers import cache_utils

            for backend, available in (
                ("quanto", importlib.util.find_spec("optimum") is not None
                 and importlib.util.find_spec("optimum.quanto") is not None),
                ("hqq", importlib.util.find_spec("hqq") is not None),
                ("fp8", hasattr(cache_utils, "Fp8QuantizedLayer")),  # needs no extra package
            ):
                if not available:
                    continue
                return (lambda b=backend: transformers.QuantizedCache(b, model_config())), f"QuantizedCache({backend})"
            raise PeerUnavailable("transformers' QuantizedCache needs optimum-quanto or hqq; neither is installed")
        raise PeerUnavailable(f"transformers has no equivalent of the {kind!r} cache")

    def prompt(self, n_tokens: int) -> list[int]:
        return _our_prompt(self.config, n_tokens, self.model.config.vocab_size)

    def _forward(self, ids: torch.Tensor, cache: Any) -> int:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())  # .item(): waits for the device

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        cache = self.make_cache()
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)  # (1, T)
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.memory.reset()
        with torch.inference_mode():
            start = time.perf_counter()
            token = self._forward(ids, cache)
            stamps = [time.perf_counter()]
            eos = self.model.generation_config.eos_token_id
            stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None} if self.config.workload else set()
            for _ in range(new_tokens - 1):
                if token in stop_ids:  # a workload stops at the end of sequence, as ours
                    break
                token = self._forward(torch.tensor([[token]], device=self.device), cache)
                stamps.append(time.perf_counter())
                self.memory.sample()
        kv = cache_bytes(cache, self.device)
        if self.device.type == "cuda":
            peak_device = torch.cuda.max_memory_allocated(self.device)
        else:  # the CPU is the compute device: weights + KV on it, as our engine reports
            peak_device = self.weight_bytes + kv["device"]
        return RunRecord(
            prompt_tokens=len(prompt), ttft_s=stamps[0] - start,
            intervals_s=[b - a for a, b in itertools.pairwise(stamps)],
            peak_host_bytes=self.memory.peak(), peak_device_bytes=peak_device, kv_bytes=kv, bus_bytes=None,
        ).to_dict()


def cache_bytes(cache: Any, device: torch.device) -> dict[str, int]:
    """Bytes of the tensors a transformers cache holds, on the compute device vs elsewhere."""
    out = {"device": 0, "host": 0}
    seen: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in seen or value.is_meta:
                return
            seen.add(id(value))
            tier = "device" if value.device.type == device.type else "host"
            out[tier] += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)

    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            add(value)
    return out


def peer_versions() -> dict[str, str]:
    """Installed versions of the peer packages ("not installed" when absent)."""
    out = {}
    for name, dist in (("transformers", "transformers"), ("llama-cpp-python", "llama_cpp_python")):
        version = _version(dist)
        out[name] = version if version != "?" else "not installed"
    return out


def default_threads() -> int:
    """Threads PyTorch uses by default here (its choice of physical cores)."""
    return torch.get_num_threads() or os.cpu_count() or 1
