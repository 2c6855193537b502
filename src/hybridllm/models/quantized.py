"""Weights that stay quantized in memory: int4 and int8 linear layers, an int8 embedding.

``Int4Linear`` and ``Int8Linear`` keep ``nn.Linear``'s forward contract (``(..., in) -> (..., out)``)
and run PyTorch's weight-only kernels:

- int4, group-wise (group 32) asymmetric: ``aten._weight_int4pack_mm_for_cpu`` on the CPU and
  ``aten._weight_int4pack_mm`` (tinygemm) on CUDA. Both dequantize ``(q - 8) * scale + zero``
  per group with ``q`` in 0..15; an affine group ``value = s * q + o`` (GGUF Q4_0/Q4_1/Q4_K)
  maps exactly to ``scale = s, zero = o + 8 s``.
- int8, per output channel symmetric: ``aten._weight_int8pack_mm`` (``x @ (w * scales).T``);
  on CUDA builds without that kernel the same product is computed as
  ``linear(x, w.to(x.dtype)) * scales``.

The kernels are fast in bfloat16 only (their float32 CPU paths are scalar reference loops), so
activations are cast to the kernel dtype (the dtype of the stored scales, bfloat16 by default)
and the output back to the input's dtype. The packed int4 layout is device specific; moving an
``Int4Linear`` to another device repacks it.

Int8 codes with one scale per 32 values (GGUF Q8_0 exactly) live in ``Int8GroupedLinear`` /
``Int8Embedding``: the vocabulary-wide tables (token embedding, output head), whose greedy
choices move when requantized per row, and the projections of 5- and 6-bit K-quant files
(Q5_K, Q6_K), whose sub-block scales one scale per row cannot hold. A few input rows go
through one int8-kernel call per group; more rows (prefill) through a float32 product with
the weight dequantized a slab of rows at a time; a decode step through the native kernels.

``quantize_model`` is the gpt-fast style transform of a float model; the GGUF loader builds the
same modules straight from the file's blocks (``hybridllm.loading.quantized_loader``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridllm.errors import ConfigError
from hybridllm.formats.gguf_blocks import GROUP_SIZE, Int4Rows

logger = logging.getLogger(__name__)

WEIGHT_MODES = ("auto", "float", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def check_weights_mode(mode: str) -> str:
    """Validate a ``--weights`` value."""
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    return mode


def kernel_dtype_for(device: torch.device | str) -> torch.dtype:
    """Activation/scale dtype of the quantized kernels on ``device`` (their fast path: bfloat16)."""
    return torch.bfloat16


# ---- kernel selection (small functions; the CUDA ones are exercised by @pytest.mark.cuda tests) ----
def _cuda_inner_k_tiles(k: int) -> int | None:
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    return None


def int4_unsupported_reason(device: torch.device | str, out_features: int, in_features: int,
                            group_size: int = GROUP_SIZE) -> str | None:
    """Why the packed int4 kernel cannot run this shape on ``device`` (None: it can)."""
    device = torch.device(device)
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} (supported: {INT4_GROUP_SIZES})"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if device.type == "cpu":
        if out_features % 16:
            return f"out_features {out_features} is not a multiple of 16"
        return None
    if device.type == "cuda":
        if out_features % 8:
            return f"out_features {out_features} is not a multiple of 8"
        if _cuda_inner_k_tiles(in_features) is None:
            return f"in_features {in_features} is not a multiple of 32"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "the CUDA int4 kernel needs compute capability 8.0 or newer"
        return None
    return f"no int4 kernel for device type {device.type}"


def int8_unsupported_reason(device: torch.device | str, out_features: int, in_features: int) -> str | None:
    """Why the int8 weight kernel cannot run this shape on ``device`` (None: it can)."""
    # The CPU kernel's vector loop has no tail: in_features must be a multiple of 16 (other
    # widths crash it), 32 here to match the GGUF block size.
    if in_features % 32:
        return f"in_features {in_features} is not a multiple of 32"
    if torch.device(device).type not in ("cpu", "cuda"):
        return f"no int8 kernel for device type {torch.device(device).type}"
    return None


def _int4_pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(N, K) codes 0..15 -> the int4 kernel's packed weight on ``device``."""
    if device.type == "cuda":
        codes = codes.to(device=device, dtype=torch.uint8)
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()  # (N, K/2): even element in the high nibble
        return torch.ops.aten._convert_weight_to_int4pack(pairs, _cuda_inner_k_tiles(codes.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(device=device, dtype=torch.int32), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Every 4-bit value of a packed tensor, low nibble of each byte first: (2 * bytes,) uint8."""
    data = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(-1)


@functools.lru_cache(maxsize=16)  # int32 per weight of each shape: a few MB for a model's shapes
def _cpu_nibble_order(n: int, k: int) -> torch.Tensor | None:
    """For the CPU int4 packing of an (n, k) weight: index i such that code (r, c) sits at nibble
    ``order[r * k + c]`` of the packed bytes; None when the packing is not a plain reordering.

    The packed layout is private to PyTorch's kernel (it changes between versions and CPUs), so
    it is learnt by packing probe weights: probe d holds digit d (base 16) of each position + 1,
    so ceil(log16(n k + 1)) packings spell out where every code went; padding stays 0. A random
    weight then checks the result. Unpacking becomes one gather instead of a product with an
    identity matrix through the kernel (what fusion and the native decode copies pay at load).
    """
    cpu = torch.device("cpu")
    if n * k >= 2**31 - 1:
        return None
    positions = torch.arange(1, n * k + 1, dtype=torch.int32)

    def digit(d: int) -> torch.Tensor:  # where digit d of every position + 1 lands in the nibbles
        probe = ((positions >> (4 * d)) & 15).reshape(n, k)
        return _nibbles(_int4_pack(probe, cpu)).to(torch.int32) << (4 * d)

    source = digit(0)
    for d in range(1, max(1, -(-int(n * k).bit_length() // 4))):
        source |= digit(d)
    stored = source > 0  # padding nibbles stay 0
    found = source[stored] - 1
    if found.numel() != n * k:
        return None
    if not torch.equal(torch.bincount(found, minlength=n * k), torch.ones(n * k, dtype=torch.int64)):
        return None
    order = torch.empty(n * k, dtype=torch.int32)
    order[found.long()] = torch.nonzero(stored).reshape(-1).to(torch.int32)
    del source, stored, found
    check = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0))
    unpacked = torch.index_select(_nibbles(_int4_pack(check, cpu)), 0, order).reshape(n, k)
    return order if torch.equal(unpacked.to(torch.int64), check) else None


def release_unpack_tables() -> None:
    """Forget the nibble orders learnt by :meth:`Int4Linear.unpack_codes` (int32 per weight of
    each shape): call after a model's layers have been unpacked once (a layout conversion)."""
    _cpu_nibble_order.cache_clear()


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x (M, K) in the kernel dtype -> (M, N)."""
    if packed.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def _has_int8_kernel(device: torch.device) -> bool:
    return _has_int8_kernel_for("CUDA" if device.type == "cuda" else "CPU")


@functools.cache
def _has_int8_kernel_for(dispatch_key: str) -> bool:
    """Asked once per dispatch key (the int8 head calls the kernel 18 times per token)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", dispatch_key)


def _int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) in the scales' dtype -> (M, N) = x @ (weight * scales[:, None]).T."""
    if _has_int8_kernel(weight.device):
        return torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    return F.linear(x, weight.to(x.dtype)) * scales


# ---- quantizers (float -> codes) --------------------------------------------------------
def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Rows:
    """Asymmetric group-wise 4-bit codes of a float (N, K) matrix (GGUF Q4_1 style: min/max)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)  # (N, G, group)
    lo, hi = groups.amin(-1), groups.amax(-1)  # (N, G)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Rows(q.reshape(n, k), scale, lo)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes of a float (N, K) matrix.

    Returns ``(codes (N, K) int8, scales (N,) float32)``; every scale is exactly representable
    in ``scale_dtype`` (the kernel's), so the int8 kernel and a float32 lookup agree.
    """
    w = weight.float()
    amax = w.abs().amax(dim=-1)  # (N,)
    # /126.5 leaves room for the rounding of the scale to scale_dtype (<= 2^-9 relative for
    # bfloat16), so no code needs clamping past 127.
    scale = (amax / 126.5).to(scale_dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int8_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes with one scale per group of ``group_size`` (GGUF Q8_0 style).

    Returns ``(codes (N, K) int8, scales (N, K / group) float32)``.
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)  # (N, G, group)
    scale = groups.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


# ---- modules ----------------------------------------------------------------------------
class Int4Linear(nn.Module):
    """A linear layer with packed int4 weights (group-wise scale and zero), ``nn.Linear``'s contract.

    Buffers: ``weight`` (the kernel's packed layout, device specific) and ``scales_and_zeros``
    ((K / group, N, 2) in the kernel dtype). ``bias`` is a float parameter, as in ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int = GROUP_SIZE, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_int4_rows(cls, rows: Int4Rows, bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                       kernel_dtype: torch.dtype | None = None) -> Int4Linear:
        """Build from codes with ``value = scale * q + offset`` per group (exact up to the kernel dtype)."""
        device = torch.device(device)
        kernel_dtype = kernel_dtype or kernel_dtype_for(device)
        n, k = rows.q.shape
        group_size = k // rows.scale.shape[1]
        reason = int4_unsupported_reason(device, n, k, group_size)
        if reason:
            raise ConfigError(f"int4 kernel: {reason}")
        zero = rows.offset + 8.0 * rows.scale  # (q - 8) * scale + zero == scale * q + offset
        scales_and_zeros = torch.stack((rows.scale.t(), zero.t()), dim=-1)  # (G, N, 2)
        scales_and_zeros = scales_and_zeros.to(device=device, dtype=kernel_dtype).contiguous()
        return cls.from_codes(rows.q, scales_and_zeros, group_size, bias, device)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = GROUP_SIZE,
                   bias: torch.Tensor | None = None, device: torch.device | str = "cpu") -> Int4Linear:
        """From (N, K) codes 0..15 and (K / group, N, 2) scale/zero in the kernel dtype (stored as given)."""
        device = torch.device(device)
        n, k = codes.shape
        return cls(k, n, _int4_pack(codes, device), scales_and_zeros.to(device), group_size, bias)


    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                   group_size: int = GROUP_SIZE, kernel_dtype: torch.dtype | None = None) -> Int4Linear:
        """Quantize a float (N, K) weight (asymmetric min/max per group of ``group_size``)."""
        device = torch.device(device)
        kernel_dtype = kernel_dtype or kernel_dtype_for(device)
        rows = quantize_int4(weight, group_size)
        # Round the group parameters to what the kernel stores first, then pick each code
        # against them: the rounding then costs nothing beyond the 4-bit grid itself.
        scale = rows.scale.to(kernel_dtype).float()
        zero = (rows.offset + 8.0 * rows.scale).to(kernel_dtype).float()
        n, k = weight.shape
        groups = weight.float().reshape(n, k // group_size, group_size)
        q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.uint8)
        rows = Int4Rows(q.reshape(n, k), scale, zero - 8.0 * scale)
        return cls.from_int4_rows(rows, bias, device, kernel_dtype)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.kernel_dtype).contiguous()  # (M, K)
        out = _int4_mm(x2, self.weight, self.group_size, self.scales_and_zeros)  # (M, N)
        out = out.to(x.dtype).reshape(*lead, self.out_features)
        return out if self.bias is None else out + self.bias

    def unpack_codes(self) -> torch.Tensor:
        """(N, K) uint8 codes 0..15, exact: on the CPU by the packing's nibble order (learnt once
        per shape, see :func:`_cpu_nibble_order`), else read back through the kernel itself."""
        if self.weight.device.type == "cpu":
            order = _cpu_nibble_order(self.out_features, self.in_features)
            if order is not None:
                return torch.index_select(_nibbles(self.weight), 0, order).reshape(self.out_features, self.in_features)
        groups = self.in_features // self.group_size
        unit = torch.empty(groups, self.out_features, 2, dtype=torch.bfloat16, device=self.weight.device)
        unit[..., 0], unit[..., 1] = 1.0, 8.0  # (q - 8) * 1 + 8 == q, exact in bfloat16
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight.device)
        return _int4_mm(eye, self.weight, self.group_size, unit).t().round().to(torch.uint8).contiguous()

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight the kernel computes with."""
        codes = self.unpack_codes().float().reshape(self.out_features, -1, self.group_size)  # (N, G, group)
        sz = self.scales_and_zeros.float()  # (G, N, 2)
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # (N, G)
        return ((codes - 8) * scale[..., None] + zero[..., None]).reshape(self.out_features, self.in_features)

    def _apply(self, fn: Callable, recurse: bool = True):
        # The packed layout belongs to a device: repack when the module changes device.
        old = self.weight.device
        new = fn(torch.zeros(1, device=old)).device
        if new == old:
            return super()._apply(fn, recurse)
        reason = int4_unsupported_reason(new, self.out_features, self.in_features, self.group_size)
        if reason:
            raise ConfigError(f"cannot move an int4 layer to {new}: {reason}")
        codes = self.unpack_codes().cpu()
        super()._apply(fn, recurse)
        self.weight = _int4_pack(codes, new)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel_dtype={self.kernel_dtype}")


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one scale per output channel, ``nn.Linear``'s contract.

    Buffers: ``weight`` ((N, K) int8) and ``scales`` ((N,) in the kernel dtype).
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", kernel_dtype: torch.dtype | None = None) -> Int8Linear:
        device = torch.device(device)
        kernel_dtype = kernel_dtype or kernel_dtype_for(device)
        reason = int8_unsupported_reason(device, *codes.shape)
        if reason:
            raise ConfigError(f"int8 kernel: {reason}")
        return cls(codes.to(device).contiguous(), scales.to(device=device, dtype=kernel_dtype).contiguous(), bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                   kernel_dtype: torch.dtype | None = None) -> Int8Linear:
        """Quantize a float (N, K) weight per output channel (symmetric)."""
        kernel_dtype = kernel_dtype or kernel_dtype_for(device)
        codes, scales = quantize_int8(weight, kernel_dtype)
        return cls.from_codes(codes, scales, bias, device, kernel_dtype)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.kernel_dtype).contiguous()  # (M, K)
        out = _int8_mm(x2, self.weight, self.scales).to(x.dtype).reshape(*lead, self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight the kernel computes with."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel_dtype={self.kernel_dtype}")


GROUP_LOOP_MAX_ROWS = 8  # up to this many input rows, the CPU runs one int8-kernel call per group
DEQUANTIZED_SLAB_BYTES = 4 << 20  # float32 weight rows dequantized at a time for more rows


class Int8GroupedLinear(nn.Module):
    """A linear layer with int8 codes and one scale per group of 32 inputs (GGUF Q8_0, exactly).

    Two ways to the same product ``out = x @ (scales * codes).T``, accumulated in float32:

    - few rows on the CPU (``<= GROUP_LOOP_MAX_ROWS``): one int8-kernel call per group,
      ``out = sum_g scales[g] * (x_g @ codes[g].T)`` (1.5 ms for the 49152-row head at one row,
      where dequantizing it would cost 6.6 ms);
    - more rows, or CUDA: the weight dequantized to float32 in slabs of output rows
      (``DEQUANTIZED_SLAB_BYTES``), each slab one matrix product (3.6x faster than the group
      loop at 512 rows of a 3072 x 576 projection; the scratch stays a few MB).

    Buffers: ``weight`` ((G, N, 32) int8, one contiguous slab per group), ``scales`` ((G, N)
    float32) and ``unit`` ((N,) ones in the kernel dtype).
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, kernel_dtype: torch.dtype | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        groups, self.out_features, group_size = weight.shape
        self.in_features, self.group_size = groups * group_size, group_size
        kernel_dtype = kernel_dtype or kernel_dtype_for(weight.device)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales.float(), persistent=False)
        self.register_buffer("unit", torch.ones(self.out_features, dtype=kernel_dtype, device=weight.device),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", kernel_dtype: torch.dtype | None = None) -> Int8GroupedLinear:
        """From (N, K) int8 codes and (N, K / group) scales: value = scale * code."""
        device = torch.device(device)
        n, k = codes.shape
        group = k // scales.shape[1]
        grouped = codes.reshape(n, k // group, group).transpose(0, 1).to(device).contiguous()  # (G, N, group)
        return cls(grouped, scales.t().to(device).contiguous(), kernel_dtype or kernel_dtype_for(device), bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | str = "cpu",
                   group_size: int = GROUP_SIZE) -> Int8GroupedLinear:
        codes, scales = quantize_int8_groups(weight, group_size)
        return cls.from_codes(codes, scales, bias, device)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return self.unit.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] <= GROUP_LOOP_MAX_ROWS and x.device.type == "cpu":
            out = self._group_loop(x2.to(self.kernel_dtype))
        else:
            out = self._dequantized_product(x2.float())
        out = out.to(x.dtype).reshape(*lead, self.out_features)
        return out if self.bias is None else out + self.bias

    def _group_loop(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) in the kernel dtype -> (M, N) float32, one int8-kernel call per group."""
        out = torch.zeros(x2.shape[0], self.out_features, dtype=torch.float32, device=x2.device)  # (M, N)
        for g in range(self.weight.shape[0]):
            xg = x2[:, g * self.group_size:(g + 1) * self.group_size].contiguous()  # (M, group)
            out.addcmul_(_int8_mm(xg, self.weight[g], self.unit), self.scales[g])
        return out

    def _dequantized_product(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) float32 -> (M, N) float32, the weight dequantized one slab of rows at a time."""
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x2.device)  # (M, N)
        slab = max(1, DEQUANTIZED_SLAB_BYTES // (4 * self.in_features))
        for n0 in range(0, self.out_features, slab):
            n1 = min(n0 + slab, self.out_features)
            torch.matmul(x2, self.dequantize_rows(n0, n1).t(), out=out[:, n0:n1])
        return out

    def dequantize_rows(self, n0: int, n1: int) -> torch.Tensor:
        """Float32 output rows ``n0 .. n1-1`` of the weight: (n1 - n0, K)."""
        values = self.weight[:, n0:n1].float() * self.scales[:, n0:n1, None]  # (G, rows, group)
        return values.transpose(0, 1).reshape(n1 - n0, self.in_features)  # (rows, G * group)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (any shape) of the weight: (..., K)."""
        codes = self.weight[:, ids]  # (G, *ids, group)
        values = codes.float() * self.scales[:, ids].unsqueeze(-1)  # (G, *ids, group)
        return values.movedim(0, -2).reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel_dtype={self.kernel_dtype}")


class Int8Embedding(nn.Module):
    """Token embedding of int8 codes with a scale per group of 32 (GGUF Q8_0, exactly).

    A lookup dequantizes only the rows it reads. The table is an :class:`Int8GroupedLinear`
    (``table``), which a tied output head shares (:meth:`tied_head`).
    """

    def __init__(self, table: Int8GroupedLinear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.out_dtype = out_dtype

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, device: torch.device | str = "cpu",
                   out_dtype: torch.dtype = torch.float32) -> Int8Embedding:
        return cls(Int8GroupedLinear.from_codes(codes, scales, device=device), out_dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, device: torch.device | str = "cpu",
                   out_dtype: torch.dtype = torch.float32) -> Int8Embedding:
        return cls(Int8GroupedLinear.from_float(weight, device=device), out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 codes (their ``.device`` is where lookups run)."""
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).to(self.out_dtype)  # (..., dim)

    def tied_head(self) -> Int8GroupedLinear:
        """The tied output projection: the same module, so the codes are stored once."""
        return self.table

    def dequantize(self) -> torch.Tensor:
        return self.table.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, out_dtype={self.out_dtype}"


class PackedLinear(nn.Module):
    """A linear layer whose weight stays in a kernel's own packed format: a GGUF type as the file
    holds it (``Q4_K``, ``Q6_K`` ...), or the engine's int8 in a kernel's layout. What the engine
    asks of any such layer, whatever computes it (``hybridllm.kernels.native_linear``):
    ``format_name``, ``in_features``, ``out_features``, ``bias``, ``dequantize()`` (the float32
    weight it computes with: the reference of its numerics) and :meth:`concat` (parts stacked
    into one matrix, or None)."""

    format_name: str
    in_features: int
    out_features: int

    @property
    def weights_name(self) -> str:
        """What ``weights_format`` calls this format ("q4_k", "int8", ...)."""
        return self.format_name.lower()

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def concat(cls, parts: list[nn.Module]) -> nn.Module | None:
        return None


class PackedEmbedding(nn.Module):
    """A token embedding whose table stays packed (lookups dequantize the rows they read); a tied
    head is the same table (:meth:`tied_head`)."""

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def tied_head(self) -> PackedLinear:
        raise NotImplementedError


# ---- the model transform and its summary ------------------------------------------------
def module_format(module: nn.Module) -> str:
    """"int4", "int8", or the float dtype's name ("float32") of a linear/embedding module."""
    if isinstance(module, Int4Linear):
        return "int4"
    if isinstance(module, (Int8Linear, Int8GroupedLinear, Int8Embedding)):
        return "int8"
    if isinstance(module, PackedLinear):
        return module.weights_name
    return str(module.weight.dtype).removeprefix("torch.")


def weights_format(model: nn.Module) -> str:
    """The format of the decoder layers' projection weights ("int4", "int8", "float32", ...).

    Mixed layers give the formats joined by "+", most frequent first (e.g. "int4+float32").
    """
    counts: dict[str, int] = {}
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, (nn.Linear, Int4Linear, Int8Linear, Int8GroupedLinear, PackedLinear)):
                fmt = module_format(module)
                counts[fmt] = counts.get(fmt, 0) + 1
    return "+".join(sorted(counts, key=lambda f: -counts[f])) or "float32"


def quantize_model(model: nn.Module, weights: str) -> nn.Module:
    """Replace a float model's projections in place: "int4" (layers; embedding and head int8) or "int8".

    Shapes a kernel cannot run stay float (logged). "float" and "auto" leave the model as is.
    """
    check_weights_mode(weights)
    if weights in ("float", "auto"):
        return model
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, quantized_linear(child.weight.data, child.bias, weights, name))
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    device = embed.weight.device
    if isinstance(embed, nn.Embedding) and embed.embedding_dim % GROUP_SIZE == 0:
        model.model.embed_tokens = Int8Embedding.from_float(embed.weight.data, device, embed.weight.dtype)
    if tied and isinstance(model.model.embed_tokens, Int8Embedding):
        model.lm_head = model.model.embed_tokens.tied_head()
    elif isinstance(model.lm_head, nn.Linear) and model.lm_head.in_features % GROUP_SIZE == 0:
        head = model.lm_head
        model.lm_head = Int8GroupedLinear.from_float(head.weight.data, None if head.bias is None else head.bias.data,
                                                     head.weight.device)
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """The float counterpart of a quantized model, in place: every int4/int8 projection, head and
    embedding becomes a float32 ``nn.Linear`` / ``nn.Embedding`` holding its dequantized weight
    (and bias), so the model computes the exact product of its quantized weights: the reference
    the quantized kernels' numerics are measured against."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (Int8Embedding, PackedEmbedding)):
                setattr(parent, name, nn.Embedding.from_pretrained(child.dequantize().float()))
            elif isinstance(child, (Int4Linear, Int8Linear, Int8GroupedLinear, PackedLinear)):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = nn.Parameter(child.dequantize().float(), requires_grad=False)
                if child.bias is not None:
                    linear.bias = nn.Parameter(child.bias.detach().float().clone(), requires_grad=False)
                setattr(parent, name, linear)
    return model


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, name: str = "") -> nn.Module:
    """An Int4Linear/Int8Linear of a float weight, or an ``nn.Linear`` (logged) when no kernel fits."""
    device = weight.device
    n, k = weight.shape
    bias_data = None if bias is None else bias.data
    reason = (int4_unsupported_reason(device, n, k) if fmt == "int4" else int8_unsupported_reason(device, n, k))
    if reason is None:
        if fmt == "int4":
            return Int4Linear.from_float(weight, bias_data, device)
        return Int8Linear.from_float(weight, bias_data, device)
    logger.info("%s stays %s: no %s kernel (%s)", name or "a linear layer", weight.dtype, fmt, reason)
    linear = nn.Linear(k, n, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias_data, requires_grad=False)
    return linear
