"""Every weight format the native kernels read in place (``qtypes.h``): the GGUF types of common
files, held in the file's own blocks and scales, the engine's int8, and float rows.

For each: the values the kernels compute with are the file's (the gguf package's dequantizer,
exactly); the product is the exact product of those values up to the activations' two int8
digits (or, with one digit, ``--activations int8``, exactly that of the inputs rounded to int8 per
group of 32); every kernel (AVX-512 VNNI, AMX tiles, AVX2 with and without VNNI, the portable
reference) gives the same bits; a row's result does not depend on the other rows; the tiles take
the file's bytes. Random blocks cover every code, scale and min a file may hold.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridllm.kernels import native
from hybridllm.kernels.native_linear import NativeQuantEmbedding, NativeQuantLinear, native_module
from hybridllm.models.quantized import Int4Linear, Int8GroupedLinear, Int8Linear

from conftest import NEEDS_COMPILER

pytestmark = NEEDS_COMPILER

GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Where each type's block keeps its float16 scale (and min): sane values there, random bytes elsewhere.
SCALE_OFFSETS = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_rows(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, bytes per row) uint8: n rows of k values of a GGUF type, random codes and scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // values, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(type_name, (0,)):
        scales = rng.uniform(0.001, 0.02, size=(n, k // values)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    return blocks.reshape(n, -1)


def gguf_values(type_name: str, rows: np.ndarray, k: int) -> torch.Tensor:
    """The gguf package's dequantization: (n, k) float32."""
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows.shape[0], k))


def held(type_name: str, n: int, k: int, seed: int = 0, digits: int = 2) -> tuple[NativeQuantLinear, torch.Tensor]:
    rows = random_rows(type_name, n, k, seed)
    layer = NativeQuantLinear.from_gguf(type_name, torch.from_numpy(rows.copy()), k, activation_digits=digits)
    return layer, gguf_values(type_name, rows, k)


def rounded_to_one_digit(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as one int8 digit per value represents it: per group of 32, scale = max|x| / 127,
    round(x / scale) * scale (ties to even, as the kernels' nearbyint)."""
    groups = x.reshape(x.shape[0], -1, 32)  # (M, K/32, 32)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inverse) * scale).reshape(x.shape)


@pytest.fixture
def amx(request):
    """Run with AMX tiles on, then off (restored afterwards); a no-op where the CPU has none."""
    library = native.kernels()
    yield library
    library.hl_set_amx(1)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_the_values_are_the_files(type_name):
    layer, values = held(type_name, 40, 512)
    assert torch.equal(layer.dequantize(), values)
    ids = torch.tensor([[3, 39], [0, 17]])
    assert torch.equal(layer.rows(ids), values[ids])  # lookups read rows of the tiles
    embedding = NativeQuantEmbedding(layer)
    assert torch.equal(embedding(ids), values[ids]) and embedding.tied_head() is layer


@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 17])  # one row, a vector pass, AMX tiles (from 10 rows)
def test_products_are_exact_dots_the_same_on_every_kernel(type_name, rows, amx):
    layer, values = held(type_name, 48, 768, seed=rows)
    view = native.linear_view(layer)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    expected = (x.double() @ values.double().T)
    reference = native.reference_linear(view, x)
    for tiles in (1, 0):
        amx.hl_set_amx(tiles)
        out = native.linear(view, x)
        assert torch.equal(out, reference), f"tiles={tiles}"  # vector/tile kernels == the portable reference
        alone = torch.cat([native.linear(view, x[i:i + 1]) for i in range(rows)])
        assert torch.equal(alone, out)  # each row as alone
    error = (reference.double() - expected).abs().max().item() / expected.abs().max().item()
    assert error < 2e-4  # the activations' two int8 digits (~15 bits)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_long_rows_in_several_tile_passes_are_the_same_bits(type_name, amx):
    """AMX tiles take an item's row blocks over spans of the inputs (dots_amx.h: groups_per_pass,
    184 groups for 8 blocks), each output's sum carried through the output between passes: with
    8,192 inputs (256 groups: two passes, the second shorter) and a partial last block, the result
    is the reference's bits, as in one pass."""
    layer, _ = held(type_name, 136, 8192, seed=11)
    x = torch.randn(17, 8192, generator=torch.Generator().manual_seed(11))
    assert_every_kernel_is_the_reference(native.linear_view(layer), x, amx)


def test_engine_int8_rows_in_several_tile_passes_take_their_row_scales_once(amx):
    """FORMAT_I8_ROWS multiplies each output by its row's scale after the last group: with the
    inputs split over passes, once (on the last pass), not once per pass."""
    tiled = native_module(Int8Linear.from_float(torch.randn(136, 8192, generator=torch.Generator().manual_seed(3))))
    x = torch.randn(17, 8192, generator=torch.Generator().manual_seed(4))
    assert_every_kernel_is_the_reference(native.linear_view(tiled), x, amx)


@pytest.fixture
def panels():
    """The kernels with AMX tiles off (the panels take many rows where tiles would), restored after."""
    library = native.kernels()
    library.hl_set_amx(0)
    yield library
    library.hl_set_panels(1)
    library.hl_set_amx(1)


def assert_panels_are_the_reference(view, x: torch.Tensor, library) -> None:
    """The product of x with the view's weights on the panels (AVX-512 VNNI builds: the input rows
    in the lanes, dots_panels.h) and on the row kernels: bit for bit the portable reference's, and
    each row as alone."""
    reference = native.reference_linear(view, x)
    for on in (1, 0):
        library.hl_set_panels(on)
        assert torch.equal(native.linear(view, x), reference), f"panels={on}"
    alone = torch.cat([native.linear(view, x[i:i + 1]) for i in range(0, x.shape[0], 9)])
    assert torch.equal(alone, reference[::9])


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("type_name", GGUF_TYPES)
# 64 rows: 4 input blocks; 100: 7 with 12 padding rows (one digit: a step of 4, then of 2 and of 1)
@pytest.mark.parametrize("rows", [64, 100])
def test_panels_give_every_row_the_reference_bits(type_name, digits, rows, panels):
    layer, _ = held(type_name, 40, 768, seed=rows + digits, digits=digits)  # 40: a partial last row block
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    assert_panels_are_the_reference(native.linear_view(layer), x, panels)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS"])
def test_panels_over_several_passes_are_the_same_bits(type_name, panels):
    """The panels unpack an item's row blocks over spans of the inputs (dots_panels.h:
    PASS_PANEL_BYTES), each output's float sum carried through a scratch between passes: with 8,192
    inputs (256 groups of 9 row blocks: several passes) the reference's bits, as in one pass."""
    layer, _ = held(type_name, 136, 8192, seed=12)
    x = torch.randn(70, 8192, generator=torch.Generator().manual_seed(12))
    assert_panels_are_the_reference(native.linear_view(layer), x, panels)


@pytest.mark.parametrize("module", [Int8Linear, Int8GroupedLinear, Int4Linear])
def test_panels_take_the_engines_formats(module, panels):
    """The engine's int8 (a scale per row, multiplied once after the last pass; per group) and int4
    (bf16 scale and zero) on the panels, over several passes."""
    rows = 144 if module is Int4Linear else 136  # (int4 holds whole 16-row blocks only)
    tiled = native_module(module.from_float(torch.randn(rows, 8192, generator=torch.Generator().manual_seed(5))))
    x = torch.randn(70, 8192, generator=torch.Generator().manual_seed(6))
    assert_panels_are_the_reference(native.linear_view(tiled), x, panels)


def assert_every_kernel_is_the_reference(view, x: torch.Tensor, amx) -> None:
    """The product of x with the view's weights on AMX tiles (where the CPU has them) and on the
    vector kernels: bit for bit the portable reference's."""
    reference = native.reference_linear(view, x)
    for tiles in (1, 0):
        amx.hl_set_amx(tiles)
        assert torch.equal(native.linear(view, x), reference), f"tiles={tiles}"


@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_one_digit_products_are_exact_dots_of_the_rounded_inputs(type_name, rows, amx):
    """``--activations int8``: every kernel skips the low digits, and the result is the product of
    the file's values with the inputs rounded to one int8 digit per value (the min terms of
    asymmetric types included: they see the rounded inputs' sums), one arithmetic per row."""
    layer, values = held(type_name, 48, 768, seed=rows, digits=1)
    exact_layer, _ = held(type_name, 48, 768, seed=rows)
    view = native.linear_view(layer)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    reference = native.reference_linear(view, x)
    for tiles in (1, 0):
        amx.hl_set_amx(tiles)
        out = native.linear(view, x)
        assert torch.equal(out, reference), f"tiles={tiles}"
        assert torch.equal(torch.cat([native.linear(view, x[i:i + 1]) for i in range(rows)]), out)
    expected = rounded_to_one_digit(x).double() @ values.double().T
    scale = expected.abs().max().item()
    assert (reference.double() - expected).abs().max().item() / scale < 2e-6  # float32 sums of exact dots
    exact = x.double() @ values.double().T
    one_digit_error = (reference.double() - exact).abs().max().item() / scale
    two_digit_error = (exact_layer(x).double() - exact).abs().max().item() / scale
    assert 10 * two_digit_error < one_digit_error < 2e-2  # the low digit really is gone, and only it


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_every_build_gives_the_same_bits(type_name, digits, avx2_library, avx2_vnni_library, portable_library):
    layer, _ = held(type_name, 40, 512, seed=7, digits=digits)
    view = native.linear_view(layer)
    x = torch.randn(14, 512, generator=torch.Generator().manual_seed(8))  # passes of 4 rows and a remainder
    out = native.linear(view, x)
    assert torch.equal(native.linear(view, x, library=avx2_library), out)
    assert torch.equal(native.linear(view, x, library=portable_library), out)
    if avx2_vnni_library is not None:  # vpdpbusd on 256 bits, where the CPU has it
        assert torch.equal(native.linear(view, x, library=avx2_vnni_library), out)


# Where each type's block keeps its codes (the bytes past its scales): set to all ones, every code
# is the largest (15, 31 or 63), the worst case of the AVX2 kernels' 16-bit sums.
CODE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144),
              "Q5_K": (16, 176), "Q6_K": (0, 192)}


@pytest.mark.parametrize("rows", [1, 5])  # one row (both halves of a row block at once), a pass and one more
@pytest.mark.parametrize("type_name", sorted(CODE_BYTES))
def test_the_largest_codes_and_digits_stay_exact_on_every_build(type_name, rows, avx2_library, portable_library):
    """Every code at its largest against inputs whose two digits are near their largest (126.5 =
    126 + 64/128: high digit 126, low digit 64, the scale 1 set by a 127 in each group): the AVX2
    kernels sum up to 8, 4 or 2 high-digit and 17, 8 or 4 low-digit vpmaddubsw results of 4-, 5-
    and 6-bit codes in 16-bit lanes; an overflow would change the bits and the product (high-digit
    runs one term longer fail here for the 5- and 6-bit types)."""
    first, last = CODE_BYTES[type_name]
    blocks = random_rows(type_name, 48, 512, seed=11)
    values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = blocks.reshape(48, 512 // values, block_bytes)  # (N, blocks, bytes)
    blocks[:, :, first:last] = 0xFF
    blocks = blocks.reshape(48, -1)
    layer = NativeQuantLinear.from_gguf(type_name, torch.from_numpy(blocks.copy()), 512)
    weights = gguf_values(type_name, blocks, 512)
    assert weights.amax().item() > 0
    x = torch.full((rows, 512), 126.5)
    x[:, ::32] = 127.0  # each group's largest: scale 1, the digits exact
    x[-1] *= -1.0  # the last row's digits all negative
    view = native.linear_view(layer)
    out = native.linear(view, x)
    assert torch.equal(native.linear(view, x, library=avx2_library), out)
    assert torch.equal(native.linear(view, x, library=portable_library), out)
    expected = x.double() @ weights.double().T
    assert (out.double() - expected).abs().max().item() / expected.abs().max().item() < 2e-6


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q5_K", "Q8_0"])
def test_the_bits_do_not_depend_on_the_compilers_vector_width(type_name, digits, narrow_vectors_library):
    """The activations' group sums (the min terms of Q4_1 and the K-quants) are added in one written
    order: an `omp simd` reduction, whose order followed the vector width GCC preferred, gave the
    AVX2 and the native build different bits on AMD Zen 5 (16 lanes there, 8 on Intel)."""
    layer, _ = held(type_name, 40, 512, seed=9, digits=digits)
    view = native.linear_view(layer)
    x = torch.randn(14, 512, generator=torch.Generator().manual_seed(10))
    assert torch.equal(native.linear(view, x, library=narrow_vectors_library), native.linear(view, x))


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_tiles_take_the_files_bytes(type_name):
    n, k = 64, 1024
    rows = random_rows(type_name, n, k)
    layer = NativeQuantLinear.from_gguf(type_name, torch.from_numpy(rows.copy()), k)
    assert rows.nbytes <= layer.weight.numel() <= 1.04 * rows.nbytes  # K-quants' unpacked 6-bit scales: +3%


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "F16", "BF16"])
def test_stacked_parts_equal_the_parts(type_name):
    k = 256
    if type_name in ("F16", "BF16"):
        dtype = torch.float16 if type_name == "F16" else torch.bfloat16
        parts = [NativeQuantLinear.from_gguf(type_name, torch.randn(n, k).to(dtype).view(torch.uint8), k)
                 for n in (32, 16, 24)]
    else:
        parts = [held(type_name, n, k, seed=n)[0] for n in (32, 16, 24)]
    stacked = NativeQuantLinear.concat(parts)
    x = torch.randn(3, k)
    assert torch.equal(stacked(x), torch.cat([p(x) for p in parts], dim=-1))
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert NativeQuantLinear.concat([parts[2], parts[0]]) is None or type_name in ("F16", "BF16")  # 24 rows: not whole tiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_rows_one_arithmetic_for_any_row_count(dtype):
    weight = torch.randn(37, 200).to(dtype)
    name = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    layer = NativeQuantLinear.from_gguf(name, weight.view(torch.uint8).reshape(37, -1), 200)
    x = torch.randn(9, 200)
    out = layer(x)
    assert torch.equal(out, torch.cat([layer(x[i:i + 1]) for i in range(9)]))
    torch.testing.assert_close(out, x @ weight.float().T, atol=1e-4, rtol=1e-4)


def test_engine_int8_formats_hold_the_same_weights():
    weight = torch.randn(80, 128)
    for module in (Int8Linear.from_float(weight), Int8GroupedLinear.from_float(weight)):
        tiled = native_module(module)
        assert tiled.weights_name == "int8"
        assert torch.equal(tiled.dequantize(), module.dequantize().float())
        x = torch.randn(4, 128)
        expected = x.double() @ module.dequantize().double().T
        assert (tiled(x).double() - expected).abs().max() <= 2e-4 * expected.abs().max()


def test_gguf_rows_of_other_widths_are_refused():
    from hybridllm.errors import ConfigError

    assert not NativeQuantLinear.supports("Q4_K", 320) and NativeQuantLinear.supports("Q4_0", 320)
    assert not NativeQuantLinear.supports("Q2_K", 256)
    with pytest.raises(ConfigError, match="Q4_K"):
        NativeQuantLinear.from_gguf("Q4_K", torch.zeros(16, 180, dtype=torch.uint8), 320)
