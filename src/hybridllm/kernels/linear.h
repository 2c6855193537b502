// x @ W.T for any weight format and any number of input rows, by a team: the one product every
// step runs (decode rows, batches, prefill chunks, the head).
//
// Self-contained. The output rows are shared out in items of PRODUCT_ROWS (whole 16-row tiles),
// claimed by the threads as they come; each item picks its kernel by the build (AVX-512 VNNI,
// AVX2, else the portable reference) and, for many input rows, AMX tiles where the CPU has them.
// Every kernel gives a row the same bits (qtypes.h, dots_float.h), so a row's result does not
// depend on the other rows, the thread that computes it, or the kernel chosen.
#pragma once

#include <cstdint>

#include "abi.h"
#include "activations.h"
#include "dots_amx.h"
#include "dots_avx2.h"
#include "dots_avx512.h"
#include "dots_float.h"
#include "dots_panels.h"
#include "dots_reference.h"
#include "qtypes.h"
#include "thread_team.h"

namespace hl {

// The output rows of a product are shared out in items of this many.
constexpr int64_t PRODUCT_ROWS = 128;

// From this many input rows a team prepares them together (each thread a share, then a
// barrier); fewer, each thread prepares them all itself (no barrier).
constexpr int64_t SHARED_PREPARATION_ROWS = 64;

// Whether a product of `rows` input rows with format `format` runs on AMX tiles.
inline bool tile_product(int32_t format, int64_t rows) {
  return is_tiled(format) && rows >= AMX_MIN_ROWS && amx_usable();
}

// Whether it runs on the panels of the AVX-512 VNNI builds (dots_panels.h), where not on tiles.
inline bool panel_product(int32_t format, int64_t rows) {
  return panels_usable() && is_tiled(format) && rows >= PANEL_MIN_ROWS && !tile_product(format, rows);
}

#if HL_AVX512_VNNI
namespace isa = avx512;
#elif HL_AVX2
namespace isa = avx2;
#endif

#if HL_AVX512_VNNI || HL_AVX2
// Every input row of one row block by the build's vector kernel, in passes of ROWS_PER_PASS rows
// and then one row at a time; DIGITS: the input rows' digits per value.
template <int32_t F, int DIGITS>
void tiled_passes(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, float* out, int64_t n_out,
                  int n_valid, const float* row_scales) {
  constexpr int PASS = isa::ROWS_PER_PASS;
  int64_t m = 0;
  for (; m + PASS <= acts.rows(); m += PASS)
    isa::tiled_rows<F, PASS, DIGITS>(tiles, n_tiles, acts, m, out, n_out, n_valid, row_scales);
  for (; m < acts.rows(); ++m) isa::tiled_rows<F, 1, DIGITS>(tiles, n_tiles, acts, m, out, n_out, n_valid, row_scales);
}
#endif

// One row block (16 weight rows from `n`, n_valid of them real) of tiled format F for every input
// row, by the build's vector kernel (AMX tiles take whole passes of row blocks: tiled_range).
template <int32_t F>
void tiled_block(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, float* out, int64_t n_out, int n_valid,
                 const float* row_scales) {
#if HL_AVX512_VNNI || HL_AVX2
  if (acts.one_digit())  // the same dots without the zero low digits
    tiled_passes<F, 1>(tiles, n_tiles, acts, out, n_out, n_valid, row_scales);
  else
    tiled_passes<F, EXACT_DIGITS>(tiles, n_tiles, acts, out, n_out, n_valid, row_scales);
#else
  tiled_rows_reference(layout_of(F), tiles, n_tiles, acts, 0, acts.rows(), out, n_out, n_valid, row_scales);
#endif
}

template <int32_t F>
void tiled_range(const HLLinear& w, const InputRows& acts, float* out, int64_t n_out, int64_t n0, int64_t n1,
                 bool tiles_product) {
  constexpr TypeLayout T = layout_of(F);
  const int64_t n_tiles = w.in_features / T.super;
  const auto* base = static_cast<const uint8_t*>(w.weight);
  const auto* row_scales = static_cast<const float*>(w.scales);
#if HL_AMX
  if (tiles_product) {  // the item's row blocks together, in passes over spans of the inputs
    amx::tiled_rows<F>(base + (n0 / TILE_ROWS) * n_tiles * T.tile_bytes(), n_tiles, acts, out + n0, n_out, n1 - n0,
                       row_scales == nullptr ? nullptr : row_scales + n0);
    return;
  }
#else
  (void)tiles_product;
#endif
#if HL_AVX512_VNNI
  if (acts.layout() == DigitLayout::QUADS) {  // the item's row blocks together, input rows in the lanes
    if (acts.one_digit())
      panels::rows<F, 1>(base + (n0 / TILE_ROWS) * n_tiles * T.tile_bytes(), n_tiles, acts, out + n0, n_out, n1 - n0,
                         row_scales == nullptr ? nullptr : row_scales + n0);
    else
      panels::rows<F, EXACT_DIGITS>(base + (n0 / TILE_ROWS) * n_tiles * T.tile_bytes(), n_tiles, acts, out + n0, n_out,
                                    n1 - n0, row_scales == nullptr ? nullptr : row_scales + n0);
    return;
  }
#endif
  for (int64_t n = n0; n < n1; n += TILE_ROWS)
    tiled_block<F>(base + (n / TILE_ROWS) * n_tiles * T.tile_bytes(), n_tiles, acts, out + n, n_out,
                   static_cast<int>(std::min(TILE_ROWS, n1 - n)), row_scales == nullptr ? nullptr : row_scales + n);
}

// out[m * n_out + n] for n in [n0, n1) (n0 a multiple of 16) of x (rows, K) @ W.T + bias:
// `acts` the prepared rows (tiled formats), `x` the rows themselves (float formats).
inline void product_range(const HLLinear& w, const float* x, int64_t rows, const InputRows& acts, float* out,
                          int64_t n_out, int64_t n0, int64_t n1) {
  const bool tiles = tile_product(w.format, rows);
  switch (w.format) {
#define HL_TILED(F) \
  case F:           \
    tiled_range<F>(w, acts, out, n_out, n0, n1, tiles); \
    break;
    HL_TILED(FORMAT_Q4)
    HL_TILED(FORMAT_I8_ROWS)
    HL_TILED(FORMAT_I8_GROUPS)
    HL_TILED(FORMAT_Q4_0)
    HL_TILED(FORMAT_Q4_1)
    HL_TILED(FORMAT_Q5_0)
    HL_TILED(FORMAT_Q5_1)
    HL_TILED(FORMAT_Q8_0)
    HL_TILED(FORMAT_Q4_K)
    HL_TILED(FORMAT_Q5_K)
    HL_TILED(FORMAT_Q6_K)
    HL_TILED(FORMAT_IQ4_NL)
    HL_TILED(FORMAT_IQ4_XS)
#undef HL_TILED
    case FORMAT_F16:
      float_rows(static_cast<const Half*>(w.weight), x, rows, w.in_features, out, n_out, n0, n1);
      break;
    case FORMAT_BF16:
      float_rows(static_cast<const BFloat16*>(w.weight), x, rows, w.in_features, out, n_out, n0, n1);
      break;
    default:
      float_rows(static_cast<const float*>(w.weight), x, rows, w.in_features, out, n_out, n0, n1);
      break;
  }
  if (w.has_bias)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = n0; n < n1; ++n) out[m * n_out + n] += w.bias[n];
}

inline int64_t projection_outputs(const HLProjection& p) {
  int64_t n = 0;
  for (int32_t i = 0; i < p.n_parts; ++i) n += p.parts[i].out_features;
  return n;
}

inline HLProjection single(const HLLinear& w) {
  HLProjection p{};
  p.parts[0] = w;
  p.n_parts = 1;
  return p;
}

// out (rows, N) = x (rows, K) @ [W_0; W_1; ...].T for the parts of a projection, by the team: the
// input rows are prepared once (by each thread itself, or with many rows and a `shared` buffer by
// the team together), then every part's items are claimed from one count, then a barrier.
inline void linear_team(const Team& team, const HLProjection& p, const float* x, float* out, int64_t rows,
                        InputRows* shared = nullptr) {
  thread_local InputRows own;
  bool quantized = false, tiles = false, panel_rows = false;
  int32_t digits = EXACT_DIGITS;  // one preparation serves every part: the first quantized part's digits
  for (int32_t i = p.n_parts - 1; i >= 0; --i) {
    if (is_tiled(p.parts[i].format)) digits = p.parts[i].activation_digits;
    quantized |= is_tiled(p.parts[i].format);
    tiles |= tile_product(p.parts[i].format, rows);
    panel_rows |= panel_product(p.parts[i].format, rows);
  }
  const DigitLayout layout = tiles ? DigitLayout::TILES : panel_rows ? DigitLayout::QUADS : DigitLayout::ROWS;
  const int64_t k = p.parts[0].in_features;
  InputRows* acts = &own;
  if (quantized && shared != nullptr && rows >= SHARED_PREPARATION_ROWS) {
    acts = shared;
    if (team.thread == 0) shared->reset(x, rows, k, layout, digits);
    team.barrier();
    const Share blocks((rows + TILE_M - 1) / TILE_M, team);
    shared->fill(blocks.first * TILE_M, std::min(rows, blocks.last * TILE_M));
    team.barrier();
  } else if (quantized) {
    own.prepare(x, rows, k, layout, digits);
  }
  const int64_t n_out = projection_outputs(p);
  int64_t items = 0;
  for (int32_t i = 0; i < p.n_parts; ++i) items += (p.parts[i].out_features + PRODUCT_ROWS - 1) / PRODUCT_ROWS;
  for (int64_t item = team.claim(); item < items; item = team.claim()) {
    int64_t part = 0, first = item, column = 0;
    for (;; ++part) {
      const int64_t part_items = (p.parts[part].out_features + PRODUCT_ROWS - 1) / PRODUCT_ROWS;
      if (first < part_items) break;
      first -= part_items;
      column += p.parts[part].out_features;
    }
    const HLLinear& w = p.parts[part];
    product_range(w, x, rows, *acts, out + column, n_out, first * PRODUCT_ROWS,
                  std::min(w.out_features, (first + 1) * PRODUCT_ROWS));
  }
  team.barrier();
}

inline void linear_team(const Team& team, const HLLinear& w, const float* x, float* out, int64_t rows,
                        InputRows* shared = nullptr) {
  linear_team(team, single(w), x, out, rows, shared);
}

}  // namespace hl
