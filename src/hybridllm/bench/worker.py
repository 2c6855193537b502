"""Measure ONE configuration in this process and print its row.

    python -m hybridllm.bench.worker '<BenchConfig as JSON>'

The row is printed on the original standard output as one line starting with ``ROW_MARKER``;
anything the engines print goes to standard error, and so do the phases (``PHASE_MARKER`` lines:
loading, warm-up, run i of n) and, when the sweep times the worker out, every thread's stack
(:mod:`hybridllm.bench.stacks`): a timeout row says how far it got and where it was. Failures the worker can name become rows
too: out of memory -> "oom", a missing peer package -> "skipped", anything else -> "error"
with the exception's message. Only a crash prints no row; the sweep then classifies it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hybridllm.bench.measure import PeerUnavailable, RunRecord, prompt_ids, summarize, synthetic_prompt_ids
from hybridllm.bench.stacks import dump_stacks_on_signal
from hybridllm.bench.sweep import PHASE_MARKER, ROW_MARKER, BenchConfig, base_row
from hybridllm.bench.workloads import workload_prompt_ids
from hybridllm.config import KVConfig, ModelConfig, parse_dtype
from hybridllm.hardware import memory_totals
from hybridllm.kvcache.base import KVSpec
from hybridllm.kvcache.registry import get_strategy
from hybridllm.units import format_bytes

WARMUP_PROMPT_TOKENS = 16
WARMUP_NEW_TOKENS = 2
MEMORY_MARGIN = 1.10  # predicted bytes x this must fit in the available RAM
_OOM_TEXT = ("out of memory", "can't allocate memory", "Cannot allocate memory", "bad_alloc")
SPEC_FIGURES = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate")


class Runner(Protocol):
    variant: str | None

    def prompt(self, n_tokens: int) -> list[int]: ...

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]: ...


# ---- our engine -------------------------------------------------------------------------------
class HybridRunner:
    """hybridllm's ``LLM``, with the configuration's KV policy and placement passed through."""

    variant = None

    def __init__(self, config: BenchConfig) -> None:
        from hybridllm.llm import LLM

        options: dict[str, Any] = {**config.llm_options, **config.kv_options}
        options.update(device=config.device, dtype=config.dtype, threads=config.threads,
                       prefill_chunk=config.prefill_chunk, kv_cache=config.kv_cache)
        if config.spec != "draft":  # --model-draft in llm_options means spec "draft"
            options.pop("model_draft", None)
            options.pop("n_gpu_layers_draft", None)
            options["spec"] = config.spec
        if config.decode_on not in (None, "device"):  # decoding on the device is the engine's default
            options["decode_on"] = config.decode_on
        if config.n_gpu_layers is not None:
            options["n_gpu_layers"] = config.n_gpu_layers
        if config.weights is not None:
            options["weights"] = config.weights
        self.random = bool(config.random_weights)
        self.seed = config.seed
        self.workload = config.workload
        self.llm = LLM(model=config.checkpoint(), show_progress=False, **options)

    def prompt(self, n_tokens: int) -> list[int]:
        if self.workload is not None:
            return workload_prompt_ids(self.workload, self.llm.tokenizer)
        if self.random:
            return synthetic_prompt_ids(self.llm.config.vocab_size, n_tokens, self.seed)
        return prompt_ids(self.llm.tokenizer.encode, n_tokens)

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        from hybridllm.config import SamplingParams

        # a workload stops at the end of sequence, as a user's request; the synthetic prompt generates new_tokens
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=self.workload is None)
        metrics = self.llm.generate(list(prompt), params).metrics
        figures = RunRecord(
            prompt_tokens=metrics["prompt_tokens"],
            ttft_s=metrics["ttft_s"],
            intervals_s=[],
            peak_host_bytes=metrics["peak_host_bytes"],
            peak_device_bytes=metrics["peak_device_bytes"],
            kv_bytes=dict(metrics.get("kv_peak_bytes") or {"device": None, "host": None}),
            bus_bytes=metrics.get("bus_bytes"),
        ).to_dict()
        for key in ("prefill_tps", "ttft_s", "decode_tps", "tpot_p50_s", "tpot_p99_s", "tpot_mean_s",
                    "generated_tokens"):
            figures[key] = metrics[key]  # the engine's own recorder, same formulas
        figures["kv_pages_moved"] = metrics.get("kv_pages_moved")
        figures["bus_bytes_detail"] = metrics.get("bus_bytes_detail")
        figures["weights_format"] = metrics.get("weights_format")
        figures["weight_bytes"] = metrics.get("weight_bytes")
        figures["decode_weight_bytes"] = metrics.get("decode_weight_bytes")
        figures["kv_attention"] = self.llm.runtime.kv_attention
        for key in SPEC_FIGURES:
            figures[key] = metrics[key]
        return figures


# ---- the measurement ------------------------------------------------------------------------------
def make_runner(config: BenchConfig) -> Runner:
    if config.engine == "hybridllm":
        return HybridRunner(config)
    from hybridllm.bench import peers

    if config.engine == "llama.cpp":
        return peers.LlamaCppRunner(config)
    return peers.TransformersRunner(config)


def model_config(config: BenchConfig) -> ModelConfig:
    """The configuration's model architecture (read from the checkpoint's header or config.json)."""
    return config.checkpoint().config


def predicted_host_bytes(config: BenchConfig, model: ModelConfig) -> int | None:
    """Host RAM the configuration needs at least (weights + KV), or None when not predicted.

    Only where host RAM is the binding limit: our engine and transformers on the CPU. On a GPU an
    allocation failure is an exception the worker reports as "oom" without harm to the machine.
    """
    if config.engine == "llama.cpp" or config.device != "cpu":
        return None
    dtype = parse_dtype(config.dtype)
    spec = KVSpec(n_layers=model.n_layers, n_kv_heads=model.n_kv_heads, head_dim=model.head_dim, dtype=dtype,
                  device=torch.device("cpu"), max_tokens=model.max_position_embeddings)
    kv_config = KVConfig(kv_cache=config.kv_cache, **config.kv_options)
    held = get_strategy(config.kv_cache).memory(kv_config, spec, config.context + config.new_tokens)
    return int(model.parameter_count() * dtype.itemsize + sum(held.values()))  # every tier is RAM here


def _available_host_bytes() -> int:
    return memory_totals()[1]


def measure(config: BenchConfig) -> dict[str, Any]:
    """Load the engine, warm it up, run the repeats; the measured part of the row."""
    needed = predicted_host_bytes(config, model_config(config))
    if needed is not None:
        available = _available_host_bytes()
        if available and needed * MEMORY_MARGIN > available:  # 0: the OS does not say
            return {"status": "oom", "error": f"predicted (not run): needs at least {format_bytes(needed)} of RAM "
                                              f"for weights and KV, {format_bytes(available)} available"}
    start = time.perf_counter()
    _phase("loading")
    runner = make_runner(config)
    load_s = time.perf_counter() - start
    prompt = runner.prompt(config.context)
    if len(prompt) != config.context:
        raise RuntimeError(f"built a prompt of {len(prompt)} tokens instead of {config.context}")
    # (a workload's context is its prompt's length, taken with the same tokenizer when the grid was built)
    if config.warmup:
        _phase("warm-up")
        runner.run(prompt[:min(WARMUP_PROMPT_TOKENS, len(prompt))], WARMUP_NEW_TOKENS)
    runs = []
    for index in range(config.repeat):
        _phase(f"run {index + 1} of {config.repeat}")
        runs.append(runner.run(prompt, config.new_tokens))
    return {"status": "ok", "error": None, "variant": runner.variant, "load_s": load_s, **summarize(runs),
            "weights_format": runs[0].get("weights_format"),
            "weight_bytes": runs[0].get("weight_bytes") or {"device": None, "host": None},
            "decode_weight_bytes": runs[0].get("decode_weight_bytes"),
            "kv_pages_moved": runs[0].get("kv_pages_moved"), "bus_bytes_detail": runs[0].get("bus_bytes_detail"),
            "kv_attention": runs[0].get("kv_attention"), "runs": runs,
            **{key: runs[0].get(key) for key in SPEC_FIGURES}}  # greedy: every run proposes the same


def _phase(name: str) -> None:
    """Tell the sweep (on standard error) what the worker does now."""
    print(PHASE_MARKER + name, file=sys.stderr, flush=True)


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(status, message) of an exception raised while measuring."""
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    if isinstance(exc, PeerUnavailable):
        return "skipped", str(exc)
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "oom", message
    if isinstance(exc, RuntimeError) and any(t in str(exc) for t in _OOM_TEXT):
        return "oom", message
    return "error", message


def measure_row(config: BenchConfig) -> dict[str, Any]:
    """The full row of ``config``; never raises for a failure of the configuration itself."""
    row = base_row(config)
    start = time.perf_counter()
    try:
        row.update(measure(config))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        status, message = classify_exception(exc)
        row.update(status=status, error=message)
    row["wall_s"] = time.perf_counter() - start
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hybridllm.bench.worker '<BenchConfig JSON>'", file=sys.stderr)
        return 2
    dump_stacks_on_signal()
    row_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # engines' own prints must not mix with the row
    row = measure_row(BenchConfig.from_json(args[0]))
    row_out.write(ROW_MARKER + json.dumps(row) + "\n")
    row_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
