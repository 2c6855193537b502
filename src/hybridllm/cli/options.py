"""The options that several commands share, each declared once, in groups.

A group is a frozen dataclass whose fields carry their typer declaration (``Annotated``), so a
flag's name, alias, default and help live in one place. A command asks for a group by annotating
one parameter with the group's class (``kv: KVOptions``); :func:`with_option_groups` puts the
group's flags into the command's signature, where typer reads them, and hands the command one
instance per group. :func:`llm_kwargs` turns the groups into ``LLM`` keyword arguments.

Every command that loads a model for inference (generate, chat, serve, bench) takes the five
inference groups (model, placement, KV, speed, speculative decoding). Commands that need only a few of these flags (eval, plan) use the single aliases.

Heavy modules (torch, the engine) are imported inside functions: ``hybridllm --help`` stays quick.
"""

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

# ---- single flags -----------------------------------------------------------------------------
MODEL_PANEL, PLACEMENT_PANEL, KV_PANEL, SPEED_PANEL = "Model", "Placement", "KV cache", "Speed"  # --help sections
PREFIX_PANEL, SPEC_PANEL = "Prefix cache", "Speculative decoding"
WEIGHTS_HELP = "Weights in memory: float, auto (keep the file's 4/8-bit quantization where a kernel exists), int8 or int4"

Model = Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct).", rich_help_panel=MODEL_PANEL)]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or auto (cuda when PyTorch sees a GPU, else cpu).", rich_help_panel=MODEL_PANEL)]
Dtype = Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.", rich_help_panel=MODEL_PANEL)]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: PyTorch's).", rich_help_panel=MODEL_PANEL)]
CtxSize = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens (prompt + generated; sizes the KV), like llama.cpp's -c; 0: the model's window.", rich_help_panel=MODEL_PANEL)]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill forward, and per scheduler step of serve (llama.cpp's n_batch).", rich_help_panel=MODEL_PANEL)]
Weights = Annotated[str, typer.Option("--weights", help=f"{WEIGHTS_HELP}.", rich_help_panel=PLACEMENT_PANEL)]
PlacedWeights = Annotated[Optional[str], typer.Option("--weights", help=f"{WEIGHTS_HELP} (default: the placement file's, else auto).", rich_help_panel=PLACEMENT_PANEL)]
NGpuLayers = Annotated[Optional[int], typer.Option("--n-gpu-layers", "-ngl", help="Layers on the device (the first N; the rest on the host), like llama.cpp.", rich_help_panel=PLACEMENT_PANEL)]
DecodeOn = Annotated[Optional[str], typer.Option("--decode-on", help="device, or host: prefill on the device, then move the KV to the host and decode there.", rich_help_panel=PLACEMENT_PANEL)]
PlacementFile = Annotated[Optional[Path], typer.Option("--placement", help="Placement JSON file (per-layer tiers, KV policy, decode tier; `hybridllm plan --json` writes one).", rich_help_panel=PLACEMENT_PANEL)]
KVCache = Annotated[str, typer.Option("--kv-cache", help="KV strategy: dynamic, offloaded, quantized, tiered or host.", rich_help_panel=KV_PANEL)]
KVPageSize = Annotated[int, typer.Option("--kv-page-size", help="Tokens per KV page.", rich_help_panel=KV_PANEL)]
KVHotWindow = Annotated[int, typer.Option("--kv-hot-window", help="tiered: newest tokens kept on the device.", rich_help_panel=KV_PANEL)]
KVSinkTokens = Annotated[int, typer.Option("--kv-sink-tokens", help="tiered: first tokens kept on the device (attention sinks).", rich_help_panel=KV_PANEL)]
KVDtype = Annotated[str, typer.Option("--kv-dtype", help="dynamic: dtype the KV is stored in; quantized: dtype of its full-precision residual: auto (the compute dtype), float32, or float16 (half the bytes; native decode reads it directly, float32 accumulate).", rich_help_panel=KV_PANEL)]
KVColdBits = Annotated[int, typer.Option("--kv-cold-bits", help="tiered: bits of cold pages in host RAM: 16, 8 or 4.", rich_help_panel=KV_PANEL)]
KVBits = Annotated[int, typer.Option("--kv-bits", help="quantized: 8 or 4.", rich_help_panel=KV_PANEL)]
KVResidual = Annotated[int, typer.Option("--kv-residual", help="quantized: newest tokens kept in full precision (--kv-dtype).", rich_help_panel=KV_PANEL)]
KVGroupSize = Annotated[int, typer.Option("--kv-group-size", help="quantized, and tiered cold pages: tokens per key scale, channels per value scale (64: 8.5 / 4.5 bits per value at 8 / 4 bits).", rich_help_panel=KV_PANEL)]
KVKeyQuant = Annotated[str, typer.Option("--kv-key-quant", help="quantized: key scales per-token (llama.cpp's layout: nothing waits in full precision) or per-channel (KIVI: groups of --kv-group-size tokens).", rich_help_panel=KV_PANEL)]
KVOffloadPercent = Annotated[Optional[float], typer.Option("--kv-offload-percent", help="tiered: percent of cached tokens kept on the host instead of a window.", rich_help_panel=KV_PANEL)]
VramBudget = Annotated[Optional[str], typer.Option("--vram-budget", help="Device memory budget, e.g. 8GiB (weights + KV).", rich_help_panel=KV_PANEL)]
KVAdaptive = Annotated[bool, typer.Option("--kv-adaptive/--no-kv-adaptive", help="When device KV fills up mid-request, shrink the hot window or move decoding to the host instead of failing.", rich_help_panel=KV_PANEL)]
KVThreshold = Annotated[float, typer.Option("--kv-threshold", help="Share (0-1] of a KV memory budget at which the cache evicts, spills or re-plans.", rich_help_panel=KV_PANEL)]
Fuse = Annotated[bool, typer.Option("--fuse/--no-fuse", help="Stack q/k/v and gate/up into one projection each (fewer operator calls per token).", rich_help_panel=SPEED_PANEL)]
NativeDecode = Annotated[bool, typer.Option("--native-decode/--no-native-decode", help="Decode host layers with the native C++ kernels (one call per token; built once with the host's C++ compiler).", rich_help_panel=SPEED_PANEL)]
Compile = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile the decode step's dense parts (compile time counts in the cold start).", rich_help_panel=SPEED_PANEL)]
Activations = Annotated[str, typer.Option("--activations", help="How the native products round their inputs for the file's quantized types: exact (two int8 digits, logits within ~1e-6 of float32's) or int8 (one digit as llama.cpp rounds them, half the integer work: faster prefill at about llama.cpp's fidelity; needs --weights auto).", rich_help_panel=SPEED_PANEL)]
DecodeBackend = Annotated[str, typer.Option("--decode-backend", help="Decode step backend: auto (chosen from --native-decode and --compile), eager, compiled, native or cuda-graph (static KV, a CUDA graph per batch bucket; all on the device, dense KV).", rich_help_panel=SPEED_PANEL)]
PrefixCacheRam = Annotated[str, typer.Option("--prefix-cache-ram", help="Host RAM for KV pages reused across requests (a prompt that repeats an earlier prefix prefills only the rest): a size such as 1GiB, auto (min(2 GiB, 10% of RAM)) or 0 (off).", rich_help_panel=PREFIX_PANEL)]
PrefixCacheDisk = Annotated[Optional[Path], typer.Option("--prefix-cache-disk", help="Directory for the prefix cache's disk tier: pages pushed out of RAM are kept there and survive a restart (off by default).", rich_help_panel=PREFIX_PANEL)]
PrefixCacheVram = Annotated[Optional[str], typer.Option("--prefix-cache-vram", help="Device memory for the hottest reusable KV pages (they move to RAM when pushed out), e.g. 1GiB (default: none).", rich_help_panel=PREFIX_PANEL)]
Spec = Annotated[str, typer.Option("--spec", help="Speculative decoding: none, ngram (propose the continuation of the last matching n-gram of the prompt and the text so far; pays where the answer repeats its input: editing code, rewriting, quoting) or draft (--model-draft proposes). The text is the same; only the speed changes.", rich_help_panel=SPEC_PANEL)]
SpecNgramMax = Annotated[int, typer.Option("--spec-ngram-max", help="--spec ngram: the longest n-gram matched (tried first).", rich_help_panel=SPEC_PANEL)]
SpecNgramMin = Annotated[int, typer.Option("--spec-ngram-min", help="--spec ngram: the shortest n-gram matched (shorter matches propose nothing).", rich_help_panel=SPEC_PANEL)]
DraftMax = Annotated[int, typer.Option("--draft-max", "--draft", "--draft-n", help="Most tokens proposed per step (each sequence adapts its proposals to how many get accepted, up to this).", rich_help_panel=SPEC_PANEL)]
DraftMin = Annotated[int, typer.Option("--draft-min", "--draft-n-min", help="Fewest tokens worth a verification: shorter proposals are dropped.", rich_help_panel=SPEC_PANEL)]
ModelDraft = Annotated[Optional[Path], typer.Option("--model-draft", "-md", help="A draft model (GGUF file or Hugging Face folder) with the model's vocabulary: it proposes, the model verifies (turns on --spec draft).", rich_help_panel=SPEC_PANEL)]
NGpuLayersDraft = Annotated[Optional[int], typer.Option("--n-gpu-layers-draft", "--gpu-layers-draft", "-ngld", help="The draft model's layers on the device (default: all), like llama.cpp's -ngld.", rich_help_panel=SPEC_PANEL)]
SpecMaxBatch = Annotated[int, typer.Option("--spec-max-batch", help="Speculate only in steps where at most this many sequences decode (0: always): a large batch already reads each weight once for all its sequences.", rich_help_panel=SPEC_PANEL)]
PrefixCacheDiskSize = Annotated[Optional[str], typer.Option("--prefix-cache-disk-size", help="Bytes of page files allowed in --prefix-cache-disk, e.g. 20GiB (default 8GiB).", rich_help_panel=PREFIX_PANEL)]


# ---- groups -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which model, and where and how it computes."""

    path: Model = None
    device: Device = "auto"
    dtype: Dtype = "float32"
    threads: Threads = None
    prefill_chunk: PrefillChunk = 512
    ctx_size: CtxSize = 0


@dataclasses.dataclass(frozen=True)
class PlacementOptions:
    """Where weights live and where decoding runs (the ``Placement``)."""

    n_gpu_layers: NGpuLayers = None
    decode_on: DecodeOn = None
    file: PlacementFile = None
    weights: PlacedWeights = None


@dataclasses.dataclass(frozen=True)
class KVOptions:
    """The KV cache policy. Field names and defaults equal ``hybridllm.config.KVConfig``'s."""

    kv_cache: KVCache = "dynamic"
    kv_page_size: KVPageSize = 128
    kv_hot_window: KVHotWindow = 512
    kv_sink_tokens: KVSinkTokens = 0
    kv_cold_bits: KVColdBits = 16
    kv_bits: KVBits = 8
    kv_residual: KVResidual = 0
    kv_group_size: KVGroupSize = 64
    kv_key_quant: KVKeyQuant = "per-token"
    kv_offload_percent: KVOffloadPercent = None
    vram_budget: VramBudget = None
    kv_adaptive: KVAdaptive = True
    kv_threshold: KVThreshold = 0.95
    kv_dtype: KVDtype = "auto"


@dataclasses.dataclass(frozen=True)
class SpeedOptions:
    """How decode steps run. Field names equal ``LLM``'s keyword arguments."""

    fuse: Fuse = True
    native_decode: NativeDecode = True
    compile: Compile = False
    decode_backend: DecodeBackend = "auto"
    activations: Activations = "exact"


@dataclasses.dataclass(frozen=True)
class PrefixCacheOptions:
    """KV reuse across requests. Field names equal ``LLM``'s keyword arguments; ``serve`` and
    ``chat`` default to ``auto``, one-shot commands to off."""

    prefix_cache_ram: PrefixCacheRam = "0"
    prefix_cache_disk: PrefixCacheDisk = None
    prefix_cache_disk_size: PrefixCacheDiskSize = None
    prefix_cache_vram: PrefixCacheVram = None


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding. Field names and defaults equal ``hybridllm.config.SpeculativeConfig``'s
    (and ``LLM``'s keyword arguments)."""

    spec: Spec = "none"
    spec_ngram_max: SpecNgramMax = 4
    spec_ngram_min: SpecNgramMin = 2
    draft_max: DraftMax = 16
    draft_min: DraftMin = 0
    model_draft: ModelDraft = None
    n_gpu_layers_draft: NGpuLayersDraft = None
    spec_max_batch: SpecMaxBatch = 4


# every inference command: generate, chat, serve, bench
INFERENCE_GROUPS: tuple[type, ...] = (ModelOptions, PlacementOptions, KVOptions, SpeedOptions, SpeculativeOptions)
OPTION_GROUPS: tuple[type, ...] = (*INFERENCE_GROUPS, PrefixCacheOptions)  # the prefix cache: generate, chat, serve


def changed(group: Any) -> dict[str, Any]:
    """The fields of a group instance that differ from the group's defaults."""
    default = type(group)()
    return {f.name: getattr(group, f.name) for f in dataclasses.fields(group)
            if getattr(group, f.name) != getattr(default, f.name)}


def group_parameters(group: type, defaults: Any = None, skip: Iterable[str] = ()) -> list[inspect.Parameter]:
    """The group's flags as keyword-only parameters (what typer reads), with the defaults of ``defaults``."""
    defaults = group() if defaults is None else defaults
    hints = typing.get_type_hints(group, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f.name),
                              annotation=hints[f.name])
            for f in dataclasses.fields(group) if f.name not in skip]


def with_option_groups(func: Callable[..., Any] | None = None, *, own: Iterable[str] = ()) -> Any:
    """Expand a command's option-group parameters into flags, and rebuild the groups on each call.

    A parameter annotated with a group class (``kv: KVOptions``) becomes that group's flags, with
    the defaults of the parameter's default instance if it has one (bench: ``ModelOptions(device="auto")``).
    The command is called with one group instance in that parameter.

    Args:
        func: the command.
        own: group fields the command declares itself, with a parameter of the same name (bench's
            comma-separated ``--kv-cache``); in the group instance they keep the group's default.

    Raises:
        TypeError: two flags of the same parameter name, or an ``own`` name that the command does
            not declare or no group has.
    """
    if func is None:
        return functools.partial(with_option_groups, own=own)
    own = frozenset(own)
    hints = typing.get_type_hints(func, include_extras=True)
    groups: dict[str, type] = {}
    parameters: list[inspect.Parameter] = []
    for param in inspect.signature(func).parameters.values():
        annotation = hints.get(param.name, param.annotation)
        if annotation in OPTION_GROUPS:
            groups[param.name] = annotation
            defaults = None if param.default is inspect.Parameter.empty else param.default
            parameters += group_parameters(annotation, defaults, skip=own)
        else:
            parameters.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=annotation))
    names = [p.name for p in parameters]
    if len(names) != len(set(names)):
        raise TypeError(f"{func.__name__}: a flag is declared twice: {sorted(n for n in names if names.count(n) > 1)}")
    group_fields = {f.name for group in groups.values() for f in dataclasses.fields(group)}
    if not own <= group_fields & set(names):
        raise TypeError(f"{func.__name__}: own={sorted(own)} must name group fields that the command declares")

    @functools.wraps(func)
    def command(**kwargs: Any) -> Any:
        for name, group in groups.items():
            kwargs[name] = group(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(group) if f.name not in own})
        return func(**kwargs)

    # typer reads the flags from the signature and the annotations (the standard protocol of ``inspect``)
    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


# ---- the LLM they describe --------------------------------------------------------------------
def llm_kwargs(model: ModelOptions, placement: PlacementOptions, kv: KVOptions, speed: SpeedOptions,
               prefix: PrefixCacheOptions | None = None, spec: SpeculativeOptions | None = None) -> dict[str, Any]:
    """``LLM`` keyword arguments of the groups, checked before the slow load.

    With a placement file, only the KV flags that differ from their defaults are passed, so they
    override the file's KV policy instead of resetting it.

    Raises:
        ConfigError: a bad value (unknown KV strategy, dtype, device, weights mode ...).
    """
    from hybridllm.config import EngineConfig, KVConfig, PrefixCacheConfig, SpeculativeConfig, resolve_device
    from hybridllm.kernels.native_linear import activation_digits
    from hybridllm.models.quantized import check_weights_mode

    kv_options = dataclasses.asdict(kv)
    KVConfig(**kv_options)
    device = resolve_device(model.device)
    EngineConfig(device=device, dtype=model.dtype, threads=model.threads, prefill_chunk=model.prefill_chunk,
                 ctx_size=model.ctx_size)
    if placement.weights is not None:
        check_weights_mode(placement.weights)
    activation_digits(speed.activations)
    if placement.file is not None:
        kv_options = changed(kv)
    options = {
        "model": model.path, "device": device, "dtype": model.dtype, "threads": model.threads,
        "prefill_chunk": model.prefill_chunk, "ctx_size": model.ctx_size or None, "weights": placement.weights, "n_gpu_layers": placement.n_gpu_layers,
        "decode_on": placement.decode_on, "placement": placement.file, **kv_options,
        "fuse": speed.fuse, "native_decode": speed.native_decode, "compile": speed.compile,
        "decode_backend": speed.decode_backend, "activations": speed.activations,
    }
    if prefix is not None:
        PrefixCacheConfig.parse(prefix.prefix_cache_ram, prefix.prefix_cache_disk, prefix.prefix_cache_disk_size,
                                vram=prefix.prefix_cache_vram)
        options.update(dataclasses.asdict(prefix))
    if spec is not None:
        spec_options = dataclasses.asdict(spec)
        if spec.model_draft is not None:
            spec_options["model_draft"] = str(spec.model_draft)
        SpeculativeConfig(**spec_options)
        options.update(spec_options)
    return options


def load_llm(model: ModelOptions, placement: PlacementOptions, kv: KVOptions, speed: SpeedOptions,
             prefix: PrefixCacheOptions | None = None, spec: SpeculativeOptions | None = None) -> Any:
    """The ``LLM`` the groups describe (validated first: bad flags fail before the slow load)."""
    options = llm_kwargs(model, placement, kv, speed, prefix, spec)
    from hybridllm.llm import LLM

    return LLM(**options)
