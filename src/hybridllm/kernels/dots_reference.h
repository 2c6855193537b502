// The portable reference product of the tiled formats: plain C++ over qtypes.h's accessors.
//
// Self-contained. It is the kernel of CPUs without x86 vector extensions, and what the vector and
// tile kernels are checked against (tests/test_kernel_formats.py compares a portable build with
// the AVX2 and AVX-512 builds bit for bit). The arithmetic is qtypes.h's, step for step.
#pragma once

#include <cmath>
#include <cstdint>

#include "activations.h"
#include "qtypes.h"

namespace hl {

// The exact integer dots of one weight row's group against one input row's digits: D_a over
// inputs 0-15, D_b over 16-31, each sum w (128 q + q_low) with w = u - offset.
inline void group_dots_reference(const TypeLayout& t, const uint8_t* codes, int64_t n, const InputRow& a, int64_t g,
                                 int32_t& d_a, int32_t& d_b) {
  const int8_t* high = a.high(g);
  const int8_t* low = a.low(g);
  int32_t half[2] = {0, 0};
  for (int64_t i = 0; i < GROUP; ++i) {
    const int32_t u = code_at(t, codes, n, i);
    half[i / 16] += u * (128 * high[i] + low[i]);
  }
  d_a = half[0] - t.offset * a.digit_sums[2 * g];
  d_b = half[1] - t.offset * a.digit_sums[2 * g + 1];
}

// out[m * n_out + n] for input rows [m0, m1) and the n_valid rows of one row block (`tiles`: its
// first tile, n_tiles of them); row_scales: the block's rows' scales (FORMAT_I8_ROWS) or null.
inline void tiled_rows_reference(const TypeLayout& t, const uint8_t* tiles, int64_t n_tiles, const InputRows& acts,
                                 int64_t m0, int64_t m1, float* out, int64_t n_out, int n_valid,
                                 const float* row_scales) {
  for (int64_t m = m0; m < m1; ++m) {
    const InputRow a = acts.row(m);
    for (int n = 0; n < n_valid; ++n) {
      float acc = 0.0f;
      for (int64_t s = 0; s < n_tiles; ++s) {
        const uint8_t* tile = tiles + s * t.tile_bytes();
        for (int64_t gi = 0; gi < t.groups(); ++gi) {
          const int64_t g = s * t.groups() + gi;
          int32_t d_a, d_b;
          group_dots_reference(t, group_codes(t, tile, gi), n, a, g, d_a, d_b);
          const GroupScales scales = scales_at(t, tile, gi, n);
          const float ds = a.dot_scales[g];
          if (t.halves()) {
            acc = std::fma(static_cast<float>(d_a), scales.scale * ds, acc);
            acc = std::fma(static_cast<float>(d_b), scales.scale_b * ds, acc);
          } else {
            acc = std::fma(static_cast<float>(d_a + d_b), scales.scale * ds, acc);
            if (t.has_min()) acc = std::fma(scales.min, a.sums[g], acc);
          }
        }
      }
      out[m * n_out + n] = row_scales != nullptr ? acc * row_scales[n] : acc;
    }
  }
}

}  // namespace hl
