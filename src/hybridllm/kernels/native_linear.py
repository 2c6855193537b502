"""Host weights held once, in the formats the native kernels read in place.

    layer = NativeQuantLinear.from_gguf("Q4_K", rows, in_features)   # a GGUF tensor's rows, kept Q4_K
    replaced = hold_natively(model)   # every CPU Int4Linear / Int8Linear / Int8GroupedLinear, in place

Every quantized GGUF type of a common file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS) is held in its own format, its scales as the file stores them, rearranged into the
kernels' tiles of 16 rows (``qtypes.h``: the same bytes give or take a few per row); F16 and BF16
rows are held as they are. A :class:`NativeQuantLinear` is that one copy: the native decode and
prefill steps read it in place, and its ``forward`` (any other path, e.g. a batched PyTorch
prefill) runs the same product through ``hl_linear``. A tied embedding is the head's own table
(:class:`NativeQuantEmbedding`: a lookup dequantizes the rows it reads).

The engine's own int4 (``--weights int4``, or a model quantized by ``quantize_model``) keeps
``Int4Linear``'s contract as :class:`NativeInt4Linear` (the tile format ``FORMAT_Q4``: bfloat16
scales and zeros); its int8 layers become :class:`NativeQuantLinear` of the engine's int8 formats
(:func:`hold_natively`).

The loader builds host layers straight in these formats when the native backend will run
(:data:`NATIVE_LAYOUT`, passed down by ``runtime.build``: no other copy ever exists); for a model
built otherwise, :func:`hold_natively` is the transform (as ``quantize_model`` is, gpt-fast
style), one layer at a time, so memory grows by one matrix, not by the model.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from hybridllm.errors import ConfigError
from hybridllm.host_pages import collapse_tensor, empty_on_huge_pages
from hybridllm.kernels.abi import (
    ACTIVATION_DIGITS,
    EXACT_DIGITS,
    FLOAT_FORMATS,
    FORMAT_I8_GROUPS,
    FORMAT_I8_ROWS,
    FORMAT_Q4,
    GGUF_FORMATS,
    GROUP,
    Q4_ROWS,
    SUPER_BLOCK,
    HLLinear,
    kernels,
    pack_int4_blocks,
    unpack_int4_blocks,
)
from hybridllm.models.quantized import (
    Int4Linear,
    Int8Embedding,
    Int8GroupedLinear,
    Int8Linear,
    PackedEmbedding,
    PackedLinear,
    release_unpack_tables,
)

ENGINE_FORMATS = {"I8_ROWS": FORMAT_I8_ROWS, "I8_GROUPS": FORMAT_I8_GROUPS}
FORMAT_CODES = {**GGUF_FORMATS, **ENGINE_FORMATS}


def activation_digits(mode: str) -> int:
    """The int8 digits per input value of an ``--activations`` mode (ConfigError if unknown)."""
    if mode not in ACTIVATION_DIGITS:
        raise ConfigError(f"unknown activations mode {mode!r}; choose one of {', '.join(ACTIVATION_DIGITS)}")
    return ACTIVATION_DIGITS[mode]


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


def _refuse_other_devices(module: nn.Module, what: str, fn, recurse: bool):
    moved = fn(torch.zeros(1)).device
    if moved.type != "cpu":
        raise ConfigError(f"cannot move a {what} to {moved}: its layout is the CPU kernels' "
                          "(build the model with --decode-backend eager to keep PyTorch's layouts)")
    return nn.Module._apply(module, fn, recurse)


def _run_product(struct: HLLinear, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (..., K) through ``hl_linear`` -> (..., N) in x's dtype."""
    if x.device.type != "cpu":
        raise ConfigError(f"a native layer runs on the CPU, got input on {x.device}")
    rows = x.reshape(-1, struct.in_features).float().contiguous()  # (M, K)
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)  # (M, N)
    kernels().hl_linear(ctypes.byref(struct), rows.data_ptr(), out.data_ptr(), rows.shape[0], torch.get_num_threads())
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


class NativeQuantLinear(PackedLinear):
    """A linear layer in a native kernel format (a GGUF type, F16/BF16 rows, or the engine's int8).

    Buffers: ``weight`` (the tiles, uint8; or the (N, K) rows of a float format), ``row_scales``
    ((N,) float32, the engine's per-row int8 only). ``forward``: float32 products through
    ``hl_linear`` (the decode steps' arithmetic for any number of rows). ``activation_digits``:
    the int8 digits each input value is rounded to (``ACTIVATION_DIGITS``; float formats ignore
    it). Lives on the CPU only.
    """

    def __init__(self, format_name: str, in_features: int, out_features: int, weight: torch.Tensor,
                 row_scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 activation_digits: int = EXACT_DIGITS) -> None:
        super().__init__()
        if format_name not in FORMAT_CODES:
            raise ConfigError(f"no native kernel for weights of type {format_name}")
        if activation_digits not in ACTIVATION_DIGITS.values():
            raise ConfigError(f"activation digits must be one of {sorted(ACTIVATION_DIGITS.values())}, "
                              f"not {activation_digits}")
        self.activation_digits = activation_digits
        self.format_name, self.format_code = format_name, FORMAT_CODES[format_name]
        self.in_features, self.out_features = in_features, out_features
        collapse_tensor(weight)  # every decode step streams it: 2 MiB pages
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("row_scales", row_scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weights_name(self) -> str:
        return "int8" if self.format_name in ENGINE_FORMATS else self.format_name.lower()

    # ---- building ------------------------------------------------------------------------
    @staticmethod
    def supports(type_name: str, in_features: int) -> bool:
        """Whether a GGUF tensor of ``type_name`` with rows of ``in_features`` values is held natively."""
        return type_name in GGUF_FORMATS and in_features % SUPER_BLOCK[type_name] == 0

    @classmethod
    def from_gguf(cls, type_name: str, rows: torch.Tensor, in_features: int, bias: torch.Tensor | None = None,
                  activation_digits: int = EXACT_DIGITS) -> NativeQuantLinear:
        """From a GGUF tensor's raw rows ((N, bytes per row) uint8, Q/K rows already in the model's
        order): tiles of the file's own blocks, or the float rows as they are."""
        if not cls.supports(type_name, in_features):
            raise ConfigError(f"no native kernel for {type_name} rows of {in_features} values")
        rows = rows.contiguous()
        n = rows.shape[0]
        code = GGUF_FORMATS[type_name]
        if code in FLOAT_FORMATS:
            weight = rows.view(FLOAT_FORMATS[code]).reshape(n, in_features).clone()  # (N, K), its own memory
            return cls(type_name, in_features, n, weight, None, bias, activation_digits)
        library = kernels()
        tiles = empty_on_huge_pages(library.hl_tiled_bytes(code, n, in_features))
        if library.hl_pack_gguf(code, rows.data_ptr(), n, in_features, tiles.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"cannot hold {type_name} rows of {in_features} values natively")
        return cls(type_name, in_features, n, tiles, None, bias, activation_digits)

    @classmethod
    def from_int8_rows(cls, codes: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> NativeQuantLinear:
        """The engine's per-row int8 (``Int8Linear``): (N, K) int8 codes, (N,) scales."""
        n, k = codes.shape
        tiles = cls._pack_int8(FORMAT_I8_ROWS, codes.contiguous(), None, n, k)
        return cls("I8_ROWS", k, n, tiles, scales.float().contiguous().clone(), bias)

    @classmethod
    def from_int8_groups(cls, codes: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None) -> NativeQuantLinear:
        """The engine's int8 with a scale per 32 values (``Int8GroupedLinear``): (K/32, N, 32) int8
        codes, (K/32, N) scales."""
        groups, n, _ = codes.shape
        tiles = cls._pack_int8(FORMAT_I8_GROUPS, codes.contiguous(), scales.float().contiguous(), n, groups * GROUP)
        return cls("I8_GROUPS", groups * GROUP, n, tiles, None, bias)

    @staticmethod
    def _pack_int8(code: int, codes: torch.Tensor, scales: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
        library = kernels()
        tiles = empty_on_huge_pages(library.hl_tiled_bytes(code, n, k))
        if library.hl_pack_int8(code, codes.data_ptr(), 0 if scales is None else scales.data_ptr(), n, k,
                                tiles.data_ptr()):
            raise ConfigError(f"cannot hold an int8 matrix of {k} inputs natively (a multiple of {GROUP} is needed)")
        return tiles

    @classmethod
    def concat(cls, parts: list[nn.Module]) -> NativeQuantLinear | None:
        """The parts stacked into one matrix (same format and activation digits; tiled formats need
        whole 16-row tiles in every part but the last), or None."""
        first = parts[0]
        if any(not isinstance(p, NativeQuantLinear) or p.format_name != first.format_name
               or p.in_features != first.in_features or p.activation_digits != first.activation_digits
               for p in parts):
            return None
        tiled = first.format_code not in FLOAT_FORMATS
        if tiled and any(p.out_features % Q4_ROWS for p in parts[:-1]):
            return None
        weights = [p.weight for p in parts]  # tiles are row block by row block; float rows by row
        rows = sum(w.shape[0] for w in weights)
        weight = empty_on_huge_pages(sum(w.nbytes for w in weights)).view(first.weight.dtype)
        weight = torch.cat(weights, out=weight.view(rows, *first.weight.shape[1:]))  # (sum of rows, ...)
        row_scales = None if first.row_scales is None else torch.cat([p.row_scales for p in parts])
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
        return cls(first.format_name, first.in_features, sum(p.out_features for p in parts), weight, row_scales, bias,
                   first.activation_digits)

    # ---- computing -------------------------------------------------------------------------
    def struct(self, bias: torch.Tensor | None = None) -> HLLinear:
        """The kernels' description of this matrix (``bias``: its float32 bias, kept alive by the caller)."""
        return HLLinear(self.format_code, int(bias is not None), self.out_features, self.in_features,
                        self.weight.data_ptr(), 0 if self.row_scales is None else self.row_scales.data_ptr(),
                        0 if bias is None else bias.data_ptr(), self.activation_digits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _float_bias(self.bias)
        return _run_product(self.struct(bias), x, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (any shape) of the weight: (..., K)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        kernels().hl_dequantize_rows(ctypes.byref(self.struct()), flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: the values the kernels compute with."""
        return self.rows(torch.arange(self.out_features))

    def _apply(self, fn, recurse: bool = True):
        return _refuse_other_devices(self, f"native {self.format_name} layer", fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}, "
                f"bias={self.bias is not None}")


class NativeQuantEmbedding(PackedEmbedding):
    """A token embedding held as a :class:`NativeQuantLinear` table; a tied head is the table itself."""

    def __init__(self, table: NativeQuantLinear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.out_dtype = out_dtype

    @property
    def weight(self) -> torch.Tensor:
        """The table's buffer (its ``.device`` is where lookups run)."""
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.cpu()).to(self.out_dtype)  # (..., dim)

    def tied_head(self) -> NativeQuantLinear:
        return self.table

    def dequantize(self) -> torch.Tensor:
        return self.table.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.table.format_name}"


class NativeInt4Linear(Int4Linear):
    """An :class:`~hybridllm.models.quantized.Int4Linear` whose only copy is the kernels' ``FORMAT_Q4`` tiles.

    Buffers: ``weight`` ((ceil(N/16), K/32, 320) uint8 tiles, CPU). ``forward`` runs the native
    product (float32 activations and results; the decode steps' arithmetic for any number of
    rows). Lives on the CPU only.
    """

    def __init__(self, in_features: int, out_features: int, blocks: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # no PyTorch-packed buffers: the blocks hold codes, scales and zeros
        self.in_features, self.out_features, self.group_size = in_features, out_features, GROUP
        collapse_tensor(blocks)  # every decode step streams them: 2 MiB pages
        self.register_buffer("weight", blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = GROUP,
                   bias: torch.Tensor | None = None, device: torch.device | str = "cpu") -> NativeInt4Linear:
        """From (N, K) codes 0..15 and (K / 32, N, 2) scale/zero (rounded to bfloat16), on the CPU.
        (``from_int4_rows``, ``from_float`` and the stacking of q/k/v, gate/up build through here.)"""
        if group_size != GROUP:
            raise ConfigError(f"native int4 layers use groups of {GROUP}, got {group_size}")
        if torch.device(device).type != "cpu":
            raise ConfigError(f"a native int4 layer lives on the CPU, not {device}")
        n, k = codes.shape
        return cls(k, n, pack_int4_blocks(codes.cpu(), scales_and_zeros.cpu()), bias)

    @classmethod
    def from_int4_linear(cls, module: Int4Linear) -> NativeInt4Linear:
        """The same weights as ``module`` (group 32, on the CPU) in block layout."""
        return cls.from_codes(module.unpack_codes(), module.scales_and_zeros, module.group_size, module.bias)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.bfloat16  # the blocks' scales and zeros

    @property
    def scales_and_zeros(self) -> torch.Tensor:
        """(K/32, N, 2) bfloat16 scale and zero per group, read from the blocks."""
        return unpack_int4_blocks(self.weight, self.out_features, self.in_features)[1]

    def unpack_codes(self) -> torch.Tensor:
        """(N, K) uint8 codes 0..15."""
        return unpack_int4_blocks(self.weight, self.out_features, self.in_features)[0]

    def struct(self, bias: torch.Tensor | None = None) -> HLLinear:
        return HLLinear(FORMAT_Q4, int(bias is not None), self.out_features, self.in_features,
                        self.weight.data_ptr(), 0, 0 if bias is None else bias.data_ptr(), EXACT_DIGITS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _float_bias(self.bias)
        return _run_product(self.struct(bias), x, self.out_features)

    def _apply(self, fn, recurse: bool = True):
        return _refuse_other_devices(self, "native int4 layer", fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP}, "
                f"bias={self.bias is not None}, layout=native blocks")


def native_module(module: nn.Module) -> nn.Module | None:
    """The native counterpart of a CPU quantized module (None: it is native already, or has none)."""
    on_cpu = getattr(module, "weight", None) is not None and module.weight.device.type == "cpu"
    if not on_cpu:
        return None
    if type(module) is Int4Linear and module.group_size == GROUP:
        return NativeInt4Linear.from_int4_linear(module)
    if type(module) is Int8Linear and module.in_features % GROUP == 0:
        return NativeQuantLinear.from_int8_rows(module.weight, module.scales, module.bias)
    if type(module) is Int8GroupedLinear and module.group_size == GROUP:
        return NativeQuantLinear.from_int8_groups(module.weight, module.scales, module.bias)
    if type(module) is Int8Embedding and module.table.group_size == GROUP:
        table = NativeQuantLinear.from_int8_groups(module.table.weight, module.table.scales)
        return NativeQuantEmbedding(table, module.out_dtype)
    return None


def hold_natively(model: nn.Module) -> int:
    """Replace every CPU ``Int4Linear`` / ``Int8Linear`` / ``Int8GroupedLinear`` of the decoder layers,
    the head and the embedding by its native counterpart of the same weights, in place, one at a
    time (each old copy is freed as the new one is made; a head tied to the embedding stays the
    embedding's table). Returns how many were replaced."""
    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                native = native_module(child)
                if native is not None:
                    setattr(parent, name, native)
                    replaced += 1
    embed, head = model.model.embed_tokens, model.lm_head
    tied = isinstance(embed, Int8Embedding) and head is embed.tied_head()
    native_embed = native_module(embed)
    if native_embed is not None:
        model.model.embed_tokens = native_embed
        replaced += 1
        if tied:
            model.lm_head = native_embed.tied_head()
    if not tied:
        native_head = native_module(head)
        if native_head is not None:
            model.lm_head = native_head
            replaced += 1
    if replaced:
        release_unpack_tables()
    return replaced


@dataclass(frozen=True)
class NativeHostLayout:
    """What the quantized loader builds host weights as when the native kernels run them
    (``hybridllm.loading.quantized_loader.HostLayout``): int4 as :class:`NativeInt4Linear`, and
    every GGUF type the kernels read in place as :class:`NativeQuantLinear` /
    :class:`NativeQuantEmbedding` of the file's own blocks, whose products round their inputs to
    ``activation_digits`` int8 digits (``--activations``)."""

    int4_class: type[Int4Linear] = NativeInt4Linear
    activation_digits: int = EXACT_DIGITS

    def holds(self, type_name: str, in_features: int) -> bool:
        return NativeQuantLinear.supports(type_name, in_features)

    def linear(self, type_name: str, rows: torch.Tensor, in_features: int) -> nn.Module:
        return NativeQuantLinear.from_gguf(type_name, rows, in_features, activation_digits=self.activation_digits)

    def embedding(self, type_name: str, rows: torch.Tensor, in_features: int, out_dtype: torch.dtype) -> nn.Module:
        table = NativeQuantLinear.from_gguf(type_name, rows, in_features, activation_digits=self.activation_digits)
        return NativeQuantEmbedding(table, out_dtype)


NATIVE_LAYOUT = NativeHostLayout()

__all__ = ["NATIVE_LAYOUT", "NativeHostLayout", "NativeInt4Linear", "NativeQuantEmbedding", "NativeQuantLinear",
           "activation_digits", "hold_natively", "native_module"]
