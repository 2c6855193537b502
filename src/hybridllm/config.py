"""Configuration dataclasses: the model's architecture numbers, the engine's knobs, sampling.

Every dataclass validates itself in ``__post_init__`` and raises ``ValueError`` with a message
a user can act on; the CLI turns those into one-line errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridllm.errors import ConfigError, UnsupportedModelError
from hybridllm.units import parse_bytes


@dataclass(frozen=True)
class ArchFamily:
    """What one architecture family has beyond the plain Llama decoder: one row per family.

    Attributes:
        label: the family's name in the supported-architectures list.
        gguf_arch: the ``general.architecture`` llama.cpp's converter writes for it.
        qk_norm: a per-head RMSNorm of q and k before rotary (Qwen3's ``q_norm``/``k_norm``).
        stacked_checkpoint: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` stacked, as
            the model does (Phi-3); otherwise q/k/v and gate/up are separate and stacked at load.
        qkv_bias: the default of ``attention_bias`` when config.json omits it (Qwen2).
        sliding_window_by_default: ``sliding_window`` applies, to every layer, without
            ``use_sliding_window`` (Mistral, Phi-3: as transformers applies it).
        gemma_layout: the Gemma decoder: embedding scaled by sqrt(hidden_size), a GeGLU MLP (gelu,
            tanh approximation), norms around attention and the MLP (post-attention,
            pre/post-feedforward), RMSNorm scaling in float32 by weights stored as 1 + w in the
            model and in GGUF (Hugging Face checkpoints store w: the loader adds 1).
        sliding_window_pattern: every ``n``-th layer (1-based) attends globally and the others
            through ``sliding_window`` when a checkpoint does not list its layer types (llama.cpp
            fixes it per family: Gemma 2 alternates, Gemma 3 has 5 local : 1 global); 0: none.
        local_rope_theta: the rotary base of the sliding-window layers when the file does not
            name one (Gemma 3: 10000); None: every layer uses ``rope_theta``.
    """

    label: str
    gguf_arch: str
    qk_norm: bool = False
    stacked_checkpoint: bool = False
    qkv_bias: bool = False
    sliding_window_by_default: bool = False
    gemma_layout: bool = False
    sliding_window_pattern: int = 0
    local_rope_theta: float | None = None


# Our architecture names (the Hugging Face ``model_type``s) -> what each family has.
ARCHITECTURES: dict[str, ArchFamily] = {
    "llama": ArchFamily("llama (Llama 2/3, SmolLM)", gguf_arch="llama"),
    "mistral": ArchFamily("mistral", gguf_arch="llama", sliding_window_by_default=True),
    "qwen2": ArchFamily("qwen2", gguf_arch="qwen2", qkv_bias=True),
    "qwen3": ArchFamily("qwen3", gguf_arch="qwen3", qk_norm=True),
    "phi3": ArchFamily("phi3 (Phi-3 4K, partial rotary)", gguf_arch="phi3", stacked_checkpoint=True,
                       sliding_window_by_default=True),
    "gemma2": ArchFamily("gemma2 (Gemma 2)", gguf_arch="gemma2", gemma_layout=True, sliding_window_pattern=2),
    "gemma3_text": ArchFamily("gemma3_text (Gemma 3 text)", gguf_arch="gemma3", qk_norm=True, gemma_layout=True,
                              sliding_window_pattern=6, local_rope_theta=10000.0),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ARCH_TEXT = ", ".join(family.label for family in ARCHITECTURES.values())
SUPPORTED_ROPE_SCALING = "llama3, linear, longrope (Phi-3 128K variants)"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn a dtype name ("float32", "bfloat16", "float16") into a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ConfigError(f"unsupported compute dtype {name}; use one of {', '.join(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling. ``kind`` is "llama3" (Llama 3.1+ frequency bands), "linear", or
    "longrope" (Phi-3 128K: per-dimension divisors of the frequencies, ``short_factor`` while a
    sequence fits ``original_max_position_embeddings`` and ``long_factor`` beyond it, chosen per
    forward as transformers does; cos and sin are scaled by ``attention_factor``)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear", "longrope"):
            raise UnsupportedModelError(f"unsupported rope scaling {self.kind!r}; supported: {SUPPORTED_ROPE_SCALING}")
        if self.factor <= 0:
            raise ConfigError("rope scaling factor must be > 0")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ConfigError(f"longrope needs short_factor and long_factor of one length, got "
                              f"{len(self.short_factor)} and {len(self.long_factor)}")

    @classmethod
    def longrope(cls, short_factor, long_factor, original_max_position_embeddings: int, max_position_embeddings: int,
                 factor: float | None = None, attention_factor: float | None = None) -> "RopeScaling":
        """Phi-3's longrope; ``factor`` defaults to the window's growth (max / original) and
        ``attention_factor`` to sqrt(1 + ln(factor) / ln(original)) (1 without growth), as in
        transformers and llama.cpp's converter."""
        factor = factor or max_position_embeddings / original_max_position_embeddings
        if attention_factor is None:
            attention_factor = (math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
                                if factor > 1 else 1.0)
        return cls(kind="longrope", factor=float(factor),
                   original_max_position_embeddings=int(original_max_position_embeddings),
                   short_factor=tuple(float(f) for f in short_factor), long_factor=tuple(float(f) for f in long_factor),
                   attention_factor=float(attention_factor))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, SmolLM);
    what the family adds to the Llama decoder is its :attr:`family` row."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    rope_scaling: RopeScaling | None = None
    # Per-dimension frequency divisors shipped in some GGUF files (llama3 "rope_freqs").
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None
    # Share of each head's dimensions that is rotated (Phi-3 / Phi-4-mini); the rest passes through.
    partial_rotary_factor: float = 1.0
    # Which layers attend through ``sliding_window`` (empty: none; Mistral and Phi-3: all of them,
    # Gemma: its pattern); Gemma: their rotary base, the attention scale
    # ``query_pre_attn_scalar ** -0.5`` and the tanh soft-capping of attention scores and logits.
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCH_TEXT}")
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads",
                     "n_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, attr) <= 0:
                raise ConfigError(f"model config: {attr} must be > 0, got {getattr(self, attr)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even, got {self.head_dim}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"model config: partial_rotary_factor {self.partial_rotary_factor} gives "
                              f"{self.rotary_dim} rotated dimensions of {self.head_dim}; they must be even and > 0")
        if self.longrope is not None and len(self.longrope.short_factor) * 2 != self.rotary_dim:
            raise ConfigError(f"model config: longrope has {len(self.longrope.short_factor)} factors for "
                              f"{self.rotary_dim // 2} rotary frequencies")
        if self.sliding_layers and (len(self.sliding_layers) != self.n_layers or not self.sliding_window):
            raise ConfigError(f"model config: {len(self.sliding_layers)} layer types for {self.n_layers} layers "
                              f"(sliding window {self.sliding_window})")
        for attr in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, attr)
            if value is not None and value <= 0:
                raise ConfigError(f"model config: {attr} must be > 0, got {value}")

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of a layer's attention (keys it sees, its own included); None: all."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer_idx] else None

    @property
    def attention_scale(self) -> float | None:
        """The factor of the attention scores when it is not ``head_dim ** -0.5`` (Gemma's
        ``query_pre_attn_scalar ** -0.5``); None: the usual one."""
        scalar = self.query_pre_attn_scalar
        return None if scalar is None or scalar == self.head_dim else scalar ** -0.5

    @property
    def family(self) -> ArchFamily:
        """What the architecture family has beyond the plain Llama decoder."""
        return ARCHITECTURES[self.arch]

    @property
    def longrope(self) -> RopeScaling | None:
        """The rope scaling when it is Phi-3's longrope (two factor sets chosen by length), else None."""
        scaling = self.rope_scaling
        return scaling if scaling is not None and scaling.kind == "longrope" else None

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions of each head (the first ones). Rounded: it reads a GGUF's
        ``rope.dimension_count`` back exactly (Hugging Face truncates; both agree on real configs)."""
        return round(self.head_dim * self.partial_rotary_factor)

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV cache bytes for one token: 2 (K and V) x layers x kv_heads x head_dim x element size."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    def parameter_count(self) -> int:
        """Number of weights (embedding counted once when tied)."""
        attn = self.hidden_size * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        if self.family.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = (4 if self.family.gemma_layout else 2) * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.n_layers * (attn + mlp + norms) + self.vocab_size * self.hidden_size + self.hidden_size + head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        arch = cfg.get("model_type", "llama")
        family = ARCHITECTURES.get(arch)
        if family is None:
            raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCH_TEXT}")
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        local_rope = rope_params.get("sliding_attention") or {}  # Gemma 3: rope per layer type
        rope_params = rope_params.get("full_attention", rope_params)
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling = None
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(
                kind="llama3",
                factor=float(rope_params["factor"]),
                low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope_params.get("original_max_position_embeddings", 8192)),
            )
        elif rope_type == "linear":
            scaling = RopeScaling(kind="linear", factor=float(rope_params["factor"]))
        elif rope_type in ("longrope", "su"):
            original = cfg.get("original_max_position_embeddings") or rope_params.get("original_max_position_embeddings")
            if not original:
                raise ConfigError("longrope rope scaling without original_max_position_embeddings")
            scaling = RopeScaling.longrope(rope_params["short_factor"], rope_params["long_factor"], int(original),
                                           int(cfg.get("max_position_embeddings", 4096)), rope_params.get("factor"),
                                           rope_params.get("attention_factor"))
        elif rope_type not in ("default", None):
            raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}; supported: {SUPPORTED_ROPE_SCALING}")
        n_layers = int(cfg["num_hidden_layers"])
        gemma = family.gemma_layout
        applies = gemma or family.sliding_window_by_default or cfg.get("use_sliding_window")
        window = cfg.get("sliding_window") if applies else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
            rope_scaling=scaling,
            sliding_window=window,
            sliding_layers=_sliding_layers(cfg, family, n_layers) if window else (),
            local_rope_theta=_local_rope_theta(cfg, family, local_rope),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            name=str(cfg.get("_name_or_path", "")),
        )


def _sliding_layers(cfg: dict[str, Any], family: ArchFamily, n_layers: int) -> tuple[bool, ...]:
    """Which layers of a ``config.json`` with a sliding window attend through it: its
    ``layer_types``, else every layer (Mistral, Phi-3), else Gemma's ``sliding_window_pattern``,
    else (Qwen2/Qwen3 with ``use_sliding_window``) the layers from ``max_window_layers`` on."""
    types = cfg.get("layer_types")
    if types:
        return tuple(kind == "sliding_attention" for kind in types)
    if family.sliding_window_by_default:
        return (True,) * n_layers
    if not family.gemma_layout:
        first = int(cfg.get("max_window_layers", 0))
        return tuple(i >= first for i in range(n_layers))
    pattern = int(cfg.get("sliding_window_pattern") or family.sliding_window_pattern)
    return tuple(bool((i + 1) % pattern) for i in range(n_layers))


def _local_rope_theta(cfg: dict[str, Any], family: ArchFamily, local_rope: dict[str, Any]) -> float | None:
    """The rotary base of a Gemma 3 config's sliding-window layers (None: the global one)."""
    if family.local_rope_theta is None:
        return None
    return float(local_rope.get("rope_theta") or cfg.get("rope_local_base_freq") or family.local_rope_theta)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate: its text must match a JSON schema.

    The request loop compiles it into a grammar (``hybridllm.engine.structured``) that masks
    every token that would break it; the sequence stops as soon as the grammar is complete.

    Args:
        json_schema: the JSON schema the output must validate against; ``{"type": "object"}``
            for any JSON object.
    """

    json_schema: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.json_schema, dict):
            raise ConfigError(f"a JSON schema must be a JSON object, got {type(self.json_schema).__name__}")


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy, and so does any temperature below :data:`GREEDY_BELOW_TEMPERATURE`
    (vLLM's rule: dividing float32 logits by it would overflow). ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0``
    disable those filters; ``repetition_penalty == 1`` disables the penalty.

    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, in [-2, 2]) lower the logit of every
    token already generated by a constant / by its count; ``logit_bias`` adds a bias in
    [-100, 100] to a token id's logit. ``n`` sequences are sampled from one prompt (seeds
    ``seed``, ``seed + 1``, ...). ``logprobs``: report each generated token's log-probability and
    the ``logprobs`` most likely alternatives (None: off); ``prompt_logprobs``: the same for every
    prompt token but the first. Log-probabilities are the float32 log-softmax of the model's
    logits, before any penalty or filter.
    ``structured`` constrains the output to a JSON schema (None: free text).
    ``speculative``: False decodes this request without speculation even when the engine
    speculates (``--spec``); speculation never changes what is generated, only how fast.
    """

    max_tokens: int = 128
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {value}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ConfigError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {value!r}")

    @property
    def penalizes_generated(self) -> bool:
        """Whether presence or frequency penalties apply (they need the generated tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when PyTorch sees a GPU, else ``cpu``; other names unchanged."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Where and how the engine runs: device, compute dtype, prefill chunking, threads, and the
    context size (``ctx_size``: caps the model's window and sizes the KV; None or 0: the model's)."""

    device: str = "cpu"
    dtype: str = "float32"
    prefill_chunk: int = 512
    threads: int | None = None
    ctx_size: int | None = None

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        parse_dtype(self.dtype)
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"invalid device {self.device!r}; use cpu or cuda[:N]") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"unsupported device {self.device!r}; use cpu or cuda[:N]")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available to PyTorch")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.ctx_size is not None and self.ctx_size < 0:
            raise ConfigError(f"--ctx-size must be >= 0 (0: the model's window), got {self.ctx_size}")

    def context_length(self, model_window: int) -> int:
        """Tokens a sequence may hold: the model's window, capped by ``ctx_size`` when set."""
        return min(model_window, self.ctx_size) if self.ctx_size else model_window

    def describe_context(self, model_window: int) -> str:
        """The context limit as messages name it: the user's cap (``--ctx-size``) when it is the
        smaller, else the model's own window ("the model's context window is 8192 tokens")."""
        length = self.context_length(model_window)
        if length < model_window:
            return f"the context size is {length} tokens (--ctx-size; the model's window is {model_window})"
        return f"the model's context window is {length} tokens"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


KV_STRATEGIES = ("dynamic", "offloaded", "quantized", "tiered", "host")
SPEC_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens for the model to verify, and how many. Field
    names equal the ``LLM`` keyword arguments (the CLI's flags in snake case).

    Attributes:
        spec: "none", "ngram" (the continuation of the longest recent match of the last n tokens
            in the prompt and the text so far, n from ``spec_ngram_max`` down to
            ``spec_ngram_min``) or "draft" (a smaller model, ``model_draft``; giving
            ``model_draft`` alone means "draft", as llama.cpp's ``-md``).
        spec_ngram_max, spec_ngram_min: the n-gram lengths matched, longest first.
        draft_max: most tokens proposed per step (llama.cpp's ``--draft-max``).
        draft_min: fewest tokens worth a verification: a shorter proposal is dropped (``--draft-min``).
        model_draft: the draft model (a GGUF file or a Hugging Face folder; the target's vocabulary).
        n_gpu_layers_draft: the draft model's layers on the device (``-ngld``; None: all, as the target's default).
        spec_max_batch: speculate only in steps where at most this many sequences decode (0: in
            every step). A step of many sequences already reads each weight once for all of them,
            so verification rows there cost compute instead of saving reads (vLLM's
            ``speculative_disable_by_batch_size``).
    """

    spec: str = "none"
    spec_ngram_max: int = 4
    spec_ngram_min: int = 2
    draft_max: int = 16
    draft_min: int = 0
    model_draft: str | None = None
    n_gpu_layers_draft: int | None = None
    spec_max_batch: int = 4

    def __post_init__(self) -> None:
        if self.spec not in SPEC_METHODS:
            raise ConfigError(f"--spec must be one of {', '.join(SPEC_METHODS)}, got {self.spec!r}")
        if self.spec == "ngram" and self.model_draft is not None:
            raise ConfigError("--spec ngram drafts without a model; drop --model-draft (or use --spec draft)")
        if self.spec == "draft" and self.model_draft is None:
            raise ConfigError("--spec draft needs --model-draft M (a smaller model with the same vocabulary)")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ConfigError(f"--spec-ngram-min ({self.spec_ngram_min}) and --spec-ngram-max "
                              f"({self.spec_ngram_max}) must satisfy 1 <= min <= max")
        if self.spec_ngram_max > 64:
            raise ConfigError(f"--spec-ngram-max must be at most 64, got {self.spec_ngram_max}")
        if not 1 <= self.draft_max <= 128:
            raise ConfigError(f"--draft-max must be in 1..128, got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise ConfigError(f"--draft-min must be in 0..--draft-max ({self.draft_max}), got {self.draft_min}")
        if self.spec_max_batch < 0:
            raise ConfigError(f"--spec-max-batch must be >= 0 (0: speculate in every step), got {self.spec_max_batch}")
        if self.n_gpu_layers_draft is not None and self.model_draft is None:
            raise ConfigError("--n-gpu-layers-draft (-ngld) places the draft model's layers; it needs --model-draft")

    @property
    def method(self) -> str:
        """What proposes the tokens: "none", "ngram" or "draft" (``model_draft`` given)."""
        return "draft" if self.model_draft is not None else self.spec

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class PrefixCacheConfig:
    """KV reuse across requests (the prefix cache): its tiers' byte budgets.

    Attributes:
        ram: bytes of reusable pages kept in host RAM (0: no prefix cache, unless a disk tier).
        disk_dir: directory of the disk tier (None: none). Its pages survive a restart.
        disk_bytes: bytes of page files on disk (None: 8 GiB).
        vram: bytes of reusable pages kept on the compute device (the hot tier; 0: none).
    """

    ram: int = 0
    disk_dir: str | None = None
    disk_bytes: int | None = None
    vram: int = 0

    @property
    def enabled(self) -> bool:
        return self.ram > 0 or self.vram > 0 or self.disk_dir is not None

    @classmethod
    def parse(cls, ram: str | int | None, disk_dir: str | None = None, disk_size: str | int | None = None,
              total_ram: int | None = None, vram: str | int | None = None) -> PrefixCacheConfig:
        """From the flags: ``ram`` a size, 0, or "auto" (min(2 GiB, 10% of ``total_ram``)).

        Raises:
            ConfigError: a size that does not parse, or a disk size without a directory.
        """
        if isinstance(ram, str) and ram.strip().lower() == "auto":
            ram_bytes = min(2 << 30, (total_ram or 0) // 10)
        else:
            ram_bytes = parse_bytes(ram) or 0
        disk_bytes = parse_bytes(disk_size)
        if disk_bytes is not None and disk_dir is None:
            raise ConfigError("--prefix-cache-disk-size needs --prefix-cache-disk DIR")
        return cls(ram=ram_bytes, disk_dir=str(disk_dir) if disk_dir is not None else None, disk_bytes=disk_bytes,
                   vram=parse_bytes(vram) or 0)


KV_KEY_QUANT = ("per-token", "per-channel")


@dataclass
class KVConfig:
    """The KV cache policy: strategy and its sizes. Field names equal the CLI flags (snake case)."""

    kv_cache: str = "dynamic"
    kv_page_size: int = 128
    kv_hot_window: int = 512
    kv_sink_tokens: int = 0
    kv_cold_bits: int = 16
    kv_bits: int = 8
    kv_group_size: int = 64
    kv_key_quant: str = "per-token"  # quantized: key scales per token (llama.cpp's layout) or per channel (KIVI)
    kv_residual: int = 0  # quantized: newest tokens kept in full precision (0: every token quantized at once)
    kv_offload_percent: float | None = None
    vram_budget: int | str | None = None
    kv_threshold: float = 0.95
    kv_adaptive: bool = True  # re-plan (shrink the hot window, decode on the host) instead of failing
    kv_dtype: str = "auto"  # dynamic: the dtype tokens are stored in; quantized: its residual's ("auto": the compute dtype)

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_STRATEGIES:
            raise ConfigError(f"unknown KV cache {self.kv_cache!r}; choose one of {', '.join(KV_STRATEGIES)}")
        self.vram_budget = parse_bytes(self.vram_budget)
        if self.kv_page_size < 1:
            raise ConfigError(f"kv_page_size must be >= 1, got {self.kv_page_size}")
        if self.kv_hot_window < 0 or self.kv_sink_tokens < 0 or self.kv_residual < 0:
            raise ConfigError("kv_hot_window, kv_sink_tokens and kv_residual must be >= 0")
        if self.kv_cold_bits not in (16, 8, 4):
            raise ConfigError(f"kv_cold_bits must be 16, 8 or 4, got {self.kv_cold_bits}")
        if self.kv_bits not in (8, 4):
            raise ConfigError(f"kv_bits must be 8 or 4, got {self.kv_bits}")
        if self.kv_group_size < 1:
            raise ConfigError(f"kv_group_size must be >= 1, got {self.kv_group_size}")
        if self.kv_key_quant not in KV_KEY_QUANT:
            raise ConfigError(f"kv_key_quant must be one of {', '.join(KV_KEY_QUANT)}, got {self.kv_key_quant!r}")
        if self.kv_offload_percent is not None and not 0 <= self.kv_offload_percent <= 100:
            raise ConfigError(f"kv_offload_percent must be in [0, 100], got {self.kv_offload_percent}")
        if not 0 < self.kv_threshold <= 1:
            raise ConfigError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if self.kv_dtype not in ("auto", "float32", "float16"):
            raise ConfigError(f"kv_dtype must be auto, float32 or float16, got {self.kv_dtype!r}")
        if self.kv_dtype != "auto" and self.kv_cache not in ("dynamic", "quantized"):
            raise ConfigError(f"--kv-dtype {self.kv_dtype} applies to the dynamic and quantized KV caches only, "
                              f"not {self.kv_cache}")
