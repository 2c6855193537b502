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

// Load the tile shapes for groups of `inputs` (32, or 16 for halves): every call, since other
// code on this thread (oneDNN's) may have loaded its own.
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

// 64-byte aligned scratch that only grows (one per thread).
struct AlignedScratch {
  std::vector<uint8_t> storage;
  uint8_t* get(size_t bytes) {
    if (storage.size() < bytes + 64) storage.resize(bytes + 64);
    return storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  }
};

constexpr int64_t QUAD_BYTES = 64;
constexpr int64_t UNPACKED_GROUP = 8 * QUAD_BYTES + 3 * 64;  // quads, then scale, scale_b and min (16 floats each)

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
    acc[r] = avx512::float_steps<F>(acc[r], a, b, s, rows[r], rows[TILE_M + r], sums);
  }
}

// Unpacked quads and scales of the weight row blocks that one pass keeps warm in L2 beside an input
// tile (Sapphire Rapids: 2 MiB of L2 per core): each 16-input-row tile of digits is read from memory
// once per pass, not once per row block (K = 8192: 256 KiB per input tile, 180 KiB per row block).
constexpr int64_t PASS_UNPACKED_BYTES = 1 << 20;

// Row blocks per pass of `groups` groups each (at least one).
inline int64_t blocks_per_pass(int64_t groups) {
  return std::max<int64_t>(1, PASS_UNPACKED_BYTES / (groups * UNPACKED_GROUP));
}

// Weight rows [0, n_rows) of a tiled format (row blocks of 16 from `tiles`, n_tiles tiles each,
// the last one possibly partial) for every input row: every block's quads and scales unpacked
// once, then per 16 input rows, per block and per group the tile multiplies of the two digits and
// the float steps on each input row's 16 dots.
template <int32_t F>
void tiled_rows(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, float* out, int64_t n_out, int64_t n_rows,
                const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t GROUPS_PER_TILE = T.groups();
  const int64_t groups = n_tiles * GROUPS_PER_TILE;
  const int64_t n_blocks = (n_rows + TILE_M - 1) / TILE_M;
  thread_local AlignedScratch scratch;
  uint8_t* unpacked_blocks = scratch.get(n_blocks * groups * UNPACKED_GROUP);
  for (int64_t s = 0; s < n_blocks * n_tiles; ++s) {  // the blocks' tiles lie one after another
    const uint8_t* tile = tiles + s * T.tile_bytes();
    for (int64_t gi = 0; gi < GROUPS_PER_TILE; ++gi) {
      uint8_t* group = unpacked_blocks + (s * GROUPS_PER_TILE + gi) * UNPACKED_GROUP;
      __m512i q[8];
      avx512::unpack_quads<F>(group_codes(T, tile, gi), q);
      for (int i = 0; i < 8; ++i) _mm512_store_si512(group + i * QUAD_BYTES, q[i]);
      const avx512::Scales16 scales = avx512::group_scales<F>(tile, gi);
      float* vectors = reinterpret_cast<float*>(group + 8 * QUAD_BYTES);
      _mm512_store_ps(vectors, scales.scale);
      _mm512_store_ps(vectors + 16, scales.scale_b);
      _mm512_store_ps(vectors + 32, scales.min);
    }
  }
  constexpr int64_t GROUP_BYTES = TILE_M * DIGIT_BYTES;  // a group's digits of a block's 16 rows
  alignas(64) int32_t dots[2][2][TILE_M * 16];  // [half][digit] (Q6_K)
  alignas(64) int32_t ring[4][2][TILE_M * 16];  // [group % 4][digit]
  for (int64_t m0 = 0; m0 < acts.rows(); m0 += TILE_M)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* unpacked = unpacked_blocks + b * groups * UNPACKED_GROUP;
    const int n_valid = static_cast<int>(std::min<int64_t>(TILE_M, n_rows - b * TILE_M));
    const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
    const __m512 scales_of_rows =
        T.scales == Scales::ROW ? _mm512_maskz_loadu_ps(valid, row_scales + b * TILE_M) : _mm512_setzero_ps();
    const int8_t* high = acts.tile_digits(m0 / TILE_M);  // group g's 16 rows at TILE_M DIGIT_BYTES g, 64 bytes apart
    const int8_t* low = high + GROUP;
    __m512 acc[TILE_M];
    for (int r = 0; r < TILE_M; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t block = m0 / TILE_M;
    if constexpr (T.halves()) {
      configure(GROUP / 2);
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* quads = unpacked + g * UNPACKED_GROUP;
        for (int half = 0; half < 2; ++half) {  // inputs 16 half .. 16 half + 15: quads 4 half .. 4 half + 3
          _tile_loadd(HL_INPUT_HIGH, high + g * GROUP_BYTES + 16 * half, DIGIT_BYTES);
          _tile_loadd(HL_INPUT_LOW, low + g * GROUP_BYTES + 16 * half, DIGIT_BYTES);
          _tile_loadd(HL_QUADS, quads + 4 * half * QUAD_BYTES, QUAD_BYTES);
          _tile_zero(HL_DOTS_HIGH);
          _tile_zero(HL_DOTS_LOW);
          _tile_dpbsud(HL_DOTS_HIGH, HL_INPUT_HIGH, HL_QUADS);
          _tile_dpbsud(HL_DOTS_LOW, HL_INPUT_LOW, HL_QUADS);
          _tile_stored(HL_DOTS_HIGH, dots[half][0], 64);
          _tile_stored(HL_DOTS_LOW, dots[half][1], 64);
        }
        group_float_steps<F>(acc, dots[0], dots[1], quads, acts.tile_params(block, g));
      }
    } else {
      configure(GROUP);
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
    _tile_dpbsud(HIGH, HL_INPUT_HIGH, HL_QUADS);                                \
    _tile_dpbsud(LOW, HL_INPUT_LOW, HL_QUADS);                                  \
  } while (0)
#define HL_STORE_DOTS(HIGH, LOW, g)            \
  do {                                         \
    _tile_stored(HIGH, ring[(g) % 4][0], 64);  \
    _tile_stored(LOW, ring[(g) % 4][1], 64);   \
  } while (0)
#define HL_FLOAT_STEPS(g) \
  group_float_steps<F>(acc, ring[(g) % 4], nullptr, unpacked + (g) * UNPACKED_GROUP, acts.tile_params(block, g))
      for (int64_t g = 0; g < groups; g += 2) {
        HL_GROUP_MULTIPLY(HL_DOTS_HIGH, HL_DOTS_LOW, g);
        if (g >= 2) HL_FLOAT_STEPS(g - 2);
        HL_STORE_DOTS(HL_DOTS_HIGH, HL_DOTS_LOW, g);
        if (g + 1 < groups) {
          HL_GROUP_MULTIPLY(HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD, g + 1);
          if (g >= 1) HL_FLOAT_STEPS(g - 1);
          HL_STORE_DOTS(HL_DOTS_HIGH_ODD, HL_DOTS_LOW_ODD, g + 1);
        }
      }
      for (int64_t g = groups >= 2 ? groups - 2 : 0; g < groups; ++g) HL_FLOAT_STEPS(g);
#undef HL_GROUP_MULTIPLY
#undef HL_STORE_DOTS
#undef HL_FLOAT_STEPS
    }
    for (int64_t r = 0; r < TILE_M && m0 + r < acts.rows(); ++r) {
      if constexpr (T.scales == Scales::ROW) acc[r] = _mm512_mul_ps(acc[r], scales_of_rows);
      _mm512_mask_storeu_ps(out + (m0 + r) * n_out + b * TILE_M, valid, acc[r]);
    }
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
