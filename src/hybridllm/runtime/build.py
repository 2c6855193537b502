"""The one build path: checkpoint + placement + speed options -> a :class:`Runtime`.

    runtime = build_runtime(open_checkpoint(path), EngineConfig(device="cpu"), placement,
                            BuildOptions(decode_backend="auto"))

Every front end builds through here: the ``LLM`` facade (and so the CLI, the server and the
bench worker), the hardware probe of the engine's own decode path and the perplexity
evaluation. The steps, each timed into the cold start:

1. load every weight straight onto its tier's device (``loading``), in one projection layout
   (host int4 layers straight into the native kernels' blocks when they will run: one copy);
2. give a tied head its own copy when the head's tier differs from the embedding's;
3. build the model runner: per-tier layer segments, hop counting, the decode backend;
4. the tokenizer;
5. ``--decode-on host``: the host runner (a host copy of the device weights) up front;
6. a warm-up step when the backend compiles lazily (so compilation is not in the first TTFT);
7. ``--model-draft``: the draft model of speculative decoding, built the same way (its own
   placement: ``-ngld``), refused in one line unless its vocabulary is the model's.
"""

from __future__ import annotations

import logging

import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridllm.config import EngineConfig, KVConfig, SpeculativeConfig
from hybridllm.errors import ConfigError
from hybridllm.kvcache.factory import check_attention_options
from hybridllm.loading.loader import load_model
from hybridllm.loading.quantized_loader import release_load_scratch
from hybridllm.kernels.abi import EXACT_DIGITS, kernels
from hybridllm.kernels.build import KernelBuildError
from hybridllm.kernels.host_attention import HostPartialAttention
from hybridllm.kernels.native_linear import NATIVE_LAYOUT, NativeHostLayout, activation_digits
from hybridllm.kvcache.registry import get_strategy
from hybridllm.models.quantized import check_weights_mode, weights_format
from hybridllm.placement.apply import (
    TierDevices,
    all_on_host,
    host_decode_model,
    place_tied_head,
    weight_device_for,
)
from hybridllm.placement.placement import TIER_NAMES, Placement
from hybridllm.runtime.backends import AUTO, check_backend_name
from hybridllm.runtime.runner import ModelRunner, build_runner, choose_backend
from hybridllm.runtime.runtime import Runtime
from hybridllm.runtime.weight_bytes import decode_weight_bytes, weight_bytes_per_tier
from hybridllm.timing import ColdStart

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """How to build the runners.

    Attributes:
        fuse: one stacked matrix for q/k/v and one for gate/up (False: the parts stay separate
            matrices behind the same layout).
        decode_backend: "auto" or a registered backend name (``hybridllm.runtime.backends``).
        show_progress: progress bar while loading (None: on a terminal for large files).
        activations: how the native products round their inputs for the file's quantized types:
            "exact" (two int8 digits) or "int8" (one, half the integer work; ``ACTIVATION_DIGITS``).
    """

    fuse: bool = True
    decode_backend: str = AUTO
    show_progress: bool | None = None
    activations: str = "exact"


def resolve_decode_backend(decode_backend: str = AUTO, native_decode: bool = True, compile: bool = False) -> str:
    """The decode backend the facade's flags ask for: ``compile=True`` means "compiled",
    ``native_decode=False`` turns "auto" into "eager"; an unknown name is a ConfigError listing
    the registered names (checked before the slow load)."""
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
    unknown = set(kv_options) - set(KVConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown LLM options: {', '.join(sorted(unknown))}")
    if placement is not None and n_gpu_layers is not None:
        raise ConfigError("give a placement file or --n-gpu-layers, not both")
    if decode_on is not None and decode_on not in TIER_NAMES:
        raise ConfigError(f"--decode-on must be 'device' or 'host', got {decode_on!r}")
    if weights is not None:
        check_weights_mode(weights)
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
    resolved = replace(chosen, kv=kv, decode_on=decode_on or chosen.decode_on, weights=weights or chosen.weights)
    check_weights_mode(resolved.weights)
    return resolved


def build_runtime(checkpoint: Any, engine_config: EngineConfig, placement: Placement,
                  options: BuildOptions = BuildOptions(),
                  speculative: SpeculativeConfig = SpeculativeConfig()) -> Runtime:
    """Load ``checkpoint`` as ``placement`` says and build everything a request needs.

    Args:
        checkpoint: an opened checkpoint (``hybridllm.loading.registry.open_checkpoint``).
        engine_config: device, dtype, prefill chunk, threads.
        placement: per-layer tiers, KV policy, decode tier, weight format (already resolved
            against the model's layer count: :func:`resolve_placement`).
        options: fusion, decode backend, progress bar.
        speculative: speculative decoding (``--spec``; ``--model-draft`` builds the draft model here).
    Raises:
        ConfigError: among others, a draft model whose vocabulary is not the model's.
    """
    digits = activation_digits(options.activations)
    if digits != EXACT_DIGITS and placement.weights != "auto":
        raise ConfigError(f"--activations {options.activations} rounds the inputs of the file's own quantized "
                          f"types; it needs --weights auto, not {placement.weights}")
    if engine_config.threads is not None:
        torch.set_num_threads(engine_config.threads)
    cold_start = ColdStart()
    devices = TierDevices(engine_config.torch_device)
    model = load_model(checkpoint, engine_config.torch_dtype, weight_device_for(placement, devices), cold_start,
                       options.show_progress, weights=placement.weights, fuse=options.fuse,
                       host_layout=host_layout(choose_backend(options.decode_backend, placement, devices), digits))
    place_tied_head(model, placement, devices)
    runner = build_runner(model, placement, devices, options.decode_backend)
    cold_start.compile_s = runner.report.seconds
    t0 = time.perf_counter()
    tokenizer = checkpoint.tokenizer()
    release_load_scratch()  # the vocabulary's decoded lists and the tokenizer's build scratch
    cold_start.tokenizer_s = time.perf_counter() - t0

    def build_host_runner() -> tuple[ModelRunner, dict[str, int]]:
        """The host runner of phase migration: a host copy of the device weights, its own backend."""
        host_runner = build_runner(host_decode_model(model, devices), all_on_host(placement), devices,
                                   options.decode_backend)
        return host_runner, weight_bytes_per_tier(host_runner.model, host_runner.placement)

    runtime = Runtime(
        checkpoint=checkpoint, config=checkpoint.config, engine_config=engine_config, placement=placement,
        devices=devices, tokenizer=tokenizer, runner=runner, cold_start=cold_start,
        weight_bytes=weight_bytes_per_tier(model, placement), decode_weight_bytes=0,
        weights_format=weights_format(model), build_host_runner=build_host_runner, speculative=speculative,
        activations=options.activations,
    )
    check_attention_options(placement.kv.kv_cache, runtime.kv_spec())  # one line now, not at the first request
    runtime.native_kv = native_kv(runtime)
    if get_strategy(placement.kv.kv_cache).host_part:
        runtime.host_attention = host_attention(devices.device, engine_config.threads)
    if placement.decode_on == "host":
        t0 = time.perf_counter()
        runtime.migration()
        cold_start.host_copy_s = time.perf_counter() - t0
    decoding = runtime.host_runner if runtime.host_runner is not None else runner
    runtime.decode_weight_bytes = decode_weight_bytes(decoding.model, decoding.placement)
    if decoding.backend.compiles_lazily:
        t0 = time.perf_counter()
        warm_up(runtime)
        cold_start.compile_s += time.perf_counter() - t0
    if speculative.method == "draft":
        t0 = time.perf_counter()
        runtime.draft = build_draft_runtime(runtime, speculative, options)
        cold_start.draft_s = time.perf_counter() - t0
    return runtime


def build_draft_runtime(target: Runtime, speculative: SpeculativeConfig, options: BuildOptions) -> Runtime:
    """The draft model's runtime: ``--model-draft`` on the target's device and dtype, its first
    ``-ngld`` layers on the device (default: all), the target's weight mode, its own dense KV.

    Raises:
        ConfigError: the draft's vocabulary is not the target's (one line: what differs).
    """
    from hybridllm.loading.registry import open_checkpoint

    checkpoint = open_checkpoint(speculative.model_draft)
    placement = resolve_placement(checkpoint.config.n_layers, None, speculative.n_gpu_layers_draft, None,
                                  target.placement.weights, {})
    draft = build_runtime(checkpoint, target.engine_config, placement, replace(options, show_progress=False))
    check_same_vocabulary(target, draft)
    return draft


def check_same_vocabulary(target: Runtime, draft: Runtime) -> None:
    """Raise ConfigError unless the draft model's logits and tokens are the target's, id by id."""
    name = os.path.basename(str(draft.checkpoint.path))
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"the draft model {name} has {draft.config.vocab_size} logits per token, the model "
                          f"{target.config.vocab_size}; speculative decoding needs the same vocabulary")
    ours, theirs = target.tokenizer, draft.tokenizer
    for token_id in range(max(ours.vocab_size, theirs.vocab_size)):
        mine, other = ours.id_to_token(token_id), theirs.id_to_token(token_id)
        if mine != other:
            raise ConfigError(f"the draft model {name} spells token {token_id} {other!r}, the model {mine!r}; "
                              f"speculative decoding needs the same vocabulary")


def native_kv(runtime: Runtime) -> bool:
    """Whether the native steps read the runtime's KV strategy in place; says so in one warning
    where they run layers but cannot read it (its attention then runs in PyTorch)."""
    report = runtime.runner.report.build
    if runtime.runner.backend.name != "native" or not getattr(report, "kernel_layers", 0):
        return False
    strategy = get_strategy(runtime.placement.kv.kv_cache)
    probe = runtime.new_cache()
    try:
        reads = bool(strategy.native) and probe.supports_in_place_layers(range(runtime.config.n_layers))
    finally:
        probe.reset()
    if not reads and strategy.native:
        return False  # the strategy is read natively, just not in this configuration (a GPU tier, bfloat16)
    if not reads:
        logger.warning("native steps: the kernels cannot read the %s KV cache; its attention runs in PyTorch "
                       "(slower; see `hybridllm doctor`)", strategy.name)
    return reads


def host_attention(device: torch.device, threads: int | None) -> HostPartialAttention | None:
    """The kernels for the host part of split attention (a strategy's ``host_part``) where the
    compute device is not the host (a GPU: a tiered cache's cold pages are attended in place while
    the device attends its window); None on the CPU (the native steps read every store already) or where the kernels
    cannot be built (PyTorch then attends the rows it reads out)."""
    if device.type == "cpu":
        return None
    try:
        return HostPartialAttention(threads)
    except KernelBuildError:
        return None


def host_layout(backend: str, digits: int = EXACT_DIGITS) -> NativeHostLayout | None:
    """How the host's weights load: in the native kernels' formats when the native backend runs
    and its kernels build (every GGUF type they read kept as the file stores it, int4 in their
    tiles: the one copy prefill and decode read; their products' inputs rounded to ``digits``
    int8 digits per value), else PyTorch's modules (None; ``build_runner`` then says why native
    decode is off)."""
    if backend != "native":
        return None
    try:
        kernels()
    except KernelBuildError:
        return None
    return NATIVE_LAYOUT if digits == NATIVE_LAYOUT.activation_digits else NativeHostLayout(activation_digits=digits)


def warm_up(runtime: Runtime) -> None:
    """A two-token prefill and two decode steps on a scratch cache, so a lazily compiling
    backend compiles now (in the cold start), not in the first request's TTFT."""
    runner = runtime.host_runner if runtime.host_runner is not None else runtime.runner
    cache = runtime.new_host_cache() if runtime.host_runner is not None else runtime.new_cache()
    try:
        with torch.inference_mode():
            runner(torch.zeros(1, 2, dtype=torch.long), cache, start_pos=0)  # (1, 2) prefill
            for _ in range(2):
                runner(torch.zeros(1, 1, dtype=torch.long), cache, start_pos=cache.seq_length)  # (1, 1) decode
    finally:
        cache.reset()
