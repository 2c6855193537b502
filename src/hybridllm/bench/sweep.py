"""The grid of configurations and the sweep that runs each one in its own process.

A configuration is a plain dataclass serialised as JSON on the worker's command line. The
child measures it and prints one row; the parent turns a crash, a kill by the kernel's
out-of-memory killer or a timeout into a row with ``status`` "error", "oom" or "timeout",
so one bad configuration never ends the sweep.

Row ``status`` values: "ok", "error", "oom", "timeout", "skipped" (not run, with the reason).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridllm.bench import stacks
from hybridllm.errors import ConfigError
from hybridllm.kvcache.registry import get_strategy

if TYPE_CHECKING:
    from hybridllm.loading.checkpoint import Checkpoint

ENGINES = ("hybridllm", "llama.cpp", "transformers")
BASELINES = ("llama.cpp", "transformers")
DECODE_ON = ("device", "host")
SPECS = ("none", "ngram", "draft")  # speculative decoding (bench --spec)
PEER_SPECS = {"llama.cpp": ("none", "ngram"), "transformers": ("none",)}  # what each peer runs
STATUSES = ("ok", "error", "oom", "timeout", "skipped")
# Our strategies that transformers has an equivalent of (DynamicCache, offloading, QuantizedCache).
HF_CACHES = ("dynamic", "offloaded", "quantized")
LLAMA_CPP_CACHE = "f16"  # llama.cpp's default KV type
LLAMA_CPP_CACHES = ("f16", "q8_0", "q4_0")  # the KV types llama.cpp offers (type_k / type_v)
ROW_MARKER = "HYBRIDLLM_BENCH_ROW "
PHASE_MARKER = "HYBRIDLLM_BENCH_PHASE "  # the worker's standard error: what it does now (loading, warm-up, run i of n)
STDERR_TAIL_LINES = 60  # a timed-out row keeps this much of the worker's standard error (its stacks)
WORKER_MODULE = "bench/worker.py"  # the measuring thread's stack passes through it
DEFAULT_TIMEOUT_S = 1800.0
_OOM_PATTERNS = ("MemoryError", "OutOfMemoryError", "out of memory", "can't allocate memory",
                 "Cannot allocate memory", "std::bad_alloc")


@dataclass
class BenchConfig:
    """One point of the grid: an engine, a model, a KV policy and placement, a context length.

    Args:
        engine: "hybridllm", "llama.cpp" or "transformers".
        model: GGUF file or Hugging Face folder; None for the default model.
        random_weights: a Hugging Face ``config.json``: a model of that shape with random weights.
        context: prompt tokens (the prompt has exactly this many).
        new_tokens: tokens generated after the prompt (greedy, end-of-sequence ignored).
        kv_cache: our KV strategy; for transformers its cache of the same kind; llama.cpp's KV type
            ("f16", its default, "q8_0" or "q4_0": flash attention on, as llama.cpp needs for them).
        decode_on: "device" or "host" (None: the engine's default, which is the device).
        n_gpu_layers: layers whose weights live on the device (None: the engine's default).
        repeat: measured runs in the same process after one warm-up; rows report the median.
        threads: CPU threads (None: PyTorch's default).
        device: compute device of our engine and transformers ("cpu", "cuda").
        dtype: compute dtype of our engine and transformers.
        warmup: run a short request before the measured ones (first-call overheads).
        kv_options: more ``KVConfig`` fields for our engine (``vram_budget``, ``kv_hot_window`` ...).
        seed: seed of the random weights.
        prefill_chunk: prompt tokens per forward of our engine (llama.cpp's ``n_batch``).
        weights: our engine's weight mode ("float", "auto", "int8", "int4"; None: its default).
        llm_options: more ``LLM`` keyword arguments for our engine (a ``placement`` file, the speed
            options ``fuse``, ``native_decode``, ``compile``, ``decode_backend``, speculative
            decoding's ``draft_max``, ``model_draft`` ...).
        spec: speculative decoding: "none", "ngram" (ours: ``--spec ngram``; llama.cpp:
            llama-cpp-python's ``LlamaPromptLookupDecoding``) or "draft" (ours: ``--model-draft``).
        workload: a named chat prompt (``hybridllm.bench.workloads``: rewrite, quote, chat) instead of
            the synthetic prompt of ``context`` tokens (``context`` is then its length); generation
            stops at the end of sequence.
    """

    engine: str = "hybridllm"
    model: str | None = None
    random_weights: str | None = None
    context: int = 512
    new_tokens: int = 128
    kv_cache: str = "dynamic"
    decode_on: str | None = None
    n_gpu_layers: int | None = None
    repeat: int = 1
    threads: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    warmup: bool = True
    kv_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    prefill_chunk: int = 512
    weights: str | None = None
    llm_options: dict[str, Any] = field(default_factory=dict)
    spec: str = "none"
    workload: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.context < 1 or self.new_tokens < 1 or self.repeat < 1:
            raise ConfigError("context, new tokens and repeat must all be >= 1")
        if self.decode_on is not None and self.decode_on not in DECODE_ON:
            raise ConfigError(f"decode_on must be one of {', '.join(DECODE_ON)}, got {self.decode_on!r}")
        if self.model is not None and self.random_weights is not None:
            raise ConfigError("give either a model or --random-weights, not both")
        if self.spec not in SPECS:
            raise ConfigError(f"--spec must be one of {', '.join(SPECS)}, got {self.spec!r}")
        if self.workload is not None:
            from hybridllm.bench.workloads import check_workload

            check_workload(self.workload)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def checkpoint(self) -> Checkpoint:
        """The checkpoint measured: ``random_weights``' shape drawn in ``dtype`` from ``seed``, or ``model``.

        Raises:
            ModelLoadError: the model or config file is missing or unreadable.
        """
        from hybridllm.loading.random_checkpoint import RandomCheckpoint
        from hybridllm.loading.registry import open_checkpoint

        if self.random_weights:
            return RandomCheckpoint(self.random_weights, self.dtype, self.seed)
        return open_checkpoint(self.model)

    @property
    def model_label(self) -> str:
        """Short model name for tables: the model's one name (``model_name``: the file's name without
        ``.gguf``, as ``hybridllm models`` and the server show it), ``random:<config>`` for random weights."""
        if self.random_weights:
            return f"random:{Path(self.random_weights).stem}"
        from hybridllm.loading.local_models import model_name
        from hybridllm.loading.registry import DEFAULT_MODEL_FILE

        return model_name(self.model or DEFAULT_MODEL_FILE)

    @property
    def series(self) -> tuple:
        """What stays the same along the context axis (one line of a plot)."""
        return (self.engine, self.model, self.random_weights, self.kv_cache, self.decode_on, self.n_gpu_layers,
                self.new_tokens, json.dumps(self.kv_options, sort_keys=True),
                json.dumps(self.llm_options, sort_keys=True), self.spec, self.workload)

    def label(self) -> str:
        parts = [self.engine, self.kv_cache]
        if self.decode_on:
            parts.append(f"decode on {self.decode_on}")
        if self.n_gpu_layers is not None:
            parts.append(f"ngl {self.n_gpu_layers}")
        if self.spec != "none":
            parts.append(f"spec {self.spec}")
        if self.workload is not None:
            parts.append(f"{self.workload} prompt")
        parts.append(f"ctx {self.context}")
        return " / ".join(parts)


def base_row(config: BenchConfig) -> dict[str, Any]:
    """The identifying columns of a row, and every measured column empty."""
    return {
        "engine": config.engine,
        "model": config.model_label,
        "kv_cache": config.kv_cache,
        "variant": None,
        "decode_on": config.decode_on,
        "n_gpu_layers": config.n_gpu_layers,
        "context": config.context,
        "new_tokens": config.new_tokens,
        "repeat": config.repeat,
        "prefill_tps": None,
        "ttft_s": None,
        "decode_tps": None,
        "tpot_p50_s": None,
        "tpot_p99_s": None,
        "peak_device_bytes": None,
        "peak_host_bytes": None,
        "kv_bytes": {"device": None, "host": None},
        "bus_bytes": None,
        "bus_bytes_detail": None,  # {"h2d": ..., "d2h": ...} where the engine reports it
        "kv_pages_moved": None,
        "kv_attention": None,  # ours: "native", "PyTorch" (the kernels cannot read the strategy), ...
        "status": "error",
        "error": None,
        "threads": config.threads,
        "device": config.device,
        "dtype": config.dtype,
        "kv_options": dict(config.kv_options),
        "weights": config.weights if config.engine == "hybridllm" else None,  # the peers run the file as they read it
        "weights_format": None,
        "weight_bytes": {"device": None, "host": None},
        "decode_weight_bytes": None,
        "load_s": None,
        "wall_s": None,
        "spec": config.spec,
        "workload": config.workload,
        "generated_tokens": None,
        "spec_drafts": None,  # ours: verified proposals, proposed and accepted tokens (llama-cpp-python reports none)
        "spec_draft_tokens": None,
        "spec_accepted_tokens": None,
        "spec_acceptance_rate": None,
    }


def _parse_list(value: str | Sequence | None, kind: Callable[[str], Any], what: str) -> list:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            out.append(kind(text))
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"invalid {what} {text!r}: {exc}") from None
    return out


def parse_context(text: str) -> int:
    """'4096', '4K' or '4k' (x1024) -> tokens."""
    lowered = text.strip().lower()
    value = int(lowered[:-1]) * 1024 if lowered.endswith("k") else int(lowered)
    if value < 1:
        raise ValueError("a prompt length must be >= 1 token")
    return value


def parse_contexts(value: str | Sequence | None) -> list[int]:
    return _parse_list(value, parse_context, "--prompt-tokens value")


def parse_names(value: str | Sequence | None, allowed: Sequence[str], what: str) -> list[str]:
    names = _parse_list(value, str, what)
    for name in names:
        if name not in allowed:
            raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(allowed)}")
    return names


def parse_layers(value: str | Sequence | None) -> list[int]:
    return _parse_list(value, int, "--n-gpu-layers value")


def build_grid(
    contexts: Iterable[int],
    kv_caches: Sequence[str] = ("dynamic",),
    decode_ons: Sequence[str | None] = (None,),
    n_gpu_layers: Sequence[int | None] = (None,),
    baselines: Sequence[str] = (),
    include_ours: bool = True,
    llama_cpp_caches: Sequence[str] = (LLAMA_CPP_CACHE,),
    specs: Sequence[str] = ("none",),
    **common: Any,
) -> list[BenchConfig]:
    """Every configuration of the sweep, by context (smallest first), then engine and strategy.

    Our engine gets one configuration per (strategy, decode_on, n_gpu_layers, spec). llama.cpp gets
    one per (KV type of ``llama_cpp_caches``, n_gpu_layers, spec it runs: none, ngram);
    transformers one per cache kind among ``kv_caches`` that it has (dynamic, offloaded,
    quantized), or its DynamicCache when none of them maps, without speculation.
    """
    for name in llama_cpp_caches:
        if name not in LLAMA_CPP_CACHES:
            raise ConfigError(f"unknown llama.cpp KV type {name!r}; choose from {', '.join(LLAMA_CPP_CACHES)}")
    for name in kv_caches:
        get_strategy(name)  # a ConfigError naming the registered strategies
    for name in baselines:
        if name not in BASELINES:
            raise ConfigError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    for name in specs:
        if name not in SPECS:
            raise ConfigError(f"unknown --spec value {name!r}; choose from {', '.join(SPECS)}")
    hf_caches = [k for k in kv_caches if k in HF_CACHES] or ["dynamic"]
    grid: list[BenchConfig] = []
    for context in sorted(set(contexts)):
        if include_ours:
            for kv in kv_caches:
                for decode_on in decode_ons:
                    for layers in n_gpu_layers:
                        for spec in specs:
                            grid.append(BenchConfig(engine="hybridllm", context=context, kv_cache=kv,
                                                    decode_on=decode_on, n_gpu_layers=layers, spec=spec, **common))
        if "llama.cpp" in baselines:
            for kv in llama_cpp_caches:
                for layers in n_gpu_layers:
                    for spec in [s for s in specs if s in PEER_SPECS["llama.cpp"]] or ["none"]:
                        grid.append(BenchConfig(engine="llama.cpp", context=context, kv_cache=kv, n_gpu_layers=layers,
                                                spec=spec, **common))
        if "transformers" in baselines:
            for kv in hf_caches:
                grid.append(BenchConfig(engine="transformers", context=context, kv_cache=kv, **common))
    return grid


# ---- running ----------------------------------------------------------------------------------
def classify_failure(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, message) of a worker that printed no row."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            return "oom", f"killed by {name} (most likely the out-of-memory killer){': ' + last if last else ''}"
        return "error", f"killed by {name}{': ' + last if last else ''}"
    if any(p in stderr for p in _OOM_PATTERNS):
        oom_line = next((line for line in reversed(lines) if any(p in line for p in _OOM_PATTERNS)), last)
        return "oom", oom_line
    return "error", last or f"worker exited with code {returncode} and no message"


def _child_env(config: BenchConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(config.threads)
    env.update({
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",  # never download: every engine reads the same local files
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def run_config(config: BenchConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Measure one configuration in a fresh Python process; always returns a row."""
    row = base_row(config)
    command = [sys.executable, "-m", "hybridllm.bench.worker", config.to_json()]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env(config), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks.ask_for_stacks(proc)
        try:
            proc.communicate(timeout=stacks.STACK_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(proc)
        _, stderr = proc.communicate()  # everything the worker printed, the stacks included
        row.update(status="timeout", error=f"no result within {timeout_s:g} s{_how_far(stderr)}",
                   stderr_tail=stderr.splitlines()[-STDERR_TAIL_LINES:], wall_s=time.perf_counter() - start)
        return row
    except BaseException:  # Ctrl-C: the child has its own session and would not get the signal
        _kill_group(proc)
        proc.wait()
        raise
    row["wall_s"] = time.perf_counter() - start
    for line in reversed(stdout.splitlines()):
        if line.startswith(ROW_MARKER):
            measured = json.loads(line[len(ROW_MARKER):])
            measured.pop("wall_s", None)
            row.update(measured)
            return row
    status, message = classify_failure(proc.returncode, stderr)
    row.update(status=status, error=message)
    return row


def _how_far(stderr: str) -> str:
    """`` (in run 1 of 3, at kvcache/tiered.py:310 in _attention_on_device)`` from a timed-out
    worker's standard error: its last phase and the innermost frame of our code it was in."""
    phases = [line[len(PHASE_MARKER):] for line in stderr.splitlines() if line.startswith(PHASE_MARKER)]
    found = [f"in {phases[-1]}"] if phases else []
    frame = stacks.where(stderr, WORKER_MODULE)
    if frame is not None:
        found.append(f"at {frame}")
    return f" ({', '.join(found)})" if found else ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own session: only its processes
    except (ProcessLookupError, PermissionError):
        proc.kill()


def skip_reason(config: BenchConfig, window: int | None, oom_context: int | None) -> str | None:
    """Why a configuration is not worth running, or None."""
    if window is not None and config.context + config.new_tokens > window:
        return (f"context {config.context} + {config.new_tokens} new tokens exceed the model's window of "
                f"{window} tokens")
    if oom_context is not None and config.context > oom_context:
        return f"a smaller context ({oom_context}) of the same configuration already ran out of memory"
    return None


def model_window(config: BenchConfig) -> int | None:
    """The model's context window, read from its header; a missing or unreadable model raises."""
    return config.checkpoint().config.max_position_embeddings


def run_sweep(
    configs: Sequence[BenchConfig],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every configuration, each in its own process, under a progress bar; return the rows.

    Configurations whose context does not fit the model's window, or whose series already ran
    out of memory at a smaller context, become "skipped" rows without being run.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    windows: dict[tuple, int | None] = {}
    oom_at: dict[tuple, int] = {}
    rows: list[dict[str, Any]] = []
    console = Console(stderr=True)
    bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"), console=console, disable=not progress, transient=True)
    with bar:
        task = bar.add_task("", total=len(configs))
        for config in configs:
            bar.update(task, description=config.label())
            key = (config.model, config.random_weights)
            if key not in windows:
                windows[key] = model_window(config)
            reason = skip_reason(config, windows[key], oom_at.get(config.series))
            if reason is not None:
                row = base_row(config)
                row.update(status="skipped", error=reason)
            else:
                row = run_config(config, timeout_s)
            if row["status"] == "oom":
                oom_at[config.series] = min(config.context, oom_at.get(config.series, config.context))
            rows.append(row)
            if progress:
                bar.console.print(_one_line(config, row), markup=False, highlight=False, soft_wrap=True)
            if on_row is not None:
                on_row(row)
            bar.advance(task)
    return rows


def _one_line(config: BenchConfig, row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return (f"{config.label()}: prefill {row['prefill_tps']:.1f} tok/s, decode {row['decode_tps']:.1f} tok/s")
    return f"{config.label()}: {row['status']}: {row['error']}"
