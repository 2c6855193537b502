// Products with float weights (float32, float16, bfloat16 rows), any number of input rows.
//
// Self-contained. One arithmetic per (input row, weight row) whatever the tile shape around it:
// LANES partial sums, lane j accumulating inputs j, j + LANES, ... with fused multiply-adds in
// input order, then sum_lanes, then the inputs past the last whole vector one by one. So a
// prefill chunk's row gets the bits a one-row decode step gives it, alone or in any batch.
#pragma once

#include <cstdint>

#include "common.h"

namespace hl {

// out[m * n_out + n] = x_m . w_n for MT input rows (x, stride k) and NT weight rows (w, stride k).
template <int MT, int NT, typename T>
inline void float_tile(const float* x, const T* w, int64_t k, float* out, int64_t n_out) {
  f32xL acc[MT][NT] = {};
  const int64_t whole = k / LANES * LANES;
  for (int64_t i = 0; i < whole; i += LANES) {
    f32xL wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = load_lanes(w + n * k + i);
    for (int m = 0; m < MT; ++m) {
      const f32xL xv = load<f32xL>(x + m * k + i);
      for (int n = 0; n < NT; ++n) acc[m][n] = fma_lanes(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = sum_lanes(acc[m][n]);
      for (int64_t i = whole; i < k; ++i) s = std::fma(x[m * k + i], to_float(w[n * k + i]), s);
      out[m * n_out + n] = s;
    }
}

#if defined(__AVX512F__)
constexpr int FLOAT_TILE_M = 4, FLOAT_TILE_N = 4;  // 16 accumulators of 32 registers
#else
constexpr int FLOAT_TILE_M = 2, FLOAT_TILE_N = 4;  // 8 accumulators of 16 registers
#endif

// out[m, n0:n1] of x (rows, k) @ W.T for weight rows [n0, n1) of (N, k) rows w.
template <typename T>
void float_rows(const T* w, const float* x, int64_t rows, int64_t k, float* out, int64_t n_out, int64_t n0,
                int64_t n1) {
  int64_t n = n0;
  for (; n + FLOAT_TILE_N <= n1; n += FLOAT_TILE_N) {
    int64_t m = 0;
    for (; m + FLOAT_TILE_M <= rows; m += FLOAT_TILE_M)
      float_tile<FLOAT_TILE_M, FLOAT_TILE_N>(x + m * k, w + n * k, k, out + m * n_out + n, n_out);
    for (; m < rows; ++m) float_tile<1, FLOAT_TILE_N>(x + m * k, w + n * k, k, out + m * n_out + n, n_out);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < rows; ++m) float_tile<1, 1>(x + m * k, w + n * k, k, out + m * n_out + n, n_out);
}

}  // namespace hl
