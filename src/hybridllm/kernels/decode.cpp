// Native CPU kernels for one decode step (batch 1, one token) of a Llama-family layer.
//
// Built at run time by hybridllm.kernels.build with the host's C++ compiler
// (-O3 -march=native -fopenmp) and called through ctypes by hybridllm.kernels.native.
// No PyTorch headers: every tensor arrives as a raw pointer plus its sizes, and the structs
// below mirror the ctypes.Structure classes in native.py field for field (ABI_VERSION guards
// that pairing).
//
// Numerics: activations, norms, rotary, scores and softmax in float32. Float32 weights: the
// results equal PyTorch's float32 computation up to summation order. Quantized weights on x86
// (AVX2 and up): integer dot products of the codes with the activations written as two int8
// digits per group of 32 (see Activation: ~15 bits per value, closer to the float product over
// the dequantized weights than PyTorch's bfloat16 int4 kernel); other CPUs expand the codes to
// float32 in registers. Nothing is ever stored dequantized.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int32_t ABI_VERSION = 2;
constexpr int64_t GROUP = 32;  // values per quantization group (GGUF blocks)

enum WeightFormat : int32_t {
  FORMAT_F32 = 0,        // weight (N, K) float32
  FORMAT_Q4 = 1,         // weight (ceil(N/4), K/32, 80) uint8: blocks of 4 rows x 1 group, read in one
                         //   stream: 4 x (scale, zero) bfloat16, then 4 x 16 code bytes (byte j of a
                         //   row = q[j] | q[j+16] << 4); value = (q - 8) * scale + zero. scales unused.
  FORMAT_Q8_ROWS = 2,    // weight (N, K) int8; scales (N,) float32: value = scale[n] * code
  FORMAT_Q8_GROUPS = 3,  // weight (K/32, N, 32) int8; scales (K/32, N) float32: value = scale[g, n] * code
};

}  // namespace

extern "C" {

struct HLLinear {
  int32_t format;
  int32_t has_bias;
  int64_t out_features;
  int64_t in_features;
  const void* weight;
  const void* scales;
  const float* bias;  // (N,) float32 when has_bias
};

struct HLDecoderLayer {
  HLLinear qkv;      // (H + 2 Hkv) * D outputs: q heads, then k heads, then v heads
  HLLinear o;        // H * D -> hidden
  HLLinear gate_up;  // 2 * intermediate outputs: gate, then up
  HLLinear down;     // intermediate -> hidden
  const float* attn_norm;  // (hidden,)
  const float* mlp_norm;   // (hidden,)
  float eps;
  int32_t n_heads;
  int32_t n_kv_heads;
  int32_t head_dim;
  int64_t hidden;
  int64_t intermediate;
};

// One layer's KV buffers ((Hkv, capacity, D) each, batch 1) and the row of this step's token.
struct HLLayerCache {
  float* keys;
  float* values;
  int64_t capacity;
  int64_t start;
};

int32_t hl_abi_version() { return ABI_VERSION; }

}  // extern "C"

namespace {

// ---- phase timers (built only with -DHL_PROFILE, by bench/profile_native.py) -----------------
enum Phase { BETWEEN_STEPS, NORM, QKV, ROPE_KV, ATTENTION, O_PROJ, RESIDUAL_NORM, GATE_UP, SILU, DOWN, RESIDUAL,
             FINAL_NORM, HEAD, N_PHASES };
#ifdef HL_PROFILE
double phase_seconds[N_PHASES];  // accumulated by thread 0 (the others wait at the same barriers)
double phase_mark = 0.0;
#define PHASE_END(phase)                                         \
  do {                                                           \
    if (omp_get_thread_num() == 0) {                             \
      const double now = omp_get_wtime();                        \
      if (phase_mark > 0.0) phase_seconds[phase] += now - phase_mark; \
      phase_mark = now;                                          \
    }                                                            \
  } while (0)
#else
#define PHASE_END(phase) \
  do {                   \
  } while (0)
#endif

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x), Cephes' single-precision polynomial (relative error ~1e-7), x clamped to [-87, 87]
// (exp(-87) ~ 1.6e-38 stands for 0); branch-free so that the compiler vectorizes its loops.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// ---- vectors ------------------------------------------------------------------------------
// GCC/Clang vector extensions: one source that the compiler lowers to the widest registers
// -march=native offers (one AVX-512 register, two AVX2 registers, or narrower).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum16(f32x16 v) {
  f32x8 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const f32x8 s8 = lo + hi;
  f32x4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const f32x4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}


// ---- rows of each weight format: ROWS output rows at once share the loads of x --------------
constexpr int ROWS = 4;
constexpr int64_t Q4_BLOCK = ROWS * 4 + ROWS * 16;  // bytes of one group of a 4-row block

// The input row of a product as each path reads it: float32 values, their per-group sums (the
// zero-point terms of Q4), and (x86) two int8 digits per value for integer dot products:
//   x ~= q_scales[g] * (q + q_low / 128),
// q = round(x / scale) with scale = max|x_g| / 127, and q_low the rounded remainder in 1/128
// steps (|q_low| <= 64). Two integer dots per group then carry ~15 bits of each activation
// (one int8 digit alone, as llama.cpp uses, moves this model's logits ~20x more than bfloat16).
struct Activation {
  const float* x;         // (K,)
  const float* sums;      // (K/32,)
  const float* q_scales;  // (K/32,)
  const int8_t* q;        // (K,)
  const int8_t* q_low;    // (K,)
};

// The prepared rows of one product's input (M, K); each thread keeps one, reused across calls.
class ActivationRows {
 public:
  void prepare(const float* x, int64_t rows, int64_t k, bool with_sums, bool quantize) {
    x_ = x;
    rows_ = rows;
    k_ = k;
    groups_ = with_sums ? k / GROUP : 0;
    sums_.resize(rows * groups_);
    q_scales_.resize(quantize ? rows * groups_ : 0);
    q_.resize(quantize ? rows * k : 0);
    q_low_.resize(quantize ? rows * k : 0);
    for (int64_t g = 0; g < rows * groups_; ++g) {
      const float* xg = x + g * GROUP;  // rows are contiguous, so group g of all rows in turn
      float sum = 0.0f, amax = 0.0f;
#pragma omp simd reduction(+ : sum) reduction(max : amax)
      for (int j = 0; j < GROUP; ++j) {
        sum += xg[j];
        amax = std::max(amax, std::fabs(xg[j]));
      }
      sums_[g] = sum;
      if (!quantize) continue;
      const float scale = amax / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      q_scales_[g] = scale;
      int8_t* q = q_.data() + g * GROUP;
      int8_t* q_low = q_low_.data() + g * GROUP;
#pragma omp simd
      for (int j = 0; j < GROUP; ++j) {
        const float scaled = xg[j] * inverse;
        const float high = std::nearbyint(scaled);
        q[j] = static_cast<int8_t>(high);
        q_low[j] = static_cast<int8_t>(std::nearbyint((scaled - high) * 128.0f));
      }
    }
  }
  int64_t rows() const { return rows_; }
  Activation row(int64_t i) const {
    const bool quantized = !q_.empty();
    return {x_ + i * k_, sums_.data() + i * groups_, quantized ? q_scales_.data() + i * groups_ : nullptr,
            quantized ? q_.data() + i * k_ : nullptr, quantized ? q_low_.data() + i * k_ : nullptr};
  }

 private:
  const float* x_ = nullptr;
  int64_t rows_ = 0, k_ = 0, groups_ = 0;
  std::vector<float> sums_, q_scales_;
  std::vector<int8_t> q_, q_low_;
};

// out[r] = W[r] . x for ROWS float32 rows starting at w (row stride k).
void rows_f32(const float* w, const float* x, int64_t k, float* out) {
  f32x16 acc[ROWS] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const f32x16 xv = load<f32x16>(x + i);
    for (int r = 0; r < ROWS; ++r) acc[r] += load<f32x16>(w + r * k + i) * xv;
  }
  for (int r = 0; r < ROWS; ++r) {
    float s = sum16(acc[r]);
    for (int64_t j = i; j < k; ++j) s += w[r * k + j] * x[j];
    out[r] = s;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool QUANTIZED_ACTIVATIONS = true;

// 8 int32 lanes, each the sum of 4 products of unsigned bytes a and signed bytes b.
inline __m256i dot_u8_s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));  // |a * b| * 2 < 2^15 here
#endif
}

inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Q4 rows: value = (q - 8) * scale + zero per group of 32, so row . x =
//   sum_g scale_g * (q_g . x_g) + (zero_g - 8 scale_g) * sum(x_g).
// q_g . x_g is an integer dot with the int8 copy of x; the zero-point term uses x's float sums.
// `blocks` points at this row block's first (group) block of Q4_BLOCK bytes.
void rows_q4(const uint8_t* blocks, const Activation& a, int64_t groups, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  __m128 offsets = _mm_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  alignas(16) float scales[ROWS];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = blocks + g * Q4_BLOCK;
    __builtin_prefetch(block + 8 * Q4_BLOCK);
    const __m256 sz = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block))), 16));
    const __m128 lo = _mm256_castps256_ps128(sz), hi = _mm256_extractf128_ps(sz, 1);
    const __m128 scale = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));  // s0 s1 s2 s3
    const __m128 zero = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));   // z0 z1 z2 z3
    offsets = _mm_fmadd_ps(_mm_fnmadd_ps(_mm_set1_ps(8.0f), scale, zero), _mm_set1_ps(a.sums[g]), offsets);
    _mm_store_ps(scales, _mm_mul_ps(scale, _mm_set1_ps(a.q_scales[g] / 128.0f)));
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + g * GROUP));
    const __m256i xq_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_low + g * GROUP));
    const uint8_t* codes = block + ROWS * 4;
#define HL_Q4_ROW(r, acc)                                                                                   \
  {                                                                                                         \
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (r) * 16));                  \
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low_nibbles),                   \
                                       _mm_and_si128(c, low_nibbles));                                      \
    const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dot_u8_s8(q, xq), 7), dot_u8_s8(q, xq_low));      \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scales[r]), acc);                          \
  }
    HL_Q4_ROW(0, acc0)
    HL_Q4_ROW(1, acc1)
    HL_Q4_ROW(2, acc2)
    HL_Q4_ROW(3, acc3)
#undef HL_Q4_ROW
  }
  alignas(16) float offset_sums[ROWS];
  _mm_store_ps(offset_sums, offsets);
  out[0] = sum8(acc0) + offset_sums[0];
  out[1] = sum8(acc1) + offset_sums[1];
  out[2] = sum8(acc2) + offset_sums[2];
  out[3] = sum8(acc3) + offset_sums[3];
}

// One group of 32 signed codes w against the two int8 digits of the activations: 8 int32
// partial sums of 128 * (w . q) + w . q_low.
inline __m256i dot_s8_s8(const int8_t* w, __m256i xq, __m256i xq_low) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i magnitudes = _mm256_abs_epi8(codes);
  return _mm256_add_epi32(_mm256_slli_epi32(dot_u8_s8(magnitudes, _mm256_sign_epi8(xq, codes)), 7),
                          dot_u8_s8(magnitudes, _mm256_sign_epi8(xq_low, codes)));
}

// Q8 rows with one scale per row (k a multiple of 32); the caller applies the row scales.
void rows_q8(const int8_t* w, const Activation& a, int64_t k, float* out) {
  __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < k; i += GROUP) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + i));
    const __m256i xq_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_low + i));
    const __m256 x_scale = _mm256_set1_ps(a.q_scales[i / GROUP] / 128.0f);
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s8_s8(w + r * k + i, xq, xq_low)), x_scale, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) out[r] = sum8(acc[r]);
}

// 8 vectors of 8 int32 partial sums -> one vector of their 8 totals.
inline __m256i sum_each_of_8(const __m256i d[8]) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// Rows n0..n1-1 (n1 - n0 a multiple of 8) of a (G, N, 32) table with (G, N) scales (the GGUF
// Q8_0 head), group by group: each group's rows are one contiguous slab, so a thread reads its
// rows of the table as one sequential stream per group; out accumulates across groups.
void q8_groups_range(const int8_t* w, const float* scales, const Activation& a, int64_t n0, int64_t n1,
                     int64_t n_rows, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + g * GROUP));
    const __m256i xq_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_low + g * GROUP));
    const __m256 x_scale = _mm256_set1_ps(a.q_scales[g] / 128.0f);
    const int8_t* slab = w + g * n_rows * GROUP;
    const float* slab_scales = scales + g * n_rows;
    for (int64_t n = n0; n < n1; n += 8) {
      const int8_t* rows = slab + n * GROUP;
      __builtin_prefetch(rows + 16 * 8 * GROUP);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 64);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 128);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 192);
      __m256i dots[8];
      for (int r = 0; r < 8; ++r) dots[r] = dot_s8_s8(rows + r * GROUP, xq, xq_low);
      const __m256 row_scales = _mm256_mul_ps(_mm256_loadu_ps(slab_scales + n), x_scale);
      const __m256 partial = _mm256_mul_ps(_mm256_cvtepi32_ps(sum_each_of_8(dots)), row_scales);
      _mm256_storeu_ps(out + n, g == 0 ? partial : _mm256_add_ps(_mm256_loadu_ps(out + n), partial));
    }
  }
}
#else
constexpr bool QUANTIZED_ACTIVATIONS = false;  // portable float path

inline f32x16 u8_to_f32(u8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }
inline f32x16 i8_to_f32(i8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }

void rows_q4(const uint8_t* blocks, const Activation& a, int64_t groups, float* out) {
  f32x16 acc[ROWS] = {};
  float offset_acc[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = blocks + g * Q4_BLOCK;
    const f32x16 x_lo = load<f32x16>(a.x + g * GROUP), x_hi = load<f32x16>(a.x + g * GROUP + 16);
    uint16_t sz[2 * ROWS];
    std::memcpy(sz, block, sizeof sz);
    for (int r = 0; r < ROWS; ++r) {
      const u8x16 c = load<u8x16>(block + ROWS * 4 + r * 16);
      const f32x16 dot = u8_to_f32(c & 15) * x_lo + u8_to_f32(c >> 4) * x_hi;
      const float scale = bf16_to_float(sz[2 * r]);
      acc[r] += dot * scale;
      offset_acc[r] += (bf16_to_float(sz[2 * r + 1]) - 8.0f * scale) * a.sums[g];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = sum16(acc[r]) + offset_acc[r];
}

void rows_q8(const int8_t* w, const Activation& a, int64_t k, float* out) {
  f32x16 acc[ROWS] = {};
  for (int64_t i = 0; i < k; i += 32) {
    const f32x16 x_lo = load<f32x16>(a.x + i), x_hi = load<f32x16>(a.x + i + 16);
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* wr = w + r * k + i;
      acc[r] += i8_to_f32(load<i8x16>(wr)) * x_lo + i8_to_f32(load<i8x16>(wr + 16)) * x_hi;
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = sum16(acc[r]);
}

void rows_q8_groups(const int8_t* w, const float* scales, const Activation& a, int64_t n, int64_t n_rows,
                    int64_t groups, float* out) {
  f32x16 acc[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const f32x16 x_lo = load<f32x16>(a.x + g * GROUP), x_hi = load<f32x16>(a.x + g * GROUP + 16);
    const int8_t* wg = w + (g * n_rows + n) * GROUP;
    const float* sg = scales + g * n_rows + n;
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* codes = wg + r * GROUP;
      const f32x16 dot = i8_to_f32(load<i8x16>(codes)) * x_lo + i8_to_f32(load<i8x16>(codes + 16)) * x_hi;
      acc[r] += dot * sg[r];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = sum16(acc[r]);
}

void q8_groups_range(const int8_t* w, const float* scales, const Activation& a, int64_t n0, int64_t n1,
                     int64_t n_rows, int64_t groups, float* out) {
  for (int64_t n = n0; n < n1; n += ROWS) rows_q8_groups(w, scales, a, n, n_rows, groups, out + n);
}
#endif

// The same for one row (the remainder when N is not a multiple of ROWS), plain loops.
float row_tail(const HLLinear& w, const float* x, int64_t n) {
  const int64_t k = w.in_features, groups = k / GROUP;
  float s = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t g = i / GROUP, j = i % GROUP;
    float value;
    switch (w.format) {
      case FORMAT_F32:
        value = static_cast<const float*>(w.weight)[n * k + i];
        break;
      case FORMAT_Q4: {
        const uint8_t* block = static_cast<const uint8_t*>(w.weight) + ((n / ROWS) * groups + g) * Q4_BLOCK;
        const uint8_t byte = block[ROWS * 4 + (n % ROWS) * 16 + j % 16];
        const int q = j < 16 ? (byte & 15) : (byte >> 4);
        uint16_t sz[2];
        std::memcpy(sz, block + (n % ROWS) * 4, sizeof sz);
        value = static_cast<float>(q - 8) * bf16_to_float(sz[0]) + bf16_to_float(sz[1]);
        break;
      }
      case FORMAT_Q8_ROWS:
        value = static_cast<const float*>(w.scales)[n] * static_cast<const int8_t*>(w.weight)[n * k + i];
        break;
      default:
        value = static_cast<const float*>(w.scales)[g * w.out_features + n] *
                static_cast<const int8_t*>(w.weight)[(g * w.out_features + n) * GROUP + j];
        break;
    }
    s += value * x[i];
  }
  return s;
}

// out[m, n0:n1] of x @ W.T (+ bias) for every prepared row m (out is (M, N)). Each block of
// weight rows is read once for all M input rows (it stays in L1 between them).
void linear_rows(const HLLinear& w, const ActivationRows& acts, float* out, int64_t n0, int64_t n1) {
  const int64_t k = w.in_features, groups = k / GROUP, n_out = w.out_features, m_rows = acts.rows();
  int64_t n = n0;
  if (w.format == FORMAT_Q8_GROUPS) {  // group-major over the whole range, 8 rows at a time
    n = n0 + (n1 - n0) / 8 * 8;
    for (int64_t m = 0; m < m_rows; ++m)
      q8_groups_range(static_cast<const int8_t*>(w.weight), static_cast<const float*>(w.scales), acts.row(m), n0, n,
                      n_out, groups, out + m * n_out);
  }
  for (; n + ROWS <= n1; n += ROWS) {
    for (int64_t m = 0; m < m_rows; ++m) {
      const Activation a = acts.row(m);
      float* o = out + m * n_out + n;
      switch (w.format) {
        case FORMAT_F32:
          rows_f32(static_cast<const float*>(w.weight) + n * k, a.x, k, o);
          break;
        case FORMAT_Q4:
          rows_q4(static_cast<const uint8_t*>(w.weight) + (n / ROWS) * groups * Q4_BLOCK, a, groups, o);
          break;
        case FORMAT_Q8_ROWS:
          rows_q8(static_cast<const int8_t*>(w.weight) + n * k, a, k, o);
          for (int r = 0; r < ROWS; ++r) o[r] *= static_cast<const float*>(w.scales)[n + r];
          break;
        default:  // FORMAT_Q8_GROUPS: only the rows after the last multiple of 8 get here
          for (int r = 0; r < ROWS; ++r) o[r] = row_tail(w, a.x, n + r);
          break;
      }
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < m_rows; ++m) out[m * n_out + n] = row_tail(w, acts.row(m).x, n);
  if (w.has_bias)
    for (int64_t m = 0; m < m_rows; ++m)
      for (n = n0; n < n1; ++n) out[m * n_out + n] += w.bias[n];
}

// The output columns of x @ W.T (x: (rows, K) -> out: (rows, N)) split in contiguous ranges,
// one per thread of the enclosing team (multiples of 16: whole cache lines of out), then a
// barrier. Called inside a parallel region (or by one thread outside any). Each thread prepares
// x itself (sums, int8 digits): no extra barrier.
void linear_team(const HLLinear& w, const float* x, float* out, int64_t rows = 1) {
  thread_local ActivationRows acts;
  const bool quantized_weights = w.format != FORMAT_F32;
  acts.prepare(x, rows, w.in_features, quantized_weights, quantized_weights && QUANTIZED_ACTIVATIONS);
  const int64_t n = w.out_features;
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t per = ((n + threads - 1) / threads + 15) / 16 * 16;
  const int64_t n0 = std::min(n, t * per), n1 = std::min(n, n0 + per);
  linear_rows(w, acts, out, n0, n1);
#pragma omp barrier
}

// gate[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
void silu_times(float* __restrict gate, const float* __restrict up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

// Rotate one head vector (D,) in place, "rotate half" layout: cos/sin are (D,) tables.
void rotate_half(float* h, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float rotated[512];
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -h[i + half];
    rotated[i + half] = h[i];
  }
  for (int64_t i = 0; i < d; ++i) h[i] = h[i] * cos[i] + rotated[i] * sin[i];
}

// scores[g * stride + t] = scale * q_g . key_t for the `group` queries sharing a KV head; each
// key row is loaded once for all of them (GROUP_SIZE fixed so the accumulators stay in registers).
template <int GROUP_SIZE>
void score_chunk_fixed(const float* q, const float* keys, const float* values, int64_t len, int64_t d, float scale,
                       float* scores, int64_t stride) {
  for (int64_t t = 0; t < len; ++t) {
    const float* key = keys + t * d;
    for (int64_t line = 0; line < d; line += 16) {  // the rows 8 ahead, and this row's values (next pass)
      __builtin_prefetch(key + 8 * d + line);
      __builtin_prefetch(values + t * d + line);
    }
    f32x16 dots[GROUP_SIZE] = {};
    for (int64_t i = 0; i < d; i += 16) {
      const f32x16 kv = load<f32x16>(key + i);
      for (int g = 0; g < GROUP_SIZE; ++g) dots[g] += load<f32x16>(q + g * d + i) * kv;
    }
    for (int g = 0; g < GROUP_SIZE; ++g) scores[g * stride + t] = sum16(dots[g]) * scale;
  }
}

void score_chunk(const float* q, const float* keys, const float* values, int64_t len, int group, int64_t d,
                 float scale, float* scores, int64_t stride) {
  if (d % 16 == 0) {
    switch (group) {
      case 1: return score_chunk_fixed<1>(q, keys, values, len, d, scale, scores, stride);
      case 2: return score_chunk_fixed<2>(q, keys, values, len, d, scale, scores, stride);
      case 3: return score_chunk_fixed<3>(q, keys, values, len, d, scale, scores, stride);
      case 4: return score_chunk_fixed<4>(q, keys, values, len, d, scale, scores, stride);
      case 5: return score_chunk_fixed<5>(q, keys, values, len, d, scale, scores, stride);
      case 6: return score_chunk_fixed<6>(q, keys, values, len, d, scale, scores, stride);
      case 7: return score_chunk_fixed<7>(q, keys, values, len, d, scale, scores, stride);
      case 8: return score_chunk_fixed<8>(q, keys, values, len, d, scale, scores, stride);
      default: break;
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const float* key = keys + t * d;
    for (int g = 0; g < group; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s += q[g * d + i] * key[i];
      scores[g * stride + t] = s * scale;
    }
  }
}

// acc[g * d ..] = sum_t scores[g * stride + t] * values[t] for each query g of a group: one
// query at a time, its accumulators in registers (the chunk's value rows stay in L1/L2 between
// the group's queries).
template <int VECS>
void accumulate_values_fixed(const float* values, int64_t len, int group, const float* scores, int64_t stride,
                             float* acc) {
  for (int g = 0; g < group; ++g) {
    f32x16 a[VECS] = {};
    const float* p = scores + g * stride;
    for (int64_t t = 0; t < len; ++t) {
      const float* value = values + t * 16 * VECS;
      for (int i = 0; i < VECS; ++i) a[i] += load<f32x16>(value + 16 * i) * p[t];
    }
    std::memcpy(acc + g * 16 * VECS, a, sizeof a);
  }
}

void accumulate_values(const float* values, int64_t len, int group, int64_t d, const float* scores, int64_t stride,
                       float* acc) {
  switch (d) {
    case 32: return accumulate_values_fixed<2>(values, len, group, scores, stride, acc);
    case 64: return accumulate_values_fixed<4>(values, len, group, scores, stride, acc);
    case 96: return accumulate_values_fixed<6>(values, len, group, scores, stride, acc);
    case 128: return accumulate_values_fixed<8>(values, len, group, scores, stride, acc);
    default: break;
  }
  std::fill(acc, acc + group * d, 0.0f);
  for (int g = 0; g < group; ++g)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] += scores[g * stride + t] * values[t * d + i];
}

// How attention over `total` tokens is cut into work items (kv head, token chunk): at least 8
// items per thread so that a static split is balanced, each item at least 64 tokens.
struct AttentionSplit {
  int64_t chunk, n_chunks, items;
  AttentionSplit(int64_t total, int n_kv_heads, int n_threads) {
    const int64_t wanted_items = std::max<int64_t>(8 * n_threads, n_kv_heads);
    const int64_t chunks_per_head = (wanted_items + n_kv_heads - 1) / n_kv_heads;
    chunk = std::max<int64_t>(64, (total + chunks_per_head - 1) / chunks_per_head);
    n_chunks = (total + chunk - 1) / chunk;
    items = n_kv_heads * n_chunks;
  }
  static int64_t max_items(int n_kv_heads, int n_threads) {
    const int64_t wanted_items = std::max<int64_t>(8 * n_threads, n_kv_heads);
    return n_kv_heads * ((wanted_items + n_kv_heads - 1) / n_kv_heads);
  }
};

// Scratch shared by a team for one layer step (allocated once per call, outside the region).
struct Workspace {
  std::vector<float> normed, qkv, attn, proj, gate_up, h, part_out, part_max, part_sum;
  Workspace(const HLDecoderLayer& w, int n_threads) {
    const int64_t d = w.head_dim, q_size = w.n_heads * d, kv_size = w.n_kv_heads * d;
    const int64_t items = AttentionSplit::max_items(w.n_kv_heads, n_threads);
    const int64_t group = w.n_heads / w.n_kv_heads;
    normed.resize(w.hidden);
    qkv.resize(q_size + 2 * kv_size);
    attn.resize(q_size);
    proj.resize(w.hidden);
    gate_up.resize(2 * w.intermediate);
    h.resize(w.hidden);
    part_out.resize(items * group * d);
    part_max.resize(items * group);
    part_sum.resize(items * group);
  }
};

// Grouped-query attention of one token's queries q (H, D) over keys/values 0..total-1 of a
// cache laid out (Hkv, capacity, D), by the enclosing team. Work items are (kv head, token
// chunk); each keeps its running max, sum and weighted values per query head, merged exactly
// at the end. `scores` is the calling thread's own scratch.
void attention_team(const float* q, const float* k_cache, const float* v_cache, int64_t capacity, int64_t total,
                    int n_heads, int n_kv_heads, int head_dim, float* out, Workspace& ws,
                    std::vector<float>& scores) {
  const int group = n_heads / n_kv_heads;
  const int64_t d = head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const AttentionSplit split(total, n_kv_heads, omp_get_num_threads());
  const int64_t chunk = split.chunk, n_chunks = split.n_chunks;
  if (static_cast<int64_t>(scores.size()) < group * chunk) scores.resize(group * chunk);
  float* part_out = ws.part_out.data();
  float* part_max = ws.part_max.data();
  float* part_sum = ws.part_sum.data();
#pragma omp for schedule(static)
  for (int64_t item = 0; item < split.items; ++item) {
    const int64_t kv_head = item / n_chunks;
    const int64_t t0 = (item % n_chunks) * chunk;
    const int64_t len = std::min(total, t0 + chunk) - t0;
    const float* keys = k_cache + kv_head * capacity * d;
    const float* values = v_cache + kv_head * capacity * d;
    score_chunk(q + kv_head * group * d, keys + t0 * d, values + t0 * d, len, group, d, scale, scores.data(), chunk);
    float* acc = part_out + item * group * d;
    for (int g = 0; g < group; ++g) {
      float* s = scores.data() + g * chunk;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        s[t] = exp_clamped(s[t] - m);
        sum += s[t];
      }
      part_max[item * group + g] = m;
      part_sum[item * group + g] = sum;
    }
    accumulate_values(values + t0 * d, len, group, d, scores.data(), chunk, acc);
  }  // implicit barrier: every item is done
#pragma omp for schedule(static)
  for (int h = 0; h < n_heads; ++h) {
    const int64_t kv_head = h / group, g = h % group;
    float m = -INFINITY;
    for (int64_t c = 0; c < n_chunks; ++c) m = std::max(m, part_max[(kv_head * n_chunks + c) * group + g]);
    float* o = out + h * d;
    std::fill(o, o + d, 0.0f);
    float total_sum = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t slot = (kv_head * n_chunks + c) * group + g;
      const float w = std::exp(part_max[slot] - m);
      total_sum += w * part_sum[slot];
      const float* a = part_out + slot * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
    }
    const float inv = 1.0f / total_sum;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }  // implicit barrier
}

// One decoder layer for one token at position `past`, by the enclosing team:
//   x_out = h + mlp(norm(h)),  h = x + o(attention(rope(q), cache + rope(k), cache + v)),
// writing the token's k and v into row `past` of the layer's cache (Hkv, capacity, D).
// cos/sin: (D,) rotary tables of the position. x_in may alias x_out.
void decode_layer_team(const HLDecoderLayer& w, const float* x_in, float* x_out, float* k_cache, float* v_cache,
                       int64_t capacity, int64_t past, const float* cos, const float* sin, Workspace& ws,
                       std::vector<float>& scores) {
  const int64_t hidden = w.hidden, d = w.head_dim, inter = w.intermediate;
  const int64_t q_size = w.n_heads * d, kv_size = w.n_kv_heads * d;
  PHASE_END(BETWEEN_STEPS);
#pragma omp single
  rms_norm(x_in, w.attn_norm, w.eps, hidden, ws.normed.data());
  PHASE_END(NORM);
  linear_team(w.qkv, ws.normed.data(), ws.qkv.data());
  PHASE_END(QKV);
#pragma omp single
  {
    float* qkv = ws.qkv.data();
    for (int64_t head = 0; head < w.n_heads + w.n_kv_heads; ++head) rotate_half(qkv + head * d, cos, sin, d);
    for (int64_t kv_head = 0; kv_head < w.n_kv_heads; ++kv_head) {
      std::memcpy(k_cache + (kv_head * capacity + past) * d, qkv + q_size + kv_head * d, d * sizeof(float));
      std::memcpy(v_cache + (kv_head * capacity + past) * d, qkv + q_size + kv_size + kv_head * d, d * sizeof(float));
    }
  }
  PHASE_END(ROPE_KV);
  attention_team(ws.qkv.data(), k_cache, v_cache, capacity, past + 1, w.n_heads, w.n_kv_heads, w.head_dim,
                 ws.attn.data(), ws, scores);
  PHASE_END(ATTENTION);
  linear_team(w.o, ws.attn.data(), ws.proj.data());
  PHASE_END(O_PROJ);
#pragma omp single
  {
    for (int64_t i = 0; i < hidden; ++i) ws.h[i] = x_in[i] + ws.proj[i];
    rms_norm(ws.h.data(), w.mlp_norm, w.eps, hidden, ws.normed.data());
  }
  PHASE_END(RESIDUAL_NORM);
  linear_team(w.gate_up, ws.normed.data(), ws.gate_up.data());
  PHASE_END(GATE_UP);
#pragma omp single
  silu_times(ws.gate_up.data(), ws.gate_up.data() + inter, inter);
  PHASE_END(SILU);
  linear_team(w.down, ws.gate_up.data(), ws.proj.data());
  PHASE_END(DOWN);
#pragma omp single
  for (int64_t i = 0; i < hidden; ++i) x_out[i] = ws.h[i] + ws.proj[i];
  PHASE_END(RESIDUAL);
}

}  // namespace

extern "C" {

// out = x @ W.T (+ bias) for rows x (rows, in_features) -> out (rows, out_features).
void hl_linear(const HLLinear* w, const float* x, float* out, int64_t rows, int32_t n_threads) {
#pragma omp parallel num_threads(n_threads)
  linear_team(*w, x, out, rows);
}

// Attention of q (H, D) over a (Hkv, capacity, D) cache's first `total` tokens -> out (H, D).
void hl_attention(const float* q, const float* k_cache, const float* v_cache, int64_t capacity, int64_t total,
                  int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float* out, int32_t n_threads) {
  HLDecoderLayer shape{};
  shape.n_heads = n_heads;
  shape.n_kv_heads = n_kv_heads;
  shape.head_dim = head_dim;
  Workspace ws(shape, n_threads);
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> scores;
    attention_team(q, k_cache, v_cache, capacity, total, n_heads, n_kv_heads, head_dim, out, ws, scores);
  }
}

// One decoder layer for one token (see decode_layer_team).
void hl_decode_layer(const HLDecoderLayer* layer, const float* x_in, float* x_out, float* k_cache, float* v_cache,
                     int64_t capacity, int64_t past, const float* cos, const float* sin, int32_t n_threads) {
  Workspace ws(*layer, n_threads);
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> scores;
    decode_layer_team(*layer, x_in, x_out, k_cache, v_cache, capacity, past, cos, sin, ws, scores);
  }
}

// A whole decode step after the embedding, in one parallel region: every layer in order (each
// with its cache slot), the final norm and the head. x (hidden,) is overwritten; logits (N,).
void hl_decode_model(const HLDecoderLayer* layers, const HLLayerCache* caches, int64_t n_layers, float* x,
                     const float* cos, const float* sin, const float* final_norm, float eps, const HLLinear* head,
                     float* logits, int32_t n_threads) {
  Workspace ws(layers[0], n_threads);  // every layer of a model has the same shapes
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> scores;
    for (int64_t i = 0; i < n_layers; ++i) {
      const HLLayerCache& c = caches[i];
      decode_layer_team(layers[i], x, x, c.keys, c.values, c.capacity, c.start, cos, sin, ws, scores);
    }
#pragma omp single
    rms_norm(x, final_norm, eps, layers[0].hidden, ws.normed.data());
    PHASE_END(FINAL_NORM);
    linear_team(*head, ws.normed.data(), logits);
    PHASE_END(HEAD);
  }
}

}  // extern "C"

#ifdef HL_PROFILE
// Seconds per phase (the Phase order) accumulated since the library was loaded or reset.
extern "C" double* hl_phase_seconds() { return phase_seconds; }
#endif
