"""Native decode steps on the host: each host layer's one-token step in one C++ call.

    steps = build_native_steps(model)   # nothing is attached to the model
    steps.report.layers                 # how many layers got a native step

A decode step of a Llama layer in eager PyTorch is ~190 operator calls (norms, projections,
rotary, cache writes, attention, MLP), and at small models the per-call cost (Python, dispatch,
thread wake-ups) is most of the step. :func:`build_native_steps` gives every decoder layer
whose weights live on the CPU a :class:`NativeDecodeLayer`: the layer's weights described once
as raw pointers for ``hl_decode_layer`` (``decode.cpp``), which runs the whole layer (norm,
q/k/v, rotary, writing k/v into the cache, grouped-query attention, output projection, MLP) for
one token of each of B sequences, its loops split over the kernels' own team of threads (how
many, and how they wait: :class:`DecodeTeam`, :mod:`hybridllm.kernels.threads`). The tied or separate
output head gets a :class:`NativeHead` (``hl_linear``). When every layer and the head are
native, :class:`NativeModel` runs the whole token (``hl_decode_model``) in one call and one
parallel region; otherwise (a GPU/host split) each native layer steps on its own.

Batches: each row of a decode batch (the scheduler's
:class:`~hybridllm.kvcache.batch.BatchedCaches`) keeps its own cache and position; the kernels
read each weight matrix once for all rows (decode is bound by reading the weights), while each
row's arithmetic, summation order included, is the same as alone, at any position in any batch
and on any number of threads (batch-invariant: temperature 0 gives the same text alone or under
load). Prefill chunks (:meth:`NativeModel.prefill_chunks`) run the
same layer code and the same products, so a prompt's rows get the bits a decode step would give
them however the prompt is chunked or cached.

The native decode backend (``hybridllm.runtime.backends.native``) takes a step only when it
applies, otherwise the layer runs its PyTorch code: float32 activations, and for every row a
cache whose layers the kernels read in place (:meth:`hybridllm.kvcache.base.KVCache.in_place_rows`:
every registered strategy's host storage; :func:`claim_rows` writes the runs into the
``HLLayerCache`` table). GPU layers keep the PyTorch path; a layer the kernels cannot describe
is listed in ``report.skipped`` (none of the families in ``config.ARCHITECTURES``). The backend
routes a step's rows: one-token rows to :meth:`NativeModel.decode`, longer ones as segments of
:meth:`NativeModel.prefill_chunks`.

Weights the kernels read, all in place (one copy of every weight, whatever path reads it):
float32 ``nn.Linear`` weights as they are; every GGUF type of common files and the engine's
int4/int8 as :class:`~hybridllm.kernels.native_linear.NativeQuantLinear` tiles of 16 rows with the
file's own scales (:mod:`hybridllm.kernels.native_linear`; the loader builds them straight from
the file when the native backend runs).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from hybridllm.kernels.abi import (
    ACT_GELU_TANH,
    ACT_SILU,
    EXACT_DIGITS,
    FLOAT_FORMATS,
    FORMAT_F32,
    FORMAT_Q4,
    GROUP,
    KV_DTYPES,
    MAX_GROUP,
    MAX_HEAD_DIM,
    Q4_ROWS,
    HLDecoderLayer,
    HLLayerCache,
    HLLinear,
    HLProjection,
    _declare,
    amx_tiles,
    kernel_isa,
    kernels,
    pack_int4_blocks,
    unpack_int4_blocks,
)
from hybridllm.kernels.build import KernelBuildError, LoadedLibrary, load_decode_library
from hybridllm.kernels.native_linear import NativeInt4Linear, NativeQuantLinear, hold_natively, native_module
from hybridllm.kernels.threads import FixedTeam, ThreadPolicy
from hybridllm.kvcache.base import RUN_FIELDS, KVCache
from hybridllm.kvcache.batch import BatchedCaches
from hybridllm.models.fuse import ConcatLinear
from hybridllm.models.layers import GeGLU, RMSNorm, SwiGLU
from hybridllm.models.llama import GemmaDecoderLayer
from hybridllm.models.quantized import Int4Linear

logger = logging.getLogger(__name__)

def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, total: int, threads: int | None = None,
              library: ctypes.CDLL | None = None) -> torch.Tensor:
    """One token's queries q (H, D) over the first ``total`` rows of keys/values (Hkv, capacity, D)
    -> (H, D) float32: ``hl_attention``, the kernel inside every native layer step. Keys and
    values in float16 are read as they are (float32 accumulation), anything else as float32."""
    library = _declare(library) if library is not None else kernels()
    kv_dtype = keys.dtype if keys.dtype in KV_DTYPES else torch.float32
    q, keys, values = q.float().contiguous(), keys.to(kv_dtype).contiguous(), values.to(kv_dtype).contiguous()
    (n_heads, head_dim), (n_kv_heads, capacity, _) = q.shape, keys.shape
    out = torch.empty_like(q)
    library.hl_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), KV_DTYPES[kv_dtype], capacity, total,
                         n_heads, n_kv_heads, head_dim, out.data_ptr(), threads or torch.get_num_threads())
    return out


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int = 0,
                      threads: int | None = None, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """A prefill chunk's queries q (T, H, D) at positions ``start .. start + T - 1`` over keys/values
    (Hkv, capacity, D) whose first ``start + T`` rows are written -> (T, H, D) float32: the causal,
    query-tiled kernel inside every native prefill step (``window``: a sliding window, 0: none)."""
    library = _declare(library) if library is not None else kernels()
    kv_dtype = keys.dtype if keys.dtype in KV_DTYPES else torch.float32
    q, keys, values = q.float().contiguous(), keys.to(kv_dtype).contiguous(), values.to(kv_dtype).contiguous()
    (rows, n_heads, head_dim), (n_kv_heads, capacity, _) = q.shape, keys.shape
    out = torch.empty_like(q)
    library.hl_prefill_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), KV_DTYPES[kv_dtype], capacity, start,
                                 rows, n_heads, n_kv_heads, head_dim, window, out.data_ptr(),
                                 threads or torch.get_num_threads())
    return out


@dataclass
class LinearView:
    """One projection as the kernels see it; ``keep`` holds the tensors the pointers point into."""

    struct: HLLinear
    keep: list[torch.Tensor] = field(default_factory=list)


def float32_view(weight: torch.Tensor) -> LinearView:
    """A float32 (N, K) weight on the CPU, read in place (no bias)."""
    weight = weight.detach().contiguous()
    n, k = weight.shape
    return LinearView(HLLinear(FORMAT_F32, 0, n, k, weight.data_ptr(), 0, 0, EXACT_DIGITS), [weight])


_TORCH_FLOAT_FORMATS = {dtype: code for code, dtype in FLOAT_FORMATS.items()}


def linear_view(module: nn.Module) -> LinearView:
    """Describe one weight matrix for the kernels (raises ValueError if no kernel reads it in place)."""
    stored = getattr(module, "weight", None)
    if stored is not None and stored.device.type != "cpu":
        raise ValueError("weights are not on the CPU")
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float().contiguous()
    keep = [] if bias is None else [bias]
    if isinstance(module, (NativeQuantLinear, NativeInt4Linear)):  # their tiles, read in place
        return LinearView(module.struct(bias), keep)
    native_copy = native_module(module)  # PyTorch's int4/int8 layouts: the kernels' tiles of the same weights
    if native_copy is not None:  # (build_native_steps holds a model's layers natively first: no copy there)
        return LinearView(native_copy.struct(bias), [*native_copy.buffers(), *keep])
    if isinstance(module, nn.Linear) and module.weight.dtype in _TORCH_FLOAT_FORMATS:
        weight = module.weight.detach().contiguous()
        struct = HLLinear(_TORCH_FLOAT_FORMATS[weight.dtype], int(bias is not None), module.out_features,
                          module.in_features, weight.data_ptr(), 0, 0 if bias is None else bias.data_ptr(),
                          EXACT_DIGITS)
        return LinearView(struct, [weight, *keep])
    raise ValueError(f"no native kernel for {type(module).__name__} ({getattr(module, 'weight', None)!r:.40})")


@dataclass
class ProjectionView:
    """A projection of up to three matrices side by side (q, k, v; gate, up) as the kernels see it."""

    struct: HLProjection
    keep: list[torch.Tensor] = field(default_factory=list)


def projection_view(module: nn.Module) -> ProjectionView:
    """A stacked matrix, or a ``ConcatLinear`` of up to three parts of any formats (a Q6_K v beside
    Q4_K q and k), for the kernels."""
    parts = list(module.parts) if isinstance(module, ConcatLinear) else [module]
    if len(parts) > 3:
        raise ValueError(f"a projection of {len(parts)} parts (the kernels take up to 3)")
    views = [linear_view(part) for part in parts]
    struct = HLProjection()
    for i, view in enumerate(views):
        struct.parts[i] = view.struct
    struct.n_parts = len(views)
    return ProjectionView(struct, [t for view in views for t in view.keep])


def linear(view: LinearView, x: torch.Tensor, threads: int | None = None,
           library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` (..., K) float32 through the kernels' product (``hl_linear``: each weight tile read
    once for all rows; every row the same bits alone or in any batch) -> (..., N) float32."""
    rows = x.reshape(-1, view.struct.in_features).float().contiguous()  # (M, K)
    out = torch.empty(rows.shape[0], view.struct.out_features, dtype=torch.float32)  # (M, N)
    library = _declare(library) if library is not None else kernels()
    library.hl_linear(ctypes.byref(view.struct), rows.data_ptr(), out.data_ptr(), rows.shape[0],
                      threads or torch.get_num_threads())
    return out.reshape(*x.shape[:-1], view.struct.out_features)


def reference_linear(view: LinearView, x: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """The same product through the portable reference kernel (one thread): what every vector and
    tile kernel must equal bit for bit."""
    rows = x.reshape(-1, view.struct.in_features).float().contiguous()  # (M, K)
    out = torch.empty(rows.shape[0], view.struct.out_features, dtype=torch.float32)  # (M, N)
    library = _declare(library) if library is not None else kernels()
    library.hl_reference_linear(ctypes.byref(view.struct), rows.data_ptr(), out.data_ptr(), rows.shape[0])
    return out.reshape(*x.shape[:-1], view.struct.out_features)


# ---- threads -------------------------------------------------------------------------------
class DecodeTeam:
    """The thread count of each native call and the kernels' wait policy, from a
    :class:`~hybridllm.kernels.threads.ThreadPolicy` (at most PyTorch's thread count; fewer when
    other work keeps cores busy). Shared by the steps of one model."""

    def __init__(self, library: ctypes.CDLL, policy: ThreadPolicy | FixedTeam | None = None) -> None:
        self.library = library
        self.policy = policy if policy is not None else ThreadPolicy()

    def threads(self) -> int:
        """Threads for the next call (sets the library's spin-then-sleep wait to match; the
        library's team is shared by every model in the process)."""
        choice = self.policy.team(torch.get_num_threads())
        if self.library.hl_spin_wait() != choice.spins:
            self.library.hl_set_spin_wait(choice.spins)
        return choice.threads


# ---- the rows of a decode batch ------------------------------------------------------------
def row_caches(cache: KVCache | BatchedCaches) -> list[KVCache]:
    """The cache of each row of a decode step: a batch's own caches, or the one cache of a batch of one."""
    return list(cache.caches) if isinstance(cache, BatchedCaches) else [cache]


def rows_in_place(caches: list[KVCache], layer_indices: list[int], rows: int) -> bool:
    """Whether each of ``rows`` rows has its own cache with in-place slots for every layer given."""
    return len(caches) == rows and all(c.supports_in_place_layers(layer_indices) for c in caches)


def _numpy_struct(struct: type[ctypes.Structure]) -> np.dtype:
    """A ctypes structure's fields as a numpy structured dtype (the same offsets and size)."""
    kinds = {ctypes.c_int32: "<i4", ctypes.c_int64: "<i8", ctypes.c_void_p: "<u8"}
    names, formats, offsets = [], [], []
    for name, kind in struct._fields_:
        names.append(name)
        offsets.append(getattr(struct, name).offset)
        if isinstance(kind, type) and issubclass(kind, ctypes.Array):
            formats.append((_numpy_struct(kind._type_), (kind._length_,)))
        else:
            formats.append(kinds[kind])
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ctypes.sizeof(struct)})


# HLLayerCache as numpy sees an array of them (filled a column at a time).
_CACHE_FIELDS = _numpy_struct(HLLayerCache)


def claim_rows(caches: list[KVCache], layer_indices: list[int], lengths: list[int]) -> ctypes.Array:
    """Claim ``lengths[i]`` rows of every layer given in ``caches[i]`` (this step's tokens of each
    sequence), described as an (n_layers, len(caches)) layer-major array of HLLayerCache."""
    n_layers = len(layer_indices)
    claims = [cache.in_place_rows(layer_indices, n) for cache, n in zip(caches, lengths)]
    slots = (HLLayerCache * (n_layers * len(caches)))()  # zeroed: runs past a claim's own stay empty
    view = np.frombuffer(slots, dtype=_CACHE_FIELDS).reshape(n_layers, len(caches))  # (layers, caches)
    for c, claim in enumerate(claims):
        column = view[:, c]  # (layers,): a view; each value is one for every layer or one per layer
        segments = column["segments"]  # (layers, segments)
        for j, run in enumerate(claim.runs):
            segment = segments[:, j]
            for name in RUN_FIELDS:
                segment[name] = run.get(name, 0)
        column["n_segments"] = len(claim.runs)
        column["write"] = claim.write
        column["start"] = claim.start
        column["write_row"] = claim.write_row
        column["window"] = claim.window
        column["settle"] = claim.settle
        column["settle_row"] = claim.settle_row
    return slots


def claim_slots(caches: list[KVCache], layer_idx: int, out: ctypes.Array, n_new: int = 1) -> None:
    """Claim ``n_new`` rows of one layer in each cache (this step's tokens), each cache's
    description copied into ``out`` (its first entries: one per cache)."""
    described = claim_rows(caches, [layer_idx], [n_new] * len(caches))
    ctypes.memmove(out, described, ctypes.sizeof(HLLayerCache) * len(caches))


def rotary_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """A cos or sin table (B or 1, 1, 1, D) of one decode step as (rows, D), contiguous."""
    return table.reshape(-1, table.shape[-1]).expand(rows, -1).contiguous()  # (rows, D)


# ---- one decoder layer ---------------------------------------------------------------------
def _norm_weight(norm: nn.Module) -> int:
    """The address of a float32 CPU norm's weight (0 for ``nn.Identity``: no norm there)."""
    if isinstance(norm, nn.Identity):
        return 0
    if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu":
        raise ValueError("norms are not float32 RMSNorms on the CPU")
    return norm.weight.data_ptr()


class NativeDecodeLayer:
    """A decoder layer's step in one kernel call, reading the layer's weights in place: any family
    of ``config.ARCHITECTURES`` (q/k norms, partial rotary and the layer's own rotary table, score
    scale and soft-cap, QKV bias, SwiGLU or GeGLU, the Gemma block's norms)."""

    def __init__(self, layer: nn.Module, config, n_rope_tables: int, library: ctypes.CDLL,
                 team: DecodeTeam | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.head_dim > MAX_HEAD_DIM or attn.n_heads % attn.n_kv_heads:
            raise ValueError(f"head_dim {attn.head_dim} / heads {attn.n_heads}:{attn.n_kv_heads} unsupported")
        group = attn.n_heads // attn.n_kv_heads
        if not (group <= 8 or (group <= MAX_GROUP and group % 2 == 0)):
            raise ValueError(f"{group} query heads per KV head (the kernels take up to 8, or an even count up to "
                             f"{MAX_GROUP})")
        if type(mlp) not in (SwiGLU, GeGLU):
            raise ValueError(f"no native kernel for the MLP {type(mlp).__name__}")
        gemma = isinstance(layer, GemmaDecoderLayer)
        mlp_norm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        norms = [_norm_weight(n) for n in (layer.input_layernorm, mlp_norm)]
        post = [_norm_weight(n) for n in (layer.post_attention_layernorm, layer.post_feedforward_layernorm)] if gemma \
            else [0, 0]
        qk_norms = [_norm_weight(attn.q_norm), _norm_weight(attn.k_norm)]
        self.views = [projection_view(attn.qkv_proj), linear_view(attn.o_proj), projection_view(mlp.gate_up_proj),
                      linear_view(mlp.down_proj)]
        self.library = library
        self.team = team if team is not None else DecodeTeam(library)
        self.layer_idx = attn.layer_idx
        scale = config.attention_scale
        self.struct = HLDecoderLayer(
            self.views[0].struct, self.views[1].struct, self.views[2].struct, self.views[3].struct,
            norms[0], norms[1], post[0], post[1], qk_norms[0], qk_norms[1], layer.input_layernorm.eps,
            attn.head_dim ** -0.5 if scale is None else scale, config.attn_logit_softcapping or 0.0,
            ACT_GELU_TANH if type(mlp) is GeGLU else ACT_SILU, attn.n_heads, attn.n_kv_heads, attn.head_dim,
            attn.rotary_dim, attn.rope_table, n_rope_tables, layer.input_layernorm.weight.numel(),
            mlp.down_proj.in_features)
        self._keep = [t for view in self.views for t in view.keep]

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: KVCache | BatchedCaches) -> torch.Tensor:
        """x (B, 1, hidden) float32 on the CPU, one token per row -> the layer's output; appends
        each row's k/v to its own cache."""
        rows = x.shape[0]
        slots = (HLLayerCache * rows)()
        claim_slots(row_caches(cache), self.layer_idx, slots)
        x = x.contiguous()
        out = torch.empty_like(x)
        cos, sin = rotary_rows(cos, rows), rotary_rows(sin, rows)
        self.library.hl_decode_layer(ctypes.byref(self.struct), x.data_ptr(), out.data_ptr(), slots, rows,
                                     cos.data_ptr(), sin.data_ptr(), self.team.threads())
        return out

    def applies(self, x: torch.Tensor, cos: torch.Tensor, cache: KVCache | BatchedCaches) -> bool:
        """Whether this step can run natively (else the layer's PyTorch code runs)."""
        return (x.shape[1] == 1 and x.dtype == torch.float32 and x.device.type == "cpu"
                and cos.dtype == torch.float32 and rows_in_place(row_caches(cache), [self.layer_idx], x.shape[0]))

    def __repr__(self) -> str:
        return f"NativeDecodeLayer(layer={self.layer_idx}, kernel=hl_decode_layer)"


class NativeHead:
    """The output head's product through ``hl_linear`` (soft-capped where the model caps its logits)."""

    def __init__(self, head: nn.Module, softcap: float | None, library: ctypes.CDLL,
                 team: DecodeTeam | None = None) -> None:
        self.view = linear_view(head)
        self.softcap = softcap or 0.0
        self.library = library
        self.team = team if team is not None else DecodeTeam(library)

    def applies(self, x: torch.Tensor) -> bool:
        return x.shape[:-1].numel() == 1 and x.dtype == torch.float32 and x.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(self.view, x, self.team.threads(), library=self.library)
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap


class NativeModel:
    """A whole decode step, or whole prefill chunks (every layer, final norm, head), in one kernel call.

    Used when every layer and the head have native steps and the caches serve every layer in
    place: per step, Python only looks up the embeddings and the rotary tables and claims each
    layer's cache rows.
    """

    def __init__(self, final_norm: nn.Module, layers: list[NativeDecodeLayer], head: NativeHead,
                 library: ctypes.CDLL, team: DecodeTeam | None = None) -> None:
        self.library = library
        self.team = team if team is not None else DecodeTeam(library)
        self.layers = layers
        self.layer_indices = [layer.layer_idx for layer in layers]
        self.structs = (HLDecoderLayer * len(layers))(*(layer.struct for layer in layers))
        self.head = head
        self.final_norm = final_norm

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: KVCache | BatchedCaches) -> torch.Tensor:
        """x: the tokens' embeddings (B, 1, hidden) float32 -> logits (B, 1, vocab) float32.

        Each row has its own cache and position; each row's logits are bitwise the same alone
        or in any batch (the kernels are batch-invariant)."""
        rows, n_layers = x.shape[0], len(self.layers)
        slots = claim_rows(row_caches(cache), self.layer_indices, [1] * rows)  # (n_layers, rows), layer-major
        x = x.reshape(rows, -1).float().clone()  # (B, hidden), overwritten by the kernel
        logits = torch.empty(rows, 1, self.head.view.struct.out_features, dtype=torch.float32)  # (B, 1, vocab)
        cos, sin = rotary_rows(cos, rows), rotary_rows(sin, rows)
        self.library.hl_decode_model(self.structs, slots, n_layers, rows, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                     self.final_norm.weight.data_ptr(), self.final_norm.eps,
                                     ctypes.byref(self.head.view.struct), self.head.softcap, logits.data_ptr(),
                                     self.team.threads())
        return logits

    def prefill_chunks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                       lengths: list[int], all_logits: bool = False) -> torch.Tensor:
        """Prefill chunks of several sequences in one call: x (rows, hidden) float32, the chunks'
        embeddings packed (chunk i: ``lengths[i]`` rows, continuing ``caches[i]``), cos/sin (rows,
        ..., D) of each row's position -> logits (rows, vocab) with ``all_logits``, else each
        chunk's last row's (chunks, vocab). Each row's arithmetic depends on its own sequence
        only (products row by row, attention within its chunk and cache).

        One ``hl_prefill_model`` call: products through the decode products, causal query-tiled
        attention over each cache; each layer's keys and values are written at their positions of
        each cache first."""
        n_layers, segments = len(self.layers), len(caches)
        slots = claim_rows(caches, self.layer_indices, lengths)  # (n_layers, segments), layer-major
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)  # (segments + 1,)
        rows = int(offsets[-1])
        x = x.reshape(rows, -1).float().clone()  # (rows, hidden), overwritten by the kernel
        logits = torch.empty(rows if all_logits else segments, self.head.view.struct.out_features,
                             dtype=torch.float32)
        cos, sin = rotary_rows(cos, rows), rotary_rows(sin, rows)
        self.library.hl_prefill_model(self.structs, slots, n_layers, segments, offsets.data_ptr(), x.data_ptr(),
                                      cos.data_ptr(), sin.data_ptr(), self.final_norm.weight.data_ptr(),
                                      self.final_norm.eps, ctypes.byref(self.head.view.struct), self.head.softcap,
                                      logits.data_ptr(), int(all_logits), self.team.threads())
        return logits


# ---- building the steps of a model -----------------------------------------------------------
@dataclass
class NativeReport:
    """What :func:`build_native_steps` built."""

    layers: int = 0
    head: bool = False
    whole_step: bool = False  # one kernel call per token (every layer and the head native)
    build_seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)


@dataclass
class NativeSteps:
    """The native steps of one model: per layer index, the head, and the whole-token step."""

    layers: dict[int, NativeDecodeLayer]
    head: NativeHead | None
    whole: NativeModel | None
    report: NativeReport
    team: DecodeTeam | None = None  # the threads and wait policy every step of the model shares


def build_native_steps(model: nn.Module) -> NativeSteps:
    """Native steps for every CPU-resident layer (and the head) of ``model``.

    Once the kernels are built, the host's int4 and int8 layers move into the kernels' formats
    (:func:`~hybridllm.kernels.native_linear.hold_natively`: their one copy, which prefill, decode
    and any other path read; layers loaded from a GGUF file's blocks are in them already);
    nothing else in the model changes. Raises :class:`KernelBuildError` when the kernels cannot be
    built (the model is then untouched); layers the kernels do not support are listed in
    ``report.skipped`` and keep their PyTorch step.
    """
    loaded: LoadedLibrary = load_decode_library()
    library = _declare(loaded.library)
    hold_natively(model)
    report = NativeReport(build_seconds=loaded.build_seconds)
    team = DecodeTeam(library)
    config = model.config
    n_rope_tables = model.rotary.inv_freq.shape[0]
    layers: dict[int, NativeDecodeLayer] = {}
    for layer in model.model.layers:
        if layer.input_layernorm.weight.device.type != "cpu":
            continue
        try:
            native = NativeDecodeLayer(layer, config, n_rope_tables, library, team)
        except ValueError as exc:
            report.skipped.append(f"layer {layer.self_attn.layer_idx}: {exc}")
            continue
        layers[native.layer_idx] = native
        report.layers += 1
    head = None
    if model.lm_head.weight.device.type == "cpu":
        try:
            head = NativeHead(model.lm_head, config.final_logit_softcapping, library, team)
            report.head = True
        except ValueError as exc:
            report.skipped.append(f"head: {exc}")
    whole = None
    norm = model.model.norm
    if head is not None and len(layers) == len(model.model.layers) and \
            norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu":
        whole = NativeModel(norm, [layers[i] for i in sorted(layers)], head, library, team)
        report.whole_step = True
    if report.skipped:
        logger.info("native decode: kept the PyTorch step for %s", "; ".join(report.skipped))
    return NativeSteps(layers, head, whole, report, team)


__all__ = ["FORMAT_F32", "FORMAT_Q4", "GROUP", "KV_DTYPES", "MAX_HEAD_DIM", "Q4_ROWS", "DecodeTeam", "HLDecoderLayer",
           "HLLayerCache", "HLLinear", "KernelBuildError", "NativeDecodeLayer", "NativeHead", "NativeInt4Linear",
           "NativeModel", "NativeQuantLinear", "NativeReport", "NativeSteps", "amx_tiles", "attention",
           "build_native_steps", "float32_view", "kernel_isa", "kernels", "linear", "linear_view", "pack_int4_blocks",
           "prefill_attention", "projection_view", "reference_linear", "row_caches", "unpack_int4_blocks"]
