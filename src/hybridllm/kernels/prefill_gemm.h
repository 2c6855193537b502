// Prefill products: many input rows (a prompt chunk) against one weight matrix, read in place in
// the format the decode kernels read (no second copy of the weights in any other layout).
//
// Included by decode.cpp (one translation unit): uses its HLLinear, formats, vectors, Team and
// Share. Not batch-invariant (the decode step's products are linear_team's); a prefill row's
// result does not depend on the other rows, but it differs from decode's arithmetic.
//
// Each thread takes a range of output rows (multiples of PANEL), dequantizes PANEL weight rows
// at a time over the whole K into a small buffer (L2-resident), and multiplies a chunk of the
// input rows against it with a register-blocked dot kernel: TILE_M input rows x TILE_N weight
// rows of accumulators, one vector of each input row and each weight row loaded per step.
//
// Element types (Panel<V>): quantized weights on a CPU with AVX512-BF16 use bfloat16 panels and
// inputs with bf16 pair dots into float32 (vdpbf16ps: twice float32's multiply rate; the
// precision of PyTorch's int4/int8 CPU kernels, which also round activations to bfloat16).
// Float32 weights, and every weight elsewhere, use float32 panels and fused multiply-adds (the
// dequantized weights exactly, float32 activations). Few rows (below panel_min_rows: 8 with bf16
// panels, 20 with float32 panels, the measured crossovers) take the decode products instead: a
// panel's dequantization costs more than it saves there.

namespace prefill {

constexpr int64_t PANEL = 16;  // weight rows dequantized at a time (one Q4 block row)
constexpr int64_t CHUNK_BYTES = 8 << 20;  // input rows multiplied per dequantized panel: up to this many bytes of them (L2/L3)

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool HAVE_BF16_DOTS = true;
#else
constexpr bool HAVE_BF16_DOTS = false;
#endif

struct BF16 {  // bfloat16 bits
  uint16_t bits;
};

#if defined(__AVX512F__)
typedef float f32xP __attribute__((vector_size(64)));
#else
typedef float f32xP __attribute__((vector_size(32)));  // 8 floats: one AVX2 register (see LANES)
#endif

template <typename V>
struct Panel;

// float32 panels are stored transposed, (K, NR) per block of NR weight rows, for an
// outer-product kernel: per input value, one broadcast and NR / lanes multiply-adds (no
// horizontal sums, the way BLIS-style kernels keep the multipliers busy).
constexpr int64_t F32_LANES = sizeof(f32xP) / sizeof(float);

template <>
struct Panel<float> {
  static constexpr int64_t STEP = 1;  // the outer-product kernel walks K one value at a time
  static constexpr int64_t NR = 2 * F32_LANES;  // weight rows per panel block: two registers
#if defined(__AVX512F__)
  static constexpr int TILE_M = 12;  // 24 accumulators of 32 registers
#else
  static constexpr int TILE_M = 6;  // 12 accumulators of 16 registers
#endif
};

template <>
struct Panel<BF16> {
  static constexpr int64_t STEP = 32;  // one 512-bit register of bf16
  static constexpr int TILE_M = 4, TILE_N = 4;  // a dot kernel: rows (PANEL, K), pair dots along K
};

// float32 -> bfloat16, round to nearest even (what PyTorch's .to(bfloat16) does).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// n float32 values -> panel values.
inline void convert_values(const float* x, int64_t n, float* out) { std::memcpy(out, x, n * sizeof(float)); }

inline void convert_values(const float* x, int64_t n, BF16* out) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i].bits = to_bf16(x[i]);
}

// Weight row n, inputs [g * 32, g * 32 + 32) (one group) of a Q8 format, as float32 values.
inline void q8_group_values(const HLLinear& w, int64_t n, int64_t g, float* out) {
  const int8_t* codes;
  float scale;
  if (w.format == FORMAT_Q8_ROWS) {
    codes = static_cast<const int8_t*>(w.weight) + n * w.in_features + g * GROUP;
    scale = static_cast<const float*>(w.scales)[n];
  } else {  // FORMAT_Q8_GROUPS
    codes = static_cast<const int8_t*>(w.weight) + (g * w.out_features + n) * GROUP;
    scale = static_cast<const float*>(w.scales)[g * w.out_features + n];
  }
#pragma omp simd
  for (int j = 0; j < GROUP; ++j) out[j] = scale * static_cast<float>(codes[j]);
}

// One Q4 row's group (16 code bytes, its scale and zero) as 32 float32 values: exactly what the
// decode kernels compute with, (q - 8) * scale + zero (the product is exact: one rounding).
inline void q4_group_values(const uint8_t* codes, float scale, float zero, float* out) {
  typedef uint8_t u8x8 __attribute__((vector_size(8)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  typedef float f32x8v __attribute__((vector_size(32)));
  for (int half = 0; half < 2; ++half) {
    const u8x8 c = load<u8x8>(codes + 8 * half);
    const f32x8v lo = __builtin_convertvector(__builtin_convertvector(c & 15, i32x8), f32x8v);
    const f32x8v hi = __builtin_convertvector(__builtin_convertvector(c >> 4, i32x8), f32x8v);
    const f32x8v l = (lo - 8.0f) * scale + zero, h = (hi - 8.0f) * scale + zero;
    std::memcpy(out + 8 * half, &l, sizeof l);
    std::memcpy(out + 16 + 8 * half, &h, sizeof h);
  }
}

// The same as 32 bfloat16 values (the panel is rewritten for every chunk of input rows, so its
// dequantization must stay cheap: vectorized where the CPU has bf16 conversions).
inline void q4_group_values(const uint8_t* codes, float scale, float zero, BF16* out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512i low = _mm512_cvtepu8_epi32(_mm_and_si128(c, _mm_set1_epi8(15)));
  const __m512i high = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi8(15)));
  const __m512 eight = _mm512_set1_ps(8.0f), s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
  const __m512 lo = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(low), eight), s, z);
  const __m512 hi = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(high), eight), s, z);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // values 0..15 low half, 16..31 high
#else
  float values[GROUP];
  q4_group_values(codes, scale, zero, values);
  convert_values(values, GROUP, out);
#endif
}

// Weight row n's values over inputs [0, k) (n < N), in float32 or bf16, into out (k,) with
// stride `stride` between consecutive inputs.
template <typename V>
void row_values(const HLLinear& w, int64_t n, V* out) {
  const int64_t k = w.in_features, groups = k / GROUP;
  if (w.format == FORMAT_Q4) {
    const uint8_t* blocks = static_cast<const uint8_t*>(w.weight) + (n / Q4_ROWS) * groups * Q4_BLOCK_BYTES;
    const int64_t r = n % Q4_ROWS;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* block = blocks + g * Q4_BLOCK_BYTES;
      uint8_t codes[16];
      q4_row_codes(block, r, codes);
      q4_group_values(codes, q4_scale(block, r), q4_zero(block, r), out + g * GROUP);
    }
  } else if (w.format == FORMAT_F32) {  // any K
    convert_values(static_cast<const float*>(w.weight) + n * k, k, out);
  } else {
    float values[GROUP];
    for (int64_t g = 0; g < groups; ++g) {
      q8_group_values(w, n, g, values);
      convert_values(values, GROUP, out + g * GROUP);
    }
  }
}

// bf16: weight rows [n0, n0 + PANEL) into panel (PANEL, k_padded), zero-padded (rows past N too).
void dequantize_panel(const HLLinear& w, int64_t n0, int64_t k_padded, BF16* panel) {
  const int64_t k = w.in_features;
  for (int64_t j = 0; j < PANEL; ++j) {
    BF16* row = panel + j * k_padded;
    if (n0 + j >= w.out_features) {
      std::memset(row, 0, k_padded * sizeof(BF16));
      continue;
    }
    row_values(w, n0 + j, row);
    std::memset(row + k, 0, (k_padded - k) * sizeof(BF16));
  }
}

// 8 rows of 8 floats -> their 8 columns (r[i][c] -> c[c][i]), by shuffles.
typedef float f32x8t __attribute__((vector_size(32)));
typedef int32_t i32x8t __attribute__((vector_size(32)));
inline void transpose8(f32x8t r[8]) {
  f32x8t t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // interleave row pairs
    t[i] = __builtin_shuffle(r[i], r[i + 1], i32x8t{0, 8, 1, 9, 4, 12, 5, 13});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], i32x8t{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 8; i += 4) {  // pairs of pairs: columns (c, c + 4) of 4 rows
    u[i] = __builtin_shuffle(t[i], t[i + 2], i32x8t{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 1] = __builtin_shuffle(t[i], t[i + 2], i32x8t{2, 3, 10, 11, 6, 7, 14, 15});
    u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], i32x8t{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], i32x8t{2, 3, 10, 11, 6, 7, 14, 15});
  }
  for (int c = 0; c < 4; ++c) {  // halves of rows 0-3 and 4-7
    r[c] = __builtin_shuffle(u[c], u[c + 4], i32x8t{0, 1, 2, 3, 8, 9, 10, 11});
    r[c + 4] = __builtin_shuffle(u[c], u[c + 4], i32x8t{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

// float32: weight rows [n0, n0 + NR) transposed into panel (K, NR) (rows past N are zeros):
// 8 rows at a time dequantized row-wise, then written in 8 x 8 transposed tiles.
void dequantize_panel(const HLLinear& w, int64_t n0, int64_t, float* panel) {
  constexpr int64_t NR = Panel<float>::NR;
  const int64_t k = w.in_features, k8 = k / 8 * 8;
  thread_local std::vector<float> rows;
  rows.resize(8 * k);
  for (int64_t j0 = 0; j0 < NR; j0 += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      if (n0 + j0 + j < w.out_features)
        row_values(w, n0 + j0 + j, rows.data() + j * k);
      else
        std::fill(rows.begin() + j * k, rows.begin() + (j + 1) * k, 0.0f);
    }
    for (int64_t i = 0; i < k8; i += 8) {
      f32x8t tile[8];
      for (int j = 0; j < 8; ++j) tile[j] = load<f32x8t>(rows.data() + j * k + i);
      transpose8(tile);
      for (int c = 0; c < 8; ++c) std::memcpy(panel + (i + c) * NR + j0, &tile[c], sizeof tile[c]);
    }
    for (int64_t i = k8; i < k; ++i)
      for (int64_t j = 0; j < 8; ++j) panel[i * NR + j0 + j] = rows[j * k + i];
  }
}

// out[m * n_out + j] = a_m . w_j for MT input rows a (stride lda, float32) and the NR rows of a
// transposed panel (K, NR): per input value, one broadcast and two multiply-adds per row.
template <int MT>
void outer_tile(const float* a, int64_t lda, const float* panel, int64_t k, float* out, int64_t n_out,
                int64_t n_valid) {
  constexpr int64_t NR = Panel<float>::NR;
  f32xP acc[MT][2] = {};
  for (int64_t i = 0; i < k; ++i) {
    const f32xP b0 = load<f32xP>(panel + i * NR), b1 = load<f32xP>(panel + i * NR + F32_LANES);
    for (int m = 0; m < MT; ++m) {
      const float am = a[m * lda + i];
      acc[m][0] += am * b0;
      acc[m][1] += am * b1;
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* o = out + m * n_out;
    if (n_valid == NR) {
      std::memcpy(o, &acc[m][0], sizeof acc[m][0]);
      std::memcpy(o + F32_LANES, &acc[m][1], sizeof acc[m][1]);
    } else {
      for (int64_t j = 0; j < n_valid; ++j) o[j] = j < F32_LANES ? acc[m][0][j] : acc[m][1][j - F32_LANES];
    }
  }
}

// Input rows [m0, m1) against one float32 panel: tiles of TILE_M rows, then the remainder.
template <int MT>
void outer_rows(const float* x, int64_t k, const float* panel, float* out, int64_t n_out, int64_t n_valid,
                int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + MT <= m1; m += MT) outer_tile<MT>(x + m * k, k, panel, k, out + m * n_out, n_out, n_valid);
  if constexpr (MT > 1) {
    if (m < m1) outer_rows<MT / 2 ? MT / 2 : 1>(x, k, panel, out, n_out, n_valid, m, m1);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
template <int MT>
void tile(const BF16* a, const BF16* w, int64_t k_padded, float* out, int64_t n_out, int64_t n_valid) {
  constexpr int TN = Panel<BF16>::TILE_N;
  constexpr int64_t STEP = Panel<BF16>::STEP;
  __m512 acc[MT][TN];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < TN; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k_padded; i += STEP) {
    __m512bh wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k_padded + i);
    for (int m = 0; m < MT; ++m) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + m * k_padded + i);
      for (int j = 0; j < TN; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, wv[j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < n_valid; ++j) out[m * n_out + j] = _mm512_reduce_add_ps(acc[m][j]);
}
#else
template <int MT>
void tile(const BF16*, const BF16*, int64_t, float*, int64_t, int64_t) {}  // never called: no bf16 dots
#endif

template <int MT, typename V>
void tiles_of_panel(const V* a, const V* panel, int64_t k_padded, float* out, int64_t n_out, int64_t n0,
                    int64_t n_end) {
  constexpr int TN = Panel<V>::TILE_N;
  for (int64_t j = 0; j < PANEL; j += TN) {
    if (n0 + j >= n_end) break;
    tile<MT>(a, panel + j * k_padded, k_padded, out + n0 + j, n_out, std::min<int64_t>(TN, n_end - n0 - j));
  }
}

// The bf16 input rows as the dot kernel reads them, (M, k_padded) zero-padded. The buffer only
// grows (a prompt's chunks reuse it; no page faults per call).
struct Inputs {
  std::vector<BF16> storage;
  void reserve(int64_t rows, int64_t k) {
    const int64_t k_padded = (k + Panel<BF16>::STEP - 1) / Panel<BF16>::STEP * Panel<BF16>::STEP;
    if (HAVE_BF16_DOTS && static_cast<int64_t>(storage.size()) < rows * k_padded) storage.resize(rows * k_padded);
  }
};

// This thread's output rows: contiguous ranges in multiples of `unit` (whole panels).
inline std::pair<int64_t, int64_t> output_range(const Team& team, int64_t n, int64_t unit) {
  const int64_t per = ((n + team.size - 1) / team.size + unit - 1) / unit * unit;
  const int64_t n0 = std::min<int64_t>(n, team.thread * per);
  return {n0, std::min(n, n0 + per)};
}

inline void add_bias(const HLLinear& w, float* out, int64_t rows, int64_t n0, int64_t n1) {
  if (!w.has_bias) return;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = n0; c < n1; ++c) out[m * w.out_features + c] += w.bias[c];
}

// out (rows, N) = x (rows, K) @ W.T (+ bias), by the team: bf16 panels and pair dots.
void linear_team_bf16(const Team& team, const HLLinear& w, Inputs& in, const float* x, float* out, int64_t rows) {
  constexpr int TM = Panel<BF16>::TILE_M;
  constexpr int64_t STEP = Panel<BF16>::STEP;
  const int64_t k = w.in_features, n = w.out_features, k_padded = (k + STEP - 1) / STEP * STEP;
  BF16* inputs = in.storage.data();
  {
    const Share mine(rows, team);
    for (int64_t r = mine.first; r < mine.last; ++r) {
      convert_values(x + r * k, k, inputs + r * k_padded);
      std::memset(inputs + r * k_padded + k, 0, (k_padded - k) * sizeof(BF16));
    }
  }
  team.barrier();
  const auto [n0, n1] = output_range(team, n, PANEL);
  const int64_t chunk = std::max<int64_t>(TM, CHUNK_BYTES / (k_padded * 2) / TM * TM);
  thread_local std::vector<BF16> panel;
  panel.resize(PANEL * k_padded);
  for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
    const int64_t m1 = std::min(rows, m0 + chunk);
    for (int64_t p = n0; p < n1; p += PANEL) {
      dequantize_panel(w, p, k_padded, panel.data());
      int64_t m = m0;
      for (; m + TM <= m1; m += TM) tiles_of_panel<TM>(inputs + m * k_padded, panel.data(), k_padded, out + m * n, n, p, n1);
      for (; m < m1; ++m) tiles_of_panel<1>(inputs + m * k_padded, panel.data(), k_padded, out + m * n, n, p, n1);
    }
  }
  add_bias(w, out, rows, n0, n1);
  team.barrier();
}

// The same with float32 transposed panels and the outer-product kernel (x read in place).
void linear_team_f32(const Team& team, const HLLinear& w, const float* x, float* out, int64_t rows) {
  constexpr int64_t NR = Panel<float>::NR;
  constexpr int TM = Panel<float>::TILE_M;
  const int64_t k = w.in_features, n = w.out_features;
  const auto [n0, n1] = output_range(team, n, NR);
  const int64_t chunk = std::max<int64_t>(TM, CHUNK_BYTES / (k * 4) / TM * TM);
  thread_local std::vector<float> panel;
  panel.resize(k * NR);
  for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
    const int64_t m1 = std::min(rows, m0 + chunk);
    for (int64_t p = n0; p < n1; p += NR) {
      dequantize_panel(w, p, k, panel.data());
      outer_rows<TM>(x, k, panel.data(), out + p, n, std::min<int64_t>(NR, n1 - p), m0, m1);
    }
  }
  add_bias(w, out, rows, n0, n1);
  team.barrier();
}

// Whether a matrix's prefill products use bfloat16 panels (quantized weights with bf16 dots).
inline bool bf16_panels(const HLLinear& w) { return HAVE_BF16_DOTS && w.format != FORMAT_F32; }

// The fewest rows worth a dequantized panel (fewer: the decode products, which read the weights
// as stored). Depends on the matrix and the build only, never on the team.
inline int64_t panel_min_rows(const HLLinear& w) { return bf16_panels(w) ? 8 : 20; }

void linear_team(const Team& team, const HLLinear& w, Inputs& in, const float* x, float* out, int64_t rows) {
  if (bf16_panels(w))
    linear_team_bf16(team, w, in, x, out, rows);
  else
    linear_team_f32(team, w, x, out, rows);
}

}  // namespace prefill
