// AMX (Intel Sapphire Rapids and later): the tiled formats' integer dots of many input rows on
// tile registers.
//
// Self-contained; its contents exist only where the build targets AMX-INT8 (HL_AMX). A tile
// multiply (TDPBSUD: signed input digits x unsigned weight codes) gives the exact int32 dots of 16
// input rows against 16 weight rows over a group of 32 inputs (or 16 of them, for Q6_K's halves):
// the integers the vector kernels compute one input row at a time. The float steps after them are
// the 512-bit kernel's own (dots_avx512.h: float_steps), so a row's result is the same bits
// whether its batch ran on tiles or on vectors: the tiles only decide how fast a batch (or a
// prefill chunk) goes. Used only once Linux has granted this process the tile state
// (arch_prctl); hl_set_amx(0) turns them off (the tests compare both ways).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "activations.h"
#include "common.h"
#include "dots_avx512.h"
#include "dots_panels.h"
#include "qtypes.h"

#if HL_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hl {

// The fewest input rows worth the tiles (fewer: the vector kernels), the measured crossover: a
// pass unpacks the codes and runs whole 16-row tiles however few rows are valid.
constexpr int64_t AMX_MIN_ROWS = 10;

#if HL_AMX
namespace amx {

// Whether Linux lets this process use the tile registers (asked once; granted for the process).
inline bool granted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

inline std::atomic<bool> enabled{true};

inline bool usable() { return enabled.load(std::memory_order_relaxed) && granted(); }

// The tiles (macros: the intrinsics paste the number into the instruction).
#define HL_DOTS_HIGH 0      // 16 x 16 int32 dots of the high digits
#define HL_DOTS_LOW 1       // ... of the low digits
#define HL_INPUT_HIGH 2     // 16 input rows x 32 (or 16) high digits: the A operand
#define HL_INPUT_LOW 3      // ... low digits
#define HL_QUADS 4          // 8 (or 4) quads x 16 rows x 4 bytes: the B operand
#define HL_DOTS_HIGH_ODD 5  // the dots of odd groups (or of the second half): a group's multiplies overlap
#define HL_DOTS_LOW_ODD 6   // the previous one's float steps

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig& shape(std::initializer_list<int> tiles, int rows_, int bytes) {
    for (int t : tiles) rows[t] = static_cast<uint8_t>(rows_), bytes_per_row[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// Load the tile shapes for groups of `inputs` (32, or 16 for halves): at every pass, since other
// code on this thread (oneDNN's) may have loaded its own between two products.
inline void configure(int inputs) {
  static const TileConfig whole = TileConfig()
      .shape({HL_DOTS_HIGH, HL_DOTS_LOW, HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD}, TILE_M, 64)
      .shape({HL_INPUT_HIGH, HL_INPUT_LOW}, TILE_M, GROUP)
      .shape({HL_QUADS}, GROUP / 4, 64);
  static const TileConfig halves = TileConfig()
      .shape({HL_DOTS_HIGH, HL_DOTS_LOW, HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD}, TILE_M, 64)
      .shape({HL_INPUT_HIGH, HL_INPUT_LOW}, TILE_M, GROUP / 2)
      .shape({HL_QUADS}, GROUP / 8, 64);
  _tile_loadconfig(inputs == GROUP ? &whole : &halves);
}

// Whether a format's unpacked codes are stored less its offset, as signed bytes (w = u - offset:
// IQ4's table values, Q6_K's -32 .. 31, Q8_0's int8 ...), multiplied by TDPBSSD: the tile's dots
// are then the exact sums of w . digits that the vector kernels reach by subtracting the offset
// times the digit sums, so the float steps skip that subtraction (two per row and half for Q6_K).
template <int32_t F>
constexpr bool CENTERED = layout_of(F).offset != 0;

// A group's float steps for the 16 input rows of a tile: `dots` its (high, low) digit tiles
// stored as [2][16 rows][16 lanes] (the first half's, and for halves the second's), `unpacked`
// the group's scales, `rows` the input rows' tile params (activations.h: tile_params).
template <int32_t F>
__attribute__((always_inline)) inline void group_float_steps(__m512 (&acc)[TILE_M], const int32_t (*dots)[TILE_M * 16],
                                                             const int32_t (*dots_b)[TILE_M * 16],
                                                             const uint8_t* unpacked, const float* rows) {
  const float* scale_vectors = reinterpret_cast<const float*>(unpacked + 8 * QUAD_BYTES);
  const avx512::Scales16 s{_mm512_load_ps(scale_vectors), _mm512_load_ps(scale_vectors + 16),
                           _mm512_load_ps(scale_vectors + 32)};
  const int32_t* digit_sums = reinterpret_cast<const int32_t*>(rows + 2 * TILE_M);
#pragma GCC unroll 16
  for (int r = 0; r < TILE_M; ++r) {
    const __m512i a = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[0] + 16 * r), 7),
                                       _mm512_load_si512(dots[1] + 16 * r));
    const __m512i b = dots_b == nullptr ? _mm512_setzero_si512()
                                        : _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots_b[0] + 16 * r), 7),
                                                           _mm512_load_si512(dots_b[1] + 16 * r));
    const int32_t sums[2] = {digit_sums[r], digit_sums[TILE_M + r]};
    acc[r] = avx512::float_steps<F, CENTERED<F>>(acc[r], a, b, s, rows[r], rows[TILE_M + r], sums);
  }
}

// Unpacked quads and scales of the weight row blocks that one pass keeps warm in L2 beside an input
// tile (Sapphire Rapids: 2 MiB of L2 per core): each 16-input-row tile's digits of a pass's groups
// are read from memory once per pass, then served from L2 to every row block of the pass (K =
// 14336: 184 groups of 8 blocks a pass, each input tile read once per pass, once per call in all).
constexpr int64_t PASS_UNPACKED_BYTES = 1 << 20;

// One pass for one row block and 16 input rows (from m0): groups first .. first + span - 1 of the
// block's unpacked quads and scales (`unpacked`: the pass's groups in order), the accumulators
// starting from `out` (the earlier passes' sums) or from zero on the first pass, stored back to
// `out` (rows m0 .., n_valid weight rows); `row_scales` (the block's, ROW formats) on the last pass.
template <int32_t F>
void pass_block(const uint8_t* unpacked, int64_t first, int64_t span, const InputRows& acts, int64_t m0, float* out,
                int64_t n_out, int n_valid, const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t GROUP_BYTES = TILE_M * DIGIT_BYTES;  // a group's digits of a block's 16 rows
  const int64_t block = m0 / TILE_M;
  const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
  const int64_t rows = std::min<int64_t>(TILE_M, acts.rows() - m0);
  // acc stays in registers only if every index is a constant: the loops over it run to TILE_M, unrolled
  __m512 acc[TILE_M];
#pragma GCC unroll 16
  for (int r = 0; r < TILE_M; ++r)
    acc[r] = first == 0 || r >= rows ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(valid, out + (m0 + r) * n_out);
  // group g of the pass (0 .. span - 1) is the inputs' group first + g: its 16 rows' digits, 64
  // bytes apart, and its tile figures
  const int8_t* high = acts.tile_digits(block) + first * GROUP_BYTES;
  const int8_t* low = high + GROUP;
  const auto params = [&](int64_t g) { return acts.tile_params(block, first + g); };
  // a tile multiply of 16 input rows' digits by the quads: signed x signed for centered codes
#define HL_TILE_DOTS(DOTS, INPUT)                                                                    \
  do {                                                                                               \
    if constexpr (CENTERED<F>) _tile_dpbssd(DOTS, INPUT, HL_QUADS); else _tile_dpbsud(DOTS, INPUT, HL_QUADS); \
  } while (0)
  if constexpr (T.halves()) {
    // Group g's four multiplies (two halves of 16 inputs, two digits each) into four dot tiles,
    // then the float steps of group g - 1, then the stores of group g into the ring's slot g % 2:
    // the float steps read dots stored an iteration ago while the tiles multiply.
    alignas(64) int32_t ring[2][2][2][TILE_M * 16];  // [group % 2][half][digit]
#define HL_HALF_MULTIPLY(HIGH, LOW, g, half)                                                        \
  do {                                                                                               \
    _tile_loadd(HL_INPUT_HIGH, high + (g) * GROUP_BYTES + 16 * (half), DIGIT_BYTES);                 \
    _tile_loadd(HL_INPUT_LOW, low + (g) * GROUP_BYTES + 16 * (half), DIGIT_BYTES);                   \
    _tile_loadd(HL_QUADS, unpacked + (g) * UNPACKED_GROUP + 4 * (half) * QUAD_BYTES, QUAD_BYTES);    \
    _tile_zero(HIGH);                                                                                \
    _tile_zero(LOW);                                                                                 \
    HL_TILE_DOTS(HIGH, HL_INPUT_HIGH);                                                               \
    HL_TILE_DOTS(LOW, HL_INPUT_LOW);                                                                 \
  } while (0)
#define HL_HALVES_STEPS(g) \
  group_float_steps<F>(acc, ring[(g) % 2][0], ring[(g) % 2][1], unpacked + (g) * UNPACKED_GROUP, params(g))
    for (int64_t g = 0; g < span; ++g) {
      HL_HALF_MULTIPLY(HL_DOTS_HIGH, HL_DOTS_LOW, g, 0);  // inputs 0 .. 15: quads 0 .. 3
      HL_HALF_MULTIPLY(HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD, g, 1);  // inputs 16 .. 31: quads 4 .. 7
      if (g >= 1) HL_HALVES_STEPS(g - 1);
      _tile_stored(HL_DOTS_HIGH, ring[g % 2][0][0], 64);
      _tile_stored(HL_DOTS_LOW, ring[g % 2][0][1], 64);
      _tile_stored(HL_DOTS_HIGH_ODD, ring[g % 2][1][0], 64);
      _tile_stored(HL_DOTS_LOW_ODD, ring[g % 2][1][1], 64);
    }
    HL_HALVES_STEPS(span - 1);  // span >= 1
#undef HL_HALF_MULTIPLY
#undef HL_HALVES_STEPS
  } else {
    alignas(64) int32_t ring[4][2][TILE_M * 16];  // [group % 4][digit]
// Group g's tile multiplies into a pair of dot tiles (even groups the first pair, odd ones the
// second), and the pair's store into the ring's slot g % 4. The float steps two groups behind run
// between the two: the dots they read were stored an iteration ago, so neither the multiply's
// latency nor the store's stands between a group's float steps and its dots.
#define HL_GROUP_MULTIPLY(HIGH, LOW, g)                                         \
  do {                                                                          \
    _tile_loadd(HL_INPUT_HIGH, high + (g) * GROUP_BYTES, DIGIT_BYTES);           \
    _tile_loadd(HL_INPUT_LOW, low + (g) * GROUP_BYTES, DIGIT_BYTES);             \
    _tile_loadd(HL_QUADS, unpacked + (g) * UNPACKED_GROUP, QUAD_BYTES);         \
    _tile_zero(HIGH);                                                           \
    _tile_zero(LOW);                                                            \
    HL_TILE_DOTS(HIGH, HL_INPUT_HIGH);                                          \
    HL_TILE_DOTS(LOW, HL_INPUT_LOW);                                            \
  } while (0)
#define HL_STORE_DOTS(HIGH, LOW, g)            \
  do {                                         \
    _tile_stored(HIGH, ring[(g) % 4][0], 64);  \
    _tile_stored(LOW, ring[(g) % 4][1], 64);   \
  } while (0)
#define HL_FLOAT_STEPS(g) group_float_steps<F>(acc, ring[(g) % 4], nullptr, unpacked + (g) * UNPACKED_GROUP, params(g))
    for (int64_t g = 0; g < span; g += 2) {
      HL_GROUP_MULTIPLY(HL_DOTS_HIGH, HL_DOTS_LOW, g);
      if (g >= 2) HL_FLOAT_STEPS(g - 2);
      HL_STORE_DOTS(HL_DOTS_HIGH, HL_DOTS_LOW, g);
      if (g + 1 < span) {
        HL_GROUP_MULTIPLY(HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD, g + 1);
        if (g >= 1) HL_FLOAT_STEPS(g - 1);
        HL_STORE_DOTS(HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD, g + 1);
      }
    }
    for (int64_t g = span >= 2 ? span - 2 : 0; g < span; ++g) HL_FLOAT_STEPS(g);
#undef HL_GROUP_MULTIPLY
#undef HL_STORE_DOTS
#undef HL_FLOAT_STEPS
  }
#undef HL_TILE_DOTS
  const __m512 scales_of_rows = row_scales != nullptr ? _mm512_maskz_loadu_ps(valid, row_scales) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < TILE_M; ++r) {
    if (r >= rows) break;
    if (row_scales != nullptr) acc[r] = _mm512_mul_ps(acc[r], scales_of_rows);
    _mm512_mask_storeu_ps(out + (m0 + r) * n_out, valid, acc[r]);
  }
}

// Weight rows [0, n_rows) of a tiled format (row blocks of 16 from `tiles`, n_tiles tiles each,
// the last one possibly partial) for every input row, in passes over spans of the groups: a
// pass's groups of every block unpacked once (quads and scales), then per 16 input rows and per
// block the tile multiplies of the two digits and the float steps on each input row's 16 dots.
// An output's accumulator goes through `out` between passes and continues where it stopped: the
// float steps run group after group as in one pass, so the bits do not depend on the passes.
template <int32_t F>
void tiled_rows(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, float* out, int64_t n_out, int64_t n_rows,
                const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t GROUPS_PER_TILE = T.groups();
  const int64_t groups = n_tiles * GROUPS_PER_TILE;
  const int64_t n_blocks = (n_rows + TILE_M - 1) / TILE_M;
  const int64_t pass_groups = std::min(groups, groups_per_pass(n_blocks, GROUPS_PER_TILE, PASS_UNPACKED_BYTES));
  thread_local AlignedScratch scratch;
  uint8_t* unpacked_blocks = scratch.get(n_blocks * pass_groups * UNPACKED_GROUP);
  for (int64_t first = 0; first < groups; first += pass_groups) {
    const int64_t span = std::min(pass_groups, groups - first);  // this pass's groups: first .. first + span - 1
    unpack_panel<F, CENTERED<F>>(tiles, n_tiles, first, span, n_blocks, unpacked_blocks);
    const bool last_pass = first + span == groups;
    configure(T.halves() ? GROUP / 2 : GROUP);  // once per pass (a load of the config costs ~4% of a prefill)
    for (int64_t m0 = 0; m0 < acts.rows(); m0 += TILE_M)
      for (int64_t b = 0; b < n_blocks; ++b)
        pass_block<F>(unpacked_blocks + b * span * UNPACKED_GROUP, first, span, acts, m0, out + b * TILE_M, n_out,
                      static_cast<int>(std::min<int64_t>(TILE_M, n_rows - b * TILE_M)),
                      last_pass && T.scales == Scales::ROW ? row_scales + b * TILE_M : nullptr);
  }
}

#undef HL_DOTS_HIGH
#undef HL_DOTS_LOW
#undef HL_INPUT_HIGH
#undef HL_INPUT_LOW
#undef HL_QUADS
#undef HL_DOTS_HIGH_ODD
#undef HL_DOTS_LOW_ODD

}  // namespace amx

inline bool amx_usable() { return amx::usable(); }
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace hl
