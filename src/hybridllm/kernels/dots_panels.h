// Products of many input rows on 512-bit registers without AMX (AVX-512 VNNI): the input rows in
// the lanes, the weight codes broadcast from unpacked panels.
//
// Self-contained; the panels (unpack_panel, also the AMX kernels' B operands) exist where the
// build targets AVX-512 VNNI (HL_AVX512_VNNI). The row kernels (dots_avx512.h) hold 16 weight rows
// in a register's lanes and broadcast each input row's quad of digits: one broadcast per vpdpbusd.
// Here a register holds one quad of 16 input rows (activations.h, DigitLayout::QUADS) and a weight
// row's quad of codes is broadcast (vpdpbusd: its unsigned operand) to 16 input rows at once,
// against each of the step's input registers (2 or 4 blocks of 16 rows): one broadcast per 4
// vpdpbusd, the input registers read once per PANEL_STEP weight rows, and the codes unpacked once
// per pass for every input row (not once per four). The integer dots are the same exact sums; the
// float steps are qtypes.h's, the same operations on the same values in the other orientation
// (a lane is an input row, a weight row's scale and min broadcast): the same bits as every kernel.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "common.h"
#include "dots_avx512.h"
#include "qtypes.h"

namespace hl {

// The fewest input rows that take the panels (fewer: the row kernels, four rows per unpacking).
// AMD Zen 5, 4096 x 4096 weights, 2 threads, panels against the row kernels: at 64 rows Q4_K
// 0.98x (two digits) and 1.10x (one), Q6_K 1.16x and 1.22x; at 32 and 48 rows one digit's Q4_K
// 0.81x (fewer input blocks than a step takes: one block at a time).
constexpr int64_t PANEL_MIN_ROWS = 64;

// Whether the panels are on (hl_set_panels: off, the row kernels give the same results).
inline std::atomic<bool> panels_enabled{true};

inline bool panels_usable() { return HL_AVX512_VNNI && panels_enabled.load(std::memory_order_relaxed); }

// 64-byte aligned scratch that only grows (one per thread).
struct AlignedScratch {
  std::vector<uint8_t> storage;
  uint8_t* get(size_t bytes) {
    if (storage.size() < bytes + 64) storage.resize(bytes + 64);
    return storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  }
};

// One group of one row block unpacked: its 8 quads (16 rows x 4 codes each), then its scale,
// scale_b and min as 16 floats each.
constexpr int64_t QUAD_BYTES = 64;
constexpr int64_t UNPACKED_GROUP = 8 * QUAD_BYTES + 3 * 64;

// Groups per pass for `n_blocks` row blocks whose unpacked groups take at most `budget` bytes (a
// whole number of tiles of `groups_per_tile`, at least one).
inline int64_t groups_per_pass(int64_t n_blocks, int64_t groups_per_tile, int64_t budget) {
  const int64_t tiles = budget / (n_blocks * groups_per_tile * UNPACKED_GROUP);
  return std::max<int64_t>(1, tiles) * groups_per_tile;
}

#if HL_AVX512_VNNI
// Groups first .. first + span - 1 of row blocks [0, n_blocks) (each n_tiles tiles of format F
// from `tiles`) unpacked into `panel`: block b's group g at (b span + g) UNPACKED_GROUP. CENTER:
// the codes less the format's offset, as signed bytes (the AMX kernels' signed multiplies).
template <int32_t F, bool CENTER>
void unpack_panel(const uint8_t* tiles, int64_t n_tiles, int64_t first, int64_t span, int64_t n_blocks,
                  uint8_t* panel) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t GROUPS_PER_TILE = T.groups();
  for (int64_t b = 0; b < n_blocks; ++b) {
    for (int64_t g = 0; g < span; ++g) {
      const int64_t s = b * n_tiles + (first + g) / GROUPS_PER_TILE;  // the blocks' tiles lie one after another
      const uint8_t* tile = tiles + s * T.tile_bytes();
      const int64_t gi = (first + g) % GROUPS_PER_TILE;
      uint8_t* group = panel + (b * span + g) * UNPACKED_GROUP;
      __m512i q[8];
      avx512::unpack_quads<F>(group_codes(T, tile, gi), q);
      for (int i = 0; i < 8; ++i) {
        if constexpr (CENTER) q[i] = _mm512_sub_epi8(q[i], _mm512_set1_epi8(static_cast<char>(T.offset)));
        _mm512_store_si512(group + i * QUAD_BYTES, q[i]);
      }
      const avx512::Scales16 scales = avx512::group_scales<F>(tile, gi);
      float* vectors = reinterpret_cast<float*>(group + 8 * QUAD_BYTES);
      _mm512_store_ps(vectors, scales.scale);
      _mm512_store_ps(vectors + 16, scales.scale_b);
      _mm512_store_ps(vectors + 32, scales.min);
    }
  }
}

namespace panels {
// Input blocks of 16 rows per step: two digits' 2 x PANEL_STEP x 2 int32 sums, one digit's 4 x
// PANEL_STEP x 1, beside the step's PANEL_STEP broadcast codes and an input register (of 32).
// Measured on Mistral-shaped prefills (AMD Zen 5): one digit with 3 blocks 1.05x the row
// kernels, 4 blocks 1.08x, 6 blocks 0.93x (spilled); two digits with 3 blocks slower than 2.
constexpr int EXACT_VECTORS = 2, ONE_DIGIT_VECTORS = 4;

// The unpacked groups of one pass's row blocks: kept in the second-level cache beside the input
// rows' digits (AMD Zen 5: 1 MiB of L2 per core).
constexpr int64_t PASS_PANEL_BYTES = 384 << 10;
constexpr int PANEL_STEP = 4;  // weight rows per step
constexpr int panel_vectors(int digits) { return digits == 2 ? EXACT_VECTORS : ONE_DIGIT_VECTORS; }

// One row block (`unpacked`: its pass's groups) against MV blocks of 16 input rows from block mb,
// groups first .. first + span - 1, group by group (the group's input digits stay in the first-level
// cache for its PANEL_STEP weight rows at a time): the float sums of weight row n and input block
// mb + v at sums + v sums_stride + 16 n (lanes: the input rows), from zero on the first pass, else
// from the earlier passes' sums.
template <int32_t F, int DIGITS, int MV>
void block_rows(const uint8_t* unpacked, int64_t first, int64_t span, const InputRows& acts, int64_t mb, float* sums,
                int64_t sums_stride) {
  constexpr TypeLayout T = layout_of(F);
  if (first == 0)
    for (int v = 0; v < MV; ++v) std::memset(sums + v * sums_stride, 0, TILE_M * TILE_M * sizeof(float));
  for (int64_t g = 0; g < span; ++g) {
    const uint8_t* quads = unpacked + g * UNPACKED_GROUP;
    const float* scale_vectors = reinterpret_cast<const float*>(quads + 8 * QUAD_BYTES);
    const int8_t* digits[MV];
    const float* params[MV];  // the 16 input rows' dot scales, float sums, digit sums a and b (tile_params)
    for (int v = 0; v < MV; ++v) {
      digits[v] = acts.quad_digits(mb + v, first + g);
      params[v] = acts.tile_params(mb + v, first + g);
    }
#pragma GCC unroll 1
    for (int n0 = 0; n0 < TILE_M; n0 += PANEL_STEP) {
      // The dots of quads [FIRST, FIRST + N), then the float steps on them: HALF 0 or 1 for halves
      // types (scale or scale_b, the digit sums of that half), -1 for the whole group.
      const auto quads_then_steps = [&](auto first_quad, auto count, auto half) {
        constexpr int FIRST = decltype(first_quad)::value, N = decltype(count)::value, HALF = decltype(half)::value;
        __m512i high[MV][PANEL_STEP], low[MV][PANEL_STEP];
        for (int v = 0; v < MV; ++v)
          for (int n = 0; n < PANEL_STEP; ++n) high[v][n] = low[v][n] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = FIRST; i < FIRST + N; ++i) {
          __m512i codes[PANEL_STEP];
          for (int n = 0; n < PANEL_STEP; ++n)
            codes[n] = _mm512_set1_epi32(
                avx512::quad_bits(reinterpret_cast<const int8_t*>(quads + i * QUAD_BYTES) + 4 * (n0 + n)));
          for (int v = 0; v < MV; ++v) {
            // one load for the PANEL_STEP dots (GCC would fold it into each vpdpbusd: a load per dot)
            __m512i x_high = _mm512_loadu_si512(digits[v] + i * QUAD_BYTES);
            asm("" : "+v"(x_high));
            for (int n = 0; n < PANEL_STEP; ++n) high[v][n] = _mm512_dpbusd_epi32(high[v][n], codes[n], x_high);
            if constexpr (DIGITS == 2) {
              __m512i x_low = _mm512_loadu_si512(digits[v] + (8 + i) * QUAD_BYTES);
              asm("" : "+v"(x_low));
              for (int n = 0; n < PANEL_STEP; ++n) low[v][n] = _mm512_dpbusd_epi32(low[v][n], codes[n], x_low);
            }
          }
        }
        const float* scales = scale_vectors + (HALF == 1 ? 16 : 0);
        for (int v = 0; v < MV; ++v) {
          const __m512 dot_scales = _mm512_loadu_ps(params[v]);
          const int32_t* digit_sums = reinterpret_cast<const int32_t*>(params[v] + 2 * TILE_M);
          // OFFSET (S_a + S_b), or of one half (the offset's terms of unsigned codes)
          __m512i offset = _mm512_setzero_si512();
          if constexpr (T.offset != 0) {
            const __m512i sums_a = _mm512_loadu_si512(digit_sums), sums_b = _mm512_loadu_si512(digit_sums + TILE_M);
            const __m512i counted = HALF == 0 ? sums_a : HALF == 1 ? sums_b : _mm512_add_epi32(sums_a, sums_b);
            offset = _mm512_mullo_epi32(counted, _mm512_set1_epi32(T.offset));
          }
          for (int n = 0; n < PANEL_STEP; ++n) {
            float* acc = sums + v * sums_stride + (n0 + n) * 16;  // (the float sums wait in memory during the dots)
            __m512 sum = _mm512_load_ps(acc);
            __m512i d = _mm512_slli_epi32(high[v][n], 7);
            if constexpr (DIGITS == 2) d = _mm512_add_epi32(d, low[v][n]);
            if constexpr (T.offset != 0) d = _mm512_sub_epi32(d, offset);
            const __m512 scale = _mm512_set1_ps(scales[n0 + n]);  // weight row n0 + n's, times each row's dot scale
            sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(scale, dot_scales), sum);
            if constexpr (T.has_min()) {  // its min times each input row's float sum
              const __m512 min = _mm512_set1_ps(scale_vectors[32 + n0 + n]);
              sum = _mm512_fmadd_ps(min, _mm512_loadu_ps(params[v] + TILE_M), sum);
            }
            _mm512_store_ps(acc, sum);
          }
        }
      };
      using I0 = std::integral_constant<int, 0>;
      using I4 = std::integral_constant<int, 4>;
      if constexpr (T.halves()) {
        quads_then_steps(I0{}, I4{}, std::integral_constant<int, 0>{});
        quads_then_steps(I4{}, I4{}, std::integral_constant<int, 1>{});
      } else {
        quads_then_steps(I0{}, std::integral_constant<int, 8>{}, std::integral_constant<int, -1>{});
      }
    }
  }
}

// Weight rows [0, n_rows) of a tiled format (row blocks of 16 from `tiles`, n_tiles tiles each,
// the last one possibly partial) for every input row of `acts` (DigitLayout::QUADS), into out (m,
// n) for n < n_rows; row_scales: the rows' scales of FORMAT_I8_ROWS. In passes over spans of the
// groups (their codes of every row block unpacked once per pass); each output's float sum runs
// group after group across the passes through a scratch of [row block][input block][n][16]. The
// input blocks go panel_vectors at a time, the last few 2 or 1 at a time.
template <int32_t F, int DIGITS>
void rows(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, float* out, int64_t n_out, int64_t n_rows,
          const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  const int64_t groups = n_tiles * T.groups();
  const int64_t n_blocks = (n_rows + TILE_M - 1) / TILE_M, m_blocks = acts.padded_rows() / TILE_M;
  const int64_t pass_groups = std::min(groups, groups_per_pass(n_blocks, T.groups(), PASS_PANEL_BYTES));
  thread_local AlignedScratch panel_scratch, sums_scratch;
  uint8_t* panel = panel_scratch.get(n_blocks * pass_groups * UNPACKED_GROUP);
  constexpr int64_t BLOCK_SUMS = TILE_M * TILE_M;  // one input block's float sums of one row block
  float* sums = reinterpret_cast<float*>(sums_scratch.get(m_blocks * n_blocks * BLOCK_SUMS * sizeof(float)));
  const auto sums_of = [&](int64_t mb, int64_t b) { return sums + (b * m_blocks + mb) * BLOCK_SUMS; };
  for (int64_t first = 0; first < groups; first += pass_groups) {
    const int64_t span = std::min(pass_groups, groups - first);
    unpack_panel<F, false>(tiles, n_tiles, first, span, n_blocks, panel);
    for (int64_t mb = 0; mb < m_blocks;) {
      constexpr int MV = panel_vectors(DIGITS);
      const int mv = mb + MV <= m_blocks ? MV : mb + 2 <= m_blocks ? 2 : 1;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* unpacked = panel + b * span * UNPACKED_GROUP;
        const int64_t stride = BLOCK_SUMS;  // from input block mb to mb + 1
        if (mv == MV)
          block_rows<F, DIGITS, MV>(unpacked, first, span, acts, mb, sums_of(mb, b), stride);
        else if (mv == 2)
          block_rows<F, DIGITS, 2>(unpacked, first, span, acts, mb, sums_of(mb, b), stride);
        else
          block_rows<F, DIGITS, 1>(unpacked, first, span, acts, mb, sums_of(mb, b), stride);
      }
      mb += mv;
    }
  }
  for (int64_t mb = 0; mb < m_blocks; ++mb)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float* block = sums_of(mb, b);  // [n][16 input rows]
      const int64_t rows = std::min<int64_t>(TILE_M, acts.rows() - mb * TILE_M);
      const int64_t valid = std::min<int64_t>(TILE_M, n_rows - b * TILE_M);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out + (mb * TILE_M + r) * n_out + b * TILE_M;
        for (int64_t n = 0; n < valid; ++n)
          o[n] = T.scales == Scales::ROW ? block[n * TILE_M + r] * row_scales[b * TILE_M + n] : block[n * TILE_M + r];
      }
    }
}

}  // namespace panels
#endif

}  // namespace hl
