// Native CPU kernels for one decode step (one token for each of B sequences) of a Llama-family
// model. Batch-invariant: each sequence's arithmetic, summation order included, is the same
// alone or in any batch, at any position in it, on any number of threads; the batch shares each
// weight matrix's read (decode is bound by the bandwidth of reading the weights).
//
// Built at run time by hybridllm.kernels.build with the host's C++ compiler
// (-O3 -march=native -fopenmp-simd -pthread) and called through ctypes by hybridllm.kernels.native.
// Threads: the library's own persistent team (see ThreadPool), spin-then-sleep waits.
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
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#include <pthread.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The instruction sets the kernels are built for (what -march gave).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define HL_AVX512_VNNI 1
#else
#define HL_AVX512_VNNI 0
#endif
#if HL_AVX512_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && defined(__x86_64__)
#define HL_AMX 1  // tile multiplies (amx.h)
#else
#define HL_AMX 0
#endif

namespace {

constexpr int32_t ABI_VERSION = 8;
constexpr int64_t GROUP = 32;  // values per quantization group (GGUF blocks)

enum KVDtype : int32_t {
  KV_F32 = 0,
  KV_F16 = 1,  // IEEE half: read into float32 registers, float32 accumulate (no float32 copy)
};

enum WeightFormat : int32_t {
  FORMAT_F32 = 0,        // weight (N, K) float32
  FORMAT_Q4 = 1,         // weight (ceil(N/16), K/32, 320) uint8: blocks of 16 rows x 1 group (q4_blocks.h);
                         //   value = (q - 8) * scale + zero. scales unused.
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

// One layer's KV buffers of one sequence ((Hkv, capacity, D) each, float32 or float16 as kv_dtype
// says), the row of this step's token, and the layer's sliding window (the newest `window` keys,
// its own included, are attended; 0: all of them).
struct HLLayerCache {
  void* keys;
  void* values;
  int64_t capacity;
  int64_t start;
  int32_t kv_dtype;  // KV_F32 or KV_F16
  int32_t window;
  int64_t first() const { return window > 0 && start + 1 > window ? start + 1 - window : 0; }  // first key attended
  int64_t attended() const { return start + 1 - first(); }  // keys attended
};

int32_t hl_abi_version() { return ABI_VERSION; }

// The instruction set the quantized dot products were compiled for (what -march gave).
const char* hl_kernel_isa() {
#if HL_AVX512_VNNI
  return "avx512-vnni";
#elif defined(__AVX2__) && defined(__FMA__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  return "avx2-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// How long a waiting thread spins (in pause instructions) before it sleeps; 0: sleep at once.
void hl_set_spin_wait(int32_t spins);
int32_t hl_spin_wait();

}  // extern "C"

namespace {

// ---- phase timers (built only with -DHL_PROFILE, by bench/profile_native.py) -----------------
enum Phase { BETWEEN_STEPS, NORM, QKV, ROPE_KV, ATTENTION, O_PROJ, RESIDUAL_NORM, GATE_UP, SILU, DOWN, RESIDUAL,
             FINAL_NORM, HEAD, N_PHASES };
#ifdef HL_PROFILE
double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double phase_seconds[N_PHASES];  // accumulated by thread 0 (the others wait at the same barriers)
double phase_mark = 0.0;
#define PHASE_END(team, phase)                                   \
  do {                                                           \
    if ((team).thread == 0) {                                    \
      const double now = seconds_now();                          \
      if (phase_mark > 0.0) phase_seconds[phase] += now - phase_mark; \
      phase_mark = now;                                          \
    }                                                            \
  } while (0)
#else
#define PHASE_END(team, phase) \
  do {                   \
  } while (0)
#endif

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) on every lane of a float vector V: Cephes' single-precision polynomial (relative error
// ~1e-7), x clamped to [-87, 87] (exp(-87) ~ 1.6e-38 stands for 0); branch-free, floor taken as
// truncation corrected where it rounded up.
template <typename V>
inline V exp_vector(V x) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 87.0f ? V{} + 87.0f : x;
  const V y = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(y, I);
  n += static_cast<I>(__builtin_convertvector(n, V) > y);  // -1 where truncation rounded up
  const V nf = __builtin_convertvector(n, V);
  const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The same for one value (a vector of one lane: the very same operations).
inline float exp_clamped(float x) {
  typedef float f32x1 __attribute__((vector_size(4)));
  return exp_vector(f32x1{x})[0];
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

// The float loops of attention and float32 weights run on vectors of LANES = 8 floats: one AVX2
// register (GCC lowers 16-float vectors on AVX2 through the stack, element by element: 4.5x
// slower attention), and on AVX-512 machines measured as fast as 16 (10-25% faster attention on
// Zen 5, fewer horizontal sums per key).
constexpr int LANES = 8;
typedef float f32xL __attribute__((vector_size(LANES * 4)));

// Vectors of the row-wise float loops that need no AVX2 fallback shape (the one-row attention,
// SiLU): 16 floats on AVX-512, else LANES. Every lane does the same operations either way.
#if defined(__AVX512F__)
constexpr int WLANES = 16;
#else
constexpr int WLANES = LANES;
#endif
typedef float f32xW __attribute__((vector_size(WLANES * 4)));

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

inline float sum_lanes(f32xL v) {
  f32x4 a, b;
  std::memcpy(&a, &v, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 16, 16);
  const f32x4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}


// s[t] = exp(s[t] - shift) for t < n; returns their sum (vectors of LANES, then the tail).
inline float exp_shifted(float* s, int64_t n, float shift) {
  f32xL sums = {};
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    const f32xL e = exp_vector(load<f32xL>(s + t) - shift);
    std::memcpy(s + t, &e, sizeof e);
    sums += e;
  }
  float sum = sum_lanes(sums);
  for (; t < n; ++t) {
    s[t] = exp_clamped(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

// ---- rows of each weight format ---------------------------------------------------------------
constexpr int ROWS = 4;  // float32 and Q8-row products: output rows at once, sharing the loads of x

#include "activations.h"
#include "q4_blocks.h"

// out[r] = W[r] . x for ROWS float32 rows starting at w (row stride k).
void rows_f32(const float* w, const float* x, int64_t k, float* out) {
  f32xL acc[ROWS] = {};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    const f32xL xv = load<f32xL>(x + i);
    for (int r = 0; r < ROWS; ++r) acc[r] += load<f32xL>(w + r * k + i) * xv;
  }
  for (int r = 0; r < ROWS; ++r) {
    float s = sum_lanes(acc[r]);
    for (int64_t j = i; j < k; ++j) s += w[r * k + j] * x[j];
    out[r] = s;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 int32 lanes, each the sum of 4 products of unsigned bytes a and signed bytes b.
inline __m256i dot_u8_s8(__m256i a, __m256i b) { return dot_accumulate(_mm256_setzero_si256(), a, b); }

inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
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
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.high(i / GROUP)));
    const __m256i xq_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.low(i / GROUP)));
    const __m256 x_scale = _mm256_set1_ps(a.dot_scales[i / GROUP]);
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

#if HL_AVX512_VNNI
// Rows n0..n1-1 (n1 - n0 a multiple of 8) of a (G, N, 32) table with (G, N) scales (the GGUF
// Q8_0 head), group by group, for every prepared input row m: on 512-bit registers, two code
// rows per register, their magnitudes and signs taken once for all input rows. The integer
// dots are exact, so they equal the 256-bit version's (and AMX tiles'); the float steps are the
// same: out = fma(float(D), scale[g, n] * dot_scales[g], out) over the groups from 0,
// written as fused multiply-adds (a multiply and an add left to the compiler may or may not be
// contracted into one, differently in different kernels).
void q8_groups_range(const int8_t* w, const float* scales, const ActivationRows& acts, int64_t n0, int64_t n1,
                     int64_t n_rows, int64_t groups, float* out, int64_t n_out) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* slab = w + g * n_rows * GROUP;
    const float* slab_scales = scales + g * n_rows;
    for (int64_t n = n0; n < n1; n += 8) {
      const int8_t* rows = slab + n * GROUP;
      __builtin_prefetch(rows + 16 * 8 * GROUP);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 64);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 128);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 192);
      __m512i magnitudes[4];
      __mmask64 negative[4];
      for (int p = 0; p < 4; ++p) {  // rows 2p and 2p + 1
        const __m512i codes = _mm512_loadu_si512(rows + p * 2 * GROUP);
        magnitudes[p] = _mm512_abs_epi8(codes);
        negative[p] = _mm512_movepi8_mask(codes);
      }
      const __m256 row_scale_values = _mm256_loadu_ps(slab_scales + n);
      for (int64_t m = 0; m < acts.rows(); ++m) {
        const Activation a = acts.row(m);
        const __m512i xq = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.high(g))));
        const __m512i xq_low = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.low(g))));
        __m256i dots[8];
        for (int p = 0; p < 4; ++p) {
          const __m512i signed_q = _mm512_mask_sub_epi8(xq, negative[p], zero, xq);  // x * sign(code)
          const __m512i signed_low = _mm512_mask_sub_epi8(xq_low, negative[p], zero, xq_low);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(zero, magnitudes[p], signed_q), 7),
                                                  magnitudes[p], signed_low);
          dots[2 * p] = _mm512_castsi512_si256(dot);
          dots[2 * p + 1] = _mm512_extracti64x4_epi64(dot, 1);
        }
        const __m256 row_scales = _mm256_mul_ps(row_scale_values, _mm256_set1_ps(a.dot_scales[g]));
        float* o = out + m * n_out + n;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each_of_8(dots)), row_scales,
                                            g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o)));
      }
    }
  }
}
#else
// Rows n0..n1-1 (n1 - n0 a multiple of 8) of a (G, N, 32) table with (G, N) scales (the GGUF
// Q8_0 head), group by group, for every prepared input row m: each group's rows are one
// contiguous slab, so a thread reads its rows of the table as one sequential stream per group
// (each block of 8 rows once for all input rows); out (M, n_out) accumulates across groups.
void q8_groups_range(const int8_t* w, const float* scales, const ActivationRows& acts, int64_t n0, int64_t n1,
                     int64_t n_rows, int64_t groups, float* out, int64_t n_out) {
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* slab = w + g * n_rows * GROUP;
    const float* slab_scales = scales + g * n_rows;
    for (int64_t n = n0; n < n1; n += 8) {
      const int8_t* rows = slab + n * GROUP;
      __builtin_prefetch(rows + 16 * 8 * GROUP);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 64);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 128);
      __builtin_prefetch(rows + 16 * 8 * GROUP + 192);
      for (int64_t m = 0; m < acts.rows(); ++m) {
        const Activation a = acts.row(m);
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.high(g)));
        const __m256i xq_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.low(g)));
        const __m256 x_scale = _mm256_set1_ps(a.dot_scales[g]);
        __m256i dots[8];
        for (int r = 0; r < 8; ++r) dots[r] = dot_s8_s8(rows + r * GROUP, xq, xq_low);
        const __m256 row_scales = _mm256_mul_ps(_mm256_loadu_ps(slab_scales + n), x_scale);
        float* o = out + m * n_out + n;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each_of_8(dots)), row_scales,
                                            g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o)));
      }
    }
  }
}
#endif
#else
inline f32x16 i8_to_f32(i8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }

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

void q8_groups_range(const int8_t* w, const float* scales, const ActivationRows& acts, int64_t n0, int64_t n1,
                     int64_t n_rows, int64_t groups, float* out, int64_t n_out) {
  for (int64_t n = n0; n < n1; n += ROWS)
    for (int64_t m = 0; m < acts.rows(); ++m)
      rows_q8_groups(w, scales, acts.row(m), n, n_rows, groups, out + m * n_out + n);
}
#endif

#include "amx.h"

// Whether x @ W.T of `rows` input rows runs on AMX tiles (the same results as the vector kernels).
inline bool tile_product(const HLLinear& w, int64_t rows) {
  if (!amx_usable()) return false;
  if (w.format == FORMAT_Q4) return rows >= AMX_MIN_ROWS_Q4;
  return w.format == FORMAT_Q8_GROUPS && rows >= AMX_MIN_ROWS_Q8;
}

// The same for one row (the remainder when N is not a multiple of ROWS; not Q4, whose blocks
// cover every row), plain loops.
float row_tail(const HLLinear& w, const float* x, int64_t n) {
  const int64_t k = w.in_features;
  float s = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t g = i / GROUP, j = i % GROUP;
    float value;
    switch (w.format) {
      case FORMAT_F32:
        value = static_cast<const float*>(w.weight)[n * k + i];
        break;
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

// out[m, n0:n1] of x @ W.T (+ bias) for every prepared row m (out is (M, N)); n0 a multiple of
// 16. Each block of weight rows is read once for all M input rows (it stays in L1 between them);
// with many input rows, on tiles where the CPU has them (tile_product; the same results).
void linear_rows(const HLLinear& w, const ActivationRows& acts, float* out, int64_t n0, int64_t n1) {
  const int64_t k = w.in_features, groups = k / GROUP, n_out = w.out_features, m_rows = acts.rows();
  [[maybe_unused]] const bool tiles = tile_product(w, m_rows);
  int64_t n = n0;
  if (w.format == FORMAT_Q4) {  // whole blocks of 16 rows (the last one may hold fewer)
    for (; n < n1; n += Q4_ROWS) {
      const uint8_t* blocks = static_cast<const uint8_t*>(w.weight) + (n / Q4_ROWS) * groups * Q4_BLOCK_BYTES;
      const int n_valid = static_cast<int>(std::min(Q4_ROWS, n1 - n));
#if HL_AMX
      if (tiles) {
        q4_rows_amx(blocks, acts, groups, out + n, n_out, n_valid);
        continue;
      }
#endif
      int64_t m = 0;  // input rows in tiles that share each group's unpacked codes
      for (; m + Q4_TILE <= m_rows; m += Q4_TILE) q4_rows<Q4_TILE>(blocks, acts, m, groups, out + n, n_out, n_valid);
      for (; m < m_rows; ++m) q4_rows<1>(blocks, acts, m, groups, out + n, n_out, n_valid);
    }
  }
  if (w.format == FORMAT_Q8_GROUPS) {  // group-major over the whole range, 16 or 8 rows at a time
    const int8_t* codes = static_cast<const int8_t*>(w.weight);
    const float* scales = static_cast<const float*>(w.scales);
#if HL_AMX
    if (tiles) {
      const int64_t whole = n0 + (n1 - n0) / 16 * 16;
      q8_groups_range_amx(codes, scales, acts, n0, whole, n_out, groups, out, n_out);
      n = whole;
    }
#endif
    const int64_t end = n + (n1 - n) / 8 * 8;
    q8_groups_range(codes, scales, acts, n, end, n_out, groups, out, n_out);
    n = end;
  }
  for (; n + ROWS <= n1; n += ROWS) {
    for (int64_t m = 0; m < m_rows; ++m) {
      const Activation a = acts.row(m);
      float* o = out + m * n_out + n;
      switch (w.format) {
        case FORMAT_F32:
          rows_f32(static_cast<const float*>(w.weight) + n * k, a.x, k, o);
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

// ---- the thread team ----------------------------------------------------------------------
// Every *_team function runs on each thread of a team with the same arguments; `team` says
// which thread it is. Work is split by static ranges that depend on the sizes and the team
// size only, and no row's arithmetic depends on which thread computes it.
//
// The team is the library's own persistent pool (no OpenMP runtime: -fopenmp-simd only), so the
// wait policy is ours: a thread that waits (at a barrier, or for the next step) spins for
// `spins` pauses, then sleeps on a futex. Spinning alone starves a thread whose core is busy
// elsewhere (2-thread decode fell to 1.5% of its speed with one core taken); sleeping frees the
// core, so the kernel scheduler can run the late thread there. hl_set_spin_wait sets `spins`.

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  (void)word;
  (void)expected;
  std::this_thread::yield();
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// A word threads wait on until it changes: spin, then sleep; the writer wakes sleepers only.
struct WaitWord {
  std::atomic<uint32_t> value{0};
  std::atomic<int32_t> sleepers{0};

  void wait_change(uint32_t seen, int32_t spins) {
    for (int32_t i = 0; i < spins; ++i) {
      if (value.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
    }
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    while (value.load(std::memory_order_seq_cst) == seen) futex_wait(value, seen);
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
  void publish(uint32_t next) {
    value.store(next, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(value);
  }
};

// A reusable barrier for n threads (the last to arrive opens the next phase), and a work counter
// per phase (two, alternating: the one of the next phase is reset by the last arrival).
struct Barrier {
  alignas(64) std::atomic<int32_t> arrived{0};
  alignas(64) WaitWord phase;
  alignas(64) std::atomic<int64_t> claimed[2] = {};

  void wait(int32_t n, int32_t spins) {
    if (n == 1) {  // a team of one stays in its phase: its count starts over
      claimed[phase.value.load(std::memory_order_relaxed) % 2].store(0, std::memory_order_relaxed);
      return;
    }
    const uint32_t current = phase.value.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived.store(0, std::memory_order_relaxed);
      claimed[(current + 1) % 2].store(0, std::memory_order_relaxed);
      phase.publish(current + 1);
    } else {
      phase.wait_change(current, spins);
    }
  }

  // The next unclaimed item of this phase (every thread of the team draws from the same count).
  int64_t claim() { return claimed[phase.value.load(std::memory_order_acquire) % 2].fetch_add(1); }
};

struct Team {
  int thread;
  int size;
  Barrier* sync;
  int32_t spins;
  void barrier() const { sync->wait(size, spins); }
  // Items shared out as the threads come for them (a late or descheduled thread takes fewer):
  // call until it returns >= the item count, then meet at a barrier. What an item computes must
  // not depend on the thread that takes it.
  int64_t claim() const { return sync->claim(); }
};

using TeamJob = void (*)(void* context, const Team& team);

// The persistent workers: worker i runs thread i + 1 of every team of more than i + 1 threads
// (the caller is thread 0). One team runs at a time.
class ThreadPool {
 public:
  void run(int32_t n_threads, TeamJob job, void* context) {
    std::lock_guard<std::mutex> one_team(run_mutex_);
    const int32_t n = std::max<int32_t>(1, n_threads);
    while (static_cast<int32_t>(workers_.size()) < n - 1) start_worker();
    const int32_t spins = spins_.load(std::memory_order_relaxed);
    job_ = job;
    context_ = context;
    size_ = n;
    for (int32_t i = 0; i < n - 1; ++i) workers_[i]->go.publish(workers_[i]->go.value.load() + 1);
    const Team team{0, n, &barrier_, spins};
    job(context, team);
    barrier_.wait(n, spins);  // every thread has finished the job
  }
  void set_spins(int32_t spins) { spins_.store(std::max<int32_t>(0, spins), std::memory_order_relaxed); }
  int32_t spins() const { return spins_.load(std::memory_order_relaxed); }
  // After fork() the child has none of the workers: forget them (they are not ours to join).
  void forget_workers() {
    workers_.clear();
    new (&run_mutex_) std::mutex();
    new (&barrier_) Barrier();
  }

 private:
  struct Worker {
    alignas(64) WaitWord go;
  };

  void start_worker() {
    const int32_t index = static_cast<int32_t>(workers_.size());
    workers_.push_back(new Worker());  // never freed: a worker lives as long as the process
    Worker* worker = workers_.back();
    std::thread([this, worker, index] {
      uint32_t seen = 0;
      for (;;) {
        worker->go.wait_change(seen, spins_.load(std::memory_order_relaxed));
        seen = worker->go.value.load(std::memory_order_acquire);
        const int32_t spins = spins_.load(std::memory_order_relaxed);
        const Team team{index + 1, size_, &barrier_, spins};
        job_(context_, team);
        barrier_.wait(team.size, spins);
      }
    }).detach();
  }

  std::mutex run_mutex_;
  std::vector<Worker*> workers_;
  std::atomic<int32_t> spins_{4000};
  Barrier barrier_;
  TeamJob job_ = nullptr;
  void* context_ = nullptr;
  int32_t size_ = 1;
};

ThreadPool& pool() {
  static ThreadPool* const instance = [] {
    auto* created = new ThreadPool();  // never destroyed: workers may outlive static destructors
    pthread_atfork(nullptr, nullptr, [] { pool().forget_workers(); });
    return created;
  }();
  return *instance;
}

template <typename Body>
void run_team(int32_t n_threads, Body&& body) {
  using Callable = std::remove_reference_t<Body>;
  pool().run(n_threads, [](void* context, const Team& team) { (*static_cast<Callable*>(context))(team); },
             const_cast<void*>(static_cast<const void*>(&body)));
}

// This thread's contiguous share [first, last) of n items.
struct Share {
  int64_t first, last;
  Share(int64_t n, const Team& team) {
    const int64_t per = (n + team.size - 1) / team.size;
    first = std::min(n, team.thread * per);
    last = std::min(n, first + per);
  }
};

// The output rows of a product are shared out in items of this many (whole 16-row weight blocks).
constexpr int64_t PRODUCT_ROWS = 128;

// From this many input rows a team prepares them together (each thread a share, then a
// barrier); fewer, each thread prepares them all itself (no barrier).
constexpr int64_t SHARED_PREPARATION_ROWS = 64;

// The output columns of x @ W.T (x: (rows, K) -> out: (rows, N)) in items of PRODUCT_ROWS
// (whole cache lines of out, and the same 4-, 8- and 16-row weight blocks whatever the team
// size), claimed by the threads as they come, then a barrier. The input rows are prepared (sums, int8
// digits) by each thread itself, or with many rows and a `shared` buffer by the team together.
// A row's result does not depend on the other rows or the team size.
void linear_team(const Team& team, const HLLinear& w, const float* x, float* out, int64_t rows,
                 ActivationRows* shared = nullptr) {
  thread_local ActivationRows own;
  const bool quantized_weights = w.format != FORMAT_F32;
  const bool quantize = quantized_weights && QUANTIZED_ACTIVATIONS;
  const TileLayout tiles = !tile_product(w, rows)  ? TileLayout::NONE
                           : w.format == FORMAT_Q4  ? TileLayout::SCALES
                                                    : TileLayout::COLUMNS;  // the Q8-group tile kernel
  ActivationRows* acts = &own;
  if (shared != nullptr && rows >= SHARED_PREPARATION_ROWS) {
    acts = shared;
    if (team.thread == 0) shared->reset(x, rows, w.in_features, quantized_weights, quantize, tiles);
    team.barrier();
    const Share blocks((rows + TILE_M - 1) / TILE_M, team);
    shared->fill(blocks.first * TILE_M, std::min(rows, blocks.last * TILE_M));
    team.barrier();
  } else {
    own.prepare(x, rows, w.in_features, quantized_weights, quantize, tiles);
  }
  const int64_t n = w.out_features;
  const int64_t blocks = (n + PRODUCT_ROWS - 1) / PRODUCT_ROWS;
  for (int64_t block = team.claim(); block < blocks; block = team.claim())
    linear_rows(w, *acts, out, block * PRODUCT_ROWS, std::min(n, (block + 1) * PRODUCT_ROWS));
  team.barrier();
}

#include "prefill_gemm.h"

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
void silu_times(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
  for (; i + WLANES <= n; i += WLANES) {
    const f32xW g = load<f32xW>(gate + i);
    const f32xW v = g / (1.0f + exp_vector(-g)) * load<f32xW>(up + i);
    std::memcpy(out + i, &v, sizeof v);
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
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

// ---- float16 KV: IEEE half <-> float32 (round to nearest even, as PyTorch's .to(float16)) ----
inline float to_float(float v) { return v; }

inline float to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline uint16_t to_half(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t abs = x & 0x7FFFFFFF;
  if (abs >= 0x7F800000) return static_cast<uint16_t>(sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0));
  if (abs >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (abs < 0x38800000) {  // subnormal half (or zero): round abs / 2^-24 to nearest even
    float scaled;
    const uint32_t abs_bits = abs;
    std::memcpy(&scaled, &abs_bits, sizeof scaled);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled * 16777216.0f)));
  }
  const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1) - (112u << 23);  // rebias, round to nearest even
  return static_cast<uint16_t>(sign | (rounded >> 13));
#endif
}

inline f32xL load_lanes(const float* p) { return load<f32xL>(p); }

inline f32xL load_lanes(const uint16_t* p) {
  f32xL v;
#if defined(__F16C__)
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#else
  for (int i = 0; i < LANES; ++i) v[i] = to_float(p[i]);
#endif
  return v;
}

// Write one head's row (d,) of k or v into a cache buffer of kv_dtype at element offset `at`.
void store_row(void* buffer, int32_t kv_dtype, int64_t at, const float* row, int64_t d) {
  if (kv_dtype == KV_F16) {
    uint16_t* out = static_cast<uint16_t*>(buffer) + at;
    for (int64_t i = 0; i < d; ++i) out[i] = to_half(row[i]);
  } else {
    std::memcpy(static_cast<float*>(buffer) + at, row, d * sizeof(float));
  }
}

inline f32xW load_wide(const float* p) { return load<f32xW>(p); }

inline f32xW load_wide(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  f32xW v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#else
  return load_lanes(p);
#endif
}

inline float sum_wide(f32xW v) {
  float s[WLANES];
  std::memcpy(s, &v, sizeof v);
  for (int width = WLANES / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
}

// The horizontal sums of four vectors (out[j] of v[j]), in a fixed order: a transposing reduction.
inline void sum4(const f32xW v[4], float out[4]) {
#if defined(__AVX512F__)
  __m512 a, b, c, d;
  std::memcpy(&a, &v[0], 64), std::memcpy(&b, &v[1], 64), std::memcpy(&c, &v[2], 64), std::memcpy(&d, &v[3], 64);
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // per 128 bits: a b c d
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
  _mm_storeu_ps(out, _mm512_castps512_ps128(x));
#elif defined(__AVX__)
  __m256 a, b, c, d;
  std::memcpy(&a, &v[0], 32), std::memcpy(&b, &v[1], 32), std::memcpy(&c, &v[2], 32), std::memcpy(&d, &v[3], 32);
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 x = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
#else
  for (int j = 0; j < 4; ++j) out[j] = sum_wide(v[j]);
#endif
}

// scores[g * stride + t] = scale * q_g . key_t for the `group` queries sharing a KV head (d a
// multiple of WLANES): keys four at a time, each key vector loaded once for all the queries, the
// four dots of a query reduced together.
template <int GROUP_SIZE, typename T>
void score_chunk_fixed(const float* q, const T* keys, int64_t len, int64_t d, float scale, float* scores,
                       int64_t stride) {
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    f32xW dots[GROUP_SIZE][4] = {};
    for (int64_t i = 0; i < d; i += WLANES) {
      f32xW k[4];
      for (int j = 0; j < 4; ++j) k[j] = load_wide(keys + (t + j) * d + i);
      for (int g = 0; g < GROUP_SIZE; ++g) {
        const f32xW qv = load_wide(q + g * d + i);
        for (int j = 0; j < 4; ++j) dots[g][j] += qv * k[j];
      }
    }
    for (int g = 0; g < GROUP_SIZE; ++g) {
      float sums[4];
      sum4(dots[g], sums);
      for (int j = 0; j < 4; ++j) scores[g * stride + t + j] = sums[j] * scale;
    }
  }
  for (; t < len; ++t) {
    f32xW dots[GROUP_SIZE] = {};
    for (int64_t i = 0; i < d; i += WLANES) {
      const f32xW k = load_wide(keys + t * d + i);
      for (int g = 0; g < GROUP_SIZE; ++g) dots[g] += load_wide(q + g * d + i) * k;
    }
    for (int g = 0; g < GROUP_SIZE; ++g) scores[g * stride + t] = sum_wide(dots[g]) * scale;
  }
}

template <typename T>
void score_chunk(const float* q, const T* keys, int64_t len, int group, int64_t d, float scale, float* scores,
                 int64_t stride) {
  if (d % WLANES == 0) {
    switch (group) {
      case 1: return score_chunk_fixed<1>(q, keys, len, d, scale, scores, stride);
      case 2: return score_chunk_fixed<2>(q, keys, len, d, scale, scores, stride);
      case 3: return score_chunk_fixed<3>(q, keys, len, d, scale, scores, stride);
      case 4: return score_chunk_fixed<4>(q, keys, len, d, scale, scores, stride);
      case 5: return score_chunk_fixed<5>(q, keys, len, d, scale, scores, stride);
      case 6: return score_chunk_fixed<6>(q, keys, len, d, scale, scores, stride);
      case 7: return score_chunk_fixed<7>(q, keys, len, d, scale, scores, stride);
      case 8: return score_chunk_fixed<8>(q, keys, len, d, scale, scores, stride);
      default: break;
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* key = keys + t * d;
    for (int g = 0; g < group; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s += q[g * d + i] * to_float(key[i]);
      scores[g * stride + t] = s * scale;
    }
  }
}

// acc[g * d ..] = sum_t scores[g * stride + t] * values[t] for each query g of a group: each
// value vector loaded once for all the group's queries while their accumulators fit in
// registers, else one query at a time (the chunk's value rows stay in L1/L2 between them).
template <int VECS, int GROUP_SIZE, typename T>
void accumulate_values_fixed(const T* values, int64_t len, const float* scores, int64_t stride, float* acc) {
  constexpr int64_t D = WLANES * VECS;
  if constexpr (GROUP_SIZE * VECS <= 24) {
    f32xW a[GROUP_SIZE][VECS] = {};
    for (int64_t t = 0; t < len; ++t) {
      for (int i = 0; i < VECS; ++i) {
        const f32xW v = load_wide(values + t * D + WLANES * i);
        for (int g = 0; g < GROUP_SIZE; ++g) a[g][i] += v * scores[g * stride + t];
      }
    }
    for (int g = 0; g < GROUP_SIZE; ++g) std::memcpy(acc + g * D, a[g], sizeof a[g]);
  } else {
    for (int g = 0; g < GROUP_SIZE; ++g) {
      f32xW a[VECS] = {};
      const float* p = scores + g * stride;
      for (int64_t t = 0; t < len; ++t)
        for (int i = 0; i < VECS; ++i) a[i] += load_wide(values + t * D + WLANES * i) * p[t];
      std::memcpy(acc + g * D, a, sizeof a);
    }
  }
}

template <int VECS, typename T>
bool accumulate_values_group(const T* values, int64_t len, int group, const float* scores, int64_t stride,
                             float* acc) {
  switch (group) {
    case 1: return accumulate_values_fixed<VECS, 1>(values, len, scores, stride, acc), true;
    case 2: return accumulate_values_fixed<VECS, 2>(values, len, scores, stride, acc), true;
    case 3: return accumulate_values_fixed<VECS, 3>(values, len, scores, stride, acc), true;
    case 4: return accumulate_values_fixed<VECS, 4>(values, len, scores, stride, acc), true;
    case 5: return accumulate_values_fixed<VECS, 5>(values, len, scores, stride, acc), true;
    case 6: return accumulate_values_fixed<VECS, 6>(values, len, scores, stride, acc), true;
    case 7: return accumulate_values_fixed<VECS, 7>(values, len, scores, stride, acc), true;
    case 8: return accumulate_values_fixed<VECS, 8>(values, len, scores, stride, acc), true;
    default: return false;
  }
}

template <typename T>
void accumulate_values(const T* values, int64_t len, int group, int64_t d, const float* scores, int64_t stride,
                       float* acc) {
  bool done = false;
  if (d % WLANES == 0) {
    switch (d / WLANES) {
      case 2: done = accumulate_values_group<2>(values, len, group, scores, stride, acc); break;
      case 4: done = accumulate_values_group<4>(values, len, group, scores, stride, acc); break;
      case 6: done = accumulate_values_group<6>(values, len, group, scores, stride, acc); break;
      case 8: done = accumulate_values_group<8>(values, len, group, scores, stride, acc); break;
      case 16: done = accumulate_values_group<16>(values, len, group, scores, stride, acc); break;
      default: break;
    }
  }
  if (done) return;
  std::fill(acc, acc + group * d, 0.0f);
  for (int g = 0; g < group; ++g)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] += scores[g * stride + t] * to_float(values[t * d + i]);
}

// How one row's attention over `total` tokens is cut into work items (kv head, token chunk):
// about TARGET_ITEMS items, each at least 64 tokens. It depends on the row's length only (not
// on the team size or the batch), so the chunks, and the order their results are merged in,
// are the same alone or in any batch, on any number of threads.
struct AttentionSplit {
  static constexpr int64_t TARGET_ITEMS = 32;
  int64_t chunk, n_chunks, items;
  AttentionSplit(int64_t total, int n_kv_heads) {
    chunk = std::max<int64_t>(64, (total + chunks_per_head(n_kv_heads) - 1) / chunks_per_head(n_kv_heads));
    n_chunks = (total + chunk - 1) / chunk;
    items = n_kv_heads * n_chunks;
  }
  static int64_t chunks_per_head(int n_kv_heads) { return (TARGET_ITEMS + n_kv_heads - 1) / n_kv_heads; }
  static int64_t max_items(int n_kv_heads) { return n_kv_heads * chunks_per_head(n_kv_heads); }
};

#include "prefill_attention.h"

// Scratch shared by a team for one step of `rows` tokens. The entry points keep one (the pool's
// lock: one team at a time) and size it under the lock (thread 0, then a barrier); its buffers
// only grow, so steps do not page-fault fresh memory.
struct Workspace {
  std::vector<float> normed, qkv, attn, proj, gate_up, mlp, h, part_out, part_max, part_sum;
  std::vector<int64_t> item_offsets;  // (rows + 1,): where each row's attention items start
  // Prefill: the rows are segments of consecutive positions, segment s rows offsets[s] ..
  // offsets[s + 1] - 1 of one sequence (prefill chunks of several sequences); else one token per row.
  bool prefill = false;
  int64_t segments = 0;
  const int64_t* offsets = nullptr;
  std::vector<int64_t> row_segment;  // (rows,): each prefill row's segment
  prefill::Inputs inputs;  // prefill products: the input rows as the panels read them
  ActivationRows acts;     // the decode products' input rows, prepared by the team

  void resize(const HLDecoderLayer& w, int64_t rows) {
    const int64_t d = w.head_dim, q_size = w.n_heads * d, kv_size = w.n_kv_heads * d;
    const int64_t items = AttentionSplit::max_items(w.n_kv_heads);
    const int64_t group = w.n_heads / w.n_kv_heads;
    grow(normed, rows * w.hidden);
    grow(qkv, rows * (q_size + 2 * kv_size));
    grow(attn, rows * q_size);
    grow(proj, rows * w.hidden);
    grow(gate_up, rows * 2 * w.intermediate);
    grow(mlp, rows * w.intermediate);
    grow(h, rows * w.hidden);
    if (!prefill) {  // the one-row attention's partial results
      grow(part_out, rows * items * group * d);
      grow(part_max, rows * items * group);
      grow(part_sum, rows * items * group);
    }
    grow(item_offsets, rows + 1);
    if (prefill) inputs.reserve(rows, std::max({w.hidden, w.intermediate, q_size}));
  }

  // One token per row (decode rows, each with its own cache).
  void for_tokens(const HLDecoderLayer& w, int64_t rows) {
    prefill = false;
    resize(w, rows);
  }

  // Prefill segments (see above).
  void for_segments(const HLDecoderLayer& w, int64_t n_segments, const int64_t* segment_offsets) {
    prefill = true;
    segments = n_segments;
    offsets = segment_offsets;
    const int64_t rows = segment_offsets[n_segments];
    resize(w, rows);
    grow(row_segment, rows);
    for (int64_t s = 0; s < n_segments; ++s)
      std::fill(row_segment.begin() + segment_offsets[s], row_segment.begin() + segment_offsets[s + 1], s);
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  }
};

// The workspace of the entry points (used under the pool's lock only).
Workspace& shared_workspace() {
  static Workspace ws;
  return ws;
}

// Whether a prefill chunk's product runs through dequantized panels (prefill_gemm.h) rather than
// the decode products: from prefill::panel_min_rows rows on, except for Q4 and Q8-group weights
// on a CPU with AMX tiles, whose decode products are faster than the panels from the tiles'
// crossover on and the same bits below it (so a prefill row never depends on the chunk's size).
inline bool panel_product(const HLLinear& w, int64_t rows) {
  return !tile_product(w, TILE_M) && rows >= prefill::panel_min_rows(w);
}

// x @ W.T for the `rows` rows of a step: decode's batch-invariant products, and for prefill
// segments the product each segment would get alone (see panel_product: a segment's rows go
// through the dequantized panels when it is long enough by itself), so that a prompt's prefill
// does not depend on the other prompts prefilled with it. Every row's result depends on its own
// row and path only (both products are row by row), so runs of segments with the same path go
// together.
void products_team(const Team& team, const HLLinear& w, const float* x, float* out, int64_t rows, Workspace& ws) {
  if (!ws.prefill) return linear_team(team, w, x, out, rows, &ws.acts);
  const int64_t k = w.in_features, n = w.out_features;
  for (int64_t s = 0; s < ws.segments;) {
    const bool panels = panel_product(w, ws.offsets[s + 1] - ws.offsets[s]);
    int64_t end = s + 1;
    while (end < ws.segments && panel_product(w, ws.offsets[end + 1] - ws.offsets[end]) == panels) ++end;
    const int64_t r0 = ws.offsets[s], run = ws.offsets[end] - r0;
    if (panels)
      prefill::linear_team(team, w, ws.inputs, x + r0 * k, out + r0 * n, run);
    else
      linear_team(team, w, x + r0 * k, out + r0 * n, run, &ws.acts);
    s = end;
  }
}

// One token's grouped-query attention of work item `item` (kv head, token chunk) of a row:
// its running max, sum and weighted values per query head of the group.
template <typename T>
void attention_item(const float* q, const T* k_cache, const T* v_cache, int64_t capacity, int64_t total,
                    int group, int64_t d, const AttentionSplit& split, int64_t item, float* part_out,
                    float* part_max, float* part_sum, std::vector<float>& scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t chunk = split.chunk;
  if (static_cast<int64_t>(scores.size()) < group * chunk) scores.resize(group * chunk);
  const int64_t kv_head = item / split.n_chunks;
  const int64_t t0 = (item % split.n_chunks) * chunk;
  const int64_t len = std::min(total, t0 + chunk) - t0;
  const T* keys = k_cache + kv_head * capacity * d;
  const T* values = v_cache + kv_head * capacity * d;
  score_chunk(q + kv_head * group * d, keys + t0 * d, len, group, d, scale, scores.data(), chunk);
  for (int g = 0; g < group; ++g) {
    float* s = scores.data() + g * chunk;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
    part_max[item * group + g] = m;
    part_sum[item * group + g] = exp_shifted(s, len, m);
  }
  accumulate_values(values + t0 * d, len, group, d, scores.data(), chunk, part_out + item * group * d);
}

// Query head h's output (D,) from a row's work items, merged exactly, chunk by chunk in order.
void merge_head(int h, int group, int64_t d, const AttentionSplit& split, const float* part_out,
                const float* part_max, const float* part_sum, float* o) {
  const int64_t kv_head = h / group, g = h % group, n_chunks = split.n_chunks;
  float m = -INFINITY;
  for (int64_t c = 0; c < n_chunks; ++c) m = std::max(m, part_max[(kv_head * n_chunks + c) * group + g]);
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
}

// Attention of each row's queries q (H, D) (row r at q + r * q_stride) over its own cache (caches[r]: (Hkv, capacity,
// D), its first start + 1 tokens) -> out (rows, H, D), by the team. The work items of every row
// (kv head, token chunk) are shared out together, then each (row, query head) is merged.
// `scores` is the calling thread's own scratch.
void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches, int64_t rows,
                    int n_heads,
                    int n_kv_heads, int head_dim, float* out, Workspace& ws, std::vector<float>& scores) {
  const int group = n_heads / n_kv_heads;
  const int64_t d = head_dim, row_items = AttentionSplit::max_items(n_kv_heads);
  int64_t* offsets = ws.item_offsets.data();  // every thread computes the same prefix sums
  int64_t all_items = 0;
  for (int64_t r = 0; r < rows; ++r) {
    offsets[r] = all_items;
    all_items += AttentionSplit(caches[r].attended(), n_kv_heads).items;
  }
  const Share share(all_items, team);
  int64_t r = 0;
  for (int64_t i = share.first; i < share.last; ++i) {
    while (i >= offsets[r] + AttentionSplit(caches[r].attended(), n_kv_heads).items) ++r;
    const HLLayerCache& c = caches[r];
    const AttentionSplit split(c.attended(), n_kv_heads);
    float* part_out = ws.part_out.data() + r * row_items * group * d;
    float* part_max = ws.part_max.data() + r * row_items * group;
    float* part_sum = ws.part_sum.data() + r * row_items * group;
    const int64_t skip = c.first() * d;  // a sliding window starts `first` rows into every head
    if (c.kv_dtype == KV_F16)
      attention_item(q + r * q_stride, static_cast<const uint16_t*>(c.keys) + skip,
                     static_cast<const uint16_t*>(c.values) + skip, c.capacity, c.attended(), group, d, split,
                     i - offsets[r], part_out, part_max, part_sum, scores);
    else
      attention_item(q + r * q_stride, static_cast<const float*>(c.keys) + skip,
                     static_cast<const float*>(c.values) + skip, c.capacity, c.attended(), group, d, split,
                     i - offsets[r], part_out, part_max, part_sum, scores);
  }
  team.barrier();  // every item is done
  const Share heads(rows * n_heads, team);
  for (int64_t i = heads.first; i < heads.last; ++i) {
    const int64_t row = i / n_heads;
    const int h = static_cast<int>(i % n_heads);
    merge_head(h, group, d, AttentionSplit(caches[row].attended(), n_kv_heads),
               ws.part_out.data() + row * row_items * group * d, ws.part_max.data() + row * row_items * group,
               ws.part_sum.data() + row * row_items * group, out + i * d);
  }
  team.barrier();
}

// One decoder layer for one token of each of `rows` sequences, by the team:
//   x_out = h + mlp(norm(h)),  h = x + o(attention(rope(q), cache + rope(k), cache + v)),
// writing row r's k and v at position caches[r].start of its cache (Hkv, capacity, D).
// x_in, x_out: (rows, hidden), x_in may alias x_out; cos/sin: (rows, D) rotary tables of each
// row's position. Each weight matrix is read once for all rows; each row's arithmetic is the
// same whatever the other rows and the team size.
// With ws.prefill the rows are segments of consecutive positions (prefill chunks of one or more
// sequences: caches holds one entry per segment, the layer's cache of its sequence with start =
// the segment's first position): the products may go through dequantized panels, and the
// attention is the chunks' causal, query-tiled kernel (prefill_attention.h).
void decode_layer_team(const Team& team, const HLDecoderLayer& w, const float* x_in, float* x_out,
                       const HLLayerCache* caches, int64_t rows, const float* cos, const float* sin, Workspace& ws,
                       std::vector<float>& scores) {
  const int64_t hidden = w.hidden, d = w.head_dim, inter = w.intermediate;
  const int64_t q_size = w.n_heads * d, kv_size = w.n_kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const Share mine(rows, team);  // the rows this thread takes in the row-wise steps
  PHASE_END(team, BETWEEN_STEPS);
  for (int64_t r = mine.first; r < mine.last; ++r)
    rms_norm(x_in + r * hidden, w.attn_norm, w.eps, hidden, ws.normed.data() + r * hidden);
  team.barrier();
  PHASE_END(team, NORM);
  products_team(team, w.qkv, ws.normed.data(), ws.qkv.data(), rows, ws);
  PHASE_END(team, QKV);
  for (int64_t r = mine.first; r < mine.last; ++r) {
    float* qkv = ws.qkv.data() + r * qkv_size;
    const int64_t segment = ws.prefill ? ws.row_segment[r] : r;
    const HLLayerCache& c = caches[segment];
    const int64_t position = ws.prefill ? c.start + (r - ws.offsets[segment]) : c.start;
    for (int64_t head = 0; head < w.n_heads + w.n_kv_heads; ++head) rotate_half(qkv + head * d, cos + r * d, sin + r * d, d);
    for (int64_t kv_head = 0; kv_head < w.n_kv_heads; ++kv_head) {
      const int64_t row = (kv_head * c.capacity + position) * d;
      store_row(c.keys, c.kv_dtype, row, qkv + q_size + kv_head * d, d);
      store_row(c.values, c.kv_dtype, row, qkv + q_size + kv_size + kv_head * d, d);
    }
  }
  team.barrier();
  PHASE_END(team, ROPE_KV);
  if (ws.prefill)
    prefill::attention_team(team, ws.qkv.data(), qkv_size, caches, ws.offsets, ws.segments, w.n_heads, w.n_kv_heads,
                            d, ws.attn.data());
  else
    attention_team(team, ws.qkv.data(), qkv_size, caches, rows, w.n_heads, w.n_kv_heads, w.head_dim, ws.attn.data(),
                   ws, scores);
  PHASE_END(team, ATTENTION);
  products_team(team, w.o, ws.attn.data(), ws.proj.data(), rows, ws);
  PHASE_END(team, O_PROJ);
  for (int64_t r = mine.first; r < mine.last; ++r) {
    float* h = ws.h.data() + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) h[i] = x_in[r * hidden + i] + ws.proj[r * hidden + i];
    rms_norm(h, w.mlp_norm, w.eps, hidden, ws.normed.data() + r * hidden);
  }
  team.barrier();
  PHASE_END(team, RESIDUAL_NORM);
  products_team(team, w.gate_up, ws.normed.data(), ws.gate_up.data(), rows, ws);
  PHASE_END(team, GATE_UP);
  for (int64_t r = mine.first; r < mine.last; ++r) {  // row r's (gate, up) -> silu(gate) * up, as (rows, inter)
    const float* gate = ws.gate_up.data() + r * 2 * inter;
    silu_times(gate, gate + inter, ws.mlp.data() + r * inter, inter);
  }
  team.barrier();
  PHASE_END(team, SILU);
  products_team(team, w.down, ws.mlp.data(), ws.proj.data(), rows, ws);
  PHASE_END(team, DOWN);
  for (int64_t r = mine.first; r < mine.last; ++r)
    for (int64_t i = 0; i < hidden; ++i) x_out[r * hidden + i] = ws.h[r * hidden + i] + ws.proj[r * hidden + i];
  team.barrier();
  PHASE_END(team, RESIDUAL);
}

}  // namespace

extern "C" {

// out = x @ W.T (+ bias) for rows x (rows, in_features) -> out (rows, out_features).
void hl_linear(const HLLinear* w, const float* x, float* out, int64_t rows, int32_t n_threads) {
  run_team(n_threads, [&](const Team& team) { linear_team(team, *w, x, out, rows); });
}

// out = x @ W.T (+ bias) for the many rows of a prefill chunk (rows, in_features) -> (rows,
// out_features): dequantized panels (prefill_gemm.h) where panel_product says so, the decode
// products below that.
void hl_prefill_linear(const HLLinear* w, const float* x, float* out, int64_t rows, int32_t n_threads) {
  Workspace& ws = shared_workspace();  // its input-row buffers: one team runs at a time (the pool's lock)
  if (!panel_product(*w, rows)) {
    run_team(n_threads, [&](const Team& team) { linear_team(team, *w, x, out, rows, &ws.acts); });
    return;
  }
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.inputs.reserve(rows, w->in_features);  // under the lock
    team.barrier();
    prefill::linear_team(team, *w, ws.inputs, x, out, rows);
  });
}

// The element type of quantized weights' prefill panels: "bfloat16" (AVX512-BF16 pair dots) or
// "float32" (float32 weights always use float32 panels).
const char* hl_prefill_precision() { return prefill::HAVE_BF16_DOTS ? "bfloat16" : "float32"; }

// Whether hl_prefill_linear's product of `rows` rows with w runs through dequantized panels (1) or
// the decode products (0).
int32_t hl_prefill_uses_panels(const HLLinear* w, int64_t rows) { return panel_product(*w, rows); }

// Whether products of many rows run on AMX tiles: built for them, granted by the OS, and on.
int32_t hl_amx() { return amx_usable(); }

// Turn the AMX tiles on (1) or off (0; the vector kernels give the same results); returns hl_amx().
int32_t hl_set_amx(int32_t on) {
#if HL_AMX
  amx_enabled.store(on != 0);
#else
  (void)on;
#endif
  return hl_amx();
}

// Attention of q (H, D) over a (Hkv, capacity, D) cache's first `total` tokens (float32 or
// float16, kv_dtype) -> out (H, D).
void hl_attention(const float* q, const void* k_cache, const void* v_cache, int32_t kv_dtype, int64_t capacity,
                  int64_t total, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float* out, int32_t n_threads) {
  HLDecoderLayer shape{};
  shape.n_heads = n_heads;
  shape.n_kv_heads = n_kv_heads;
  shape.head_dim = head_dim;
  const HLLayerCache cache{const_cast<void*>(k_cache), const_cast<void*>(v_cache), capacity, total - 1, kv_dtype, 0};
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_tokens(shape, 1);
    team.barrier();
    std::vector<float> scores;
    attention_team(team, q, 0, &cache, 1, n_heads, n_kv_heads, head_dim, out, ws, scores);
  });
}

// Causal attention of a prefill chunk: q (rows, H, D) at positions start .. start + rows - 1
// over a (Hkv, capacity, D) cache whose rows 0 .. start + rows - 1 are written (float32 or
// float16, kv_dtype), with a sliding window (0: none) -> out (rows, H, D).
void hl_prefill_attention(const float* q, const void* k_cache, const void* v_cache, int32_t kv_dtype, int64_t capacity,
                          int64_t start, int64_t rows, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                          int32_t window, float* out, int32_t n_threads) {
  const HLLayerCache cache{const_cast<void*>(k_cache), const_cast<void*>(v_cache), capacity, start, kv_dtype, window};
  const int64_t offsets[2] = {0, rows};
  run_team(n_threads, [&](const Team& team) {
    prefill::attention_team(team, q, int64_t{n_heads} * head_dim, &cache, offsets, 1, n_heads, n_kv_heads, head_dim,
                            out);
  });
}

// One decoder layer for one token of each of `rows` sequences (see decode_layer_team); caches:
// (rows,), the layer's cache of each row.
void hl_decode_layer(const HLDecoderLayer* layer, const float* x_in, float* x_out, const HLLayerCache* caches,
                     int64_t rows, const float* cos, const float* sin, int32_t n_threads) {
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_tokens(*layer, rows);
    team.barrier();
    std::vector<float> scores;
    decode_layer_team(team, *layer, x_in, x_out, caches, rows, cos, sin, ws, scores);
  });
}

// A whole decode step after the embedding for `rows` sequences, in one team: every layer in
// order, the final norm and the head. caches: (n_layers, rows), layer-major; x (rows, hidden)
// is overwritten; cos/sin (rows, D); logits (rows, N).
void hl_decode_model(const HLDecoderLayer* layers, const HLLayerCache* caches, int64_t n_layers, int64_t rows,
                     float* x, const float* cos, const float* sin, const float* final_norm, float eps,
                     const HLLinear* head, float* logits, int32_t n_threads) {
  Workspace& ws = shared_workspace();
  const int64_t hidden = layers[0].hidden;
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_tokens(layers[0], rows);  // every layer of a model has the same shapes
    team.barrier();
    std::vector<float> scores;
    for (int64_t i = 0; i < n_layers; ++i)
      decode_layer_team(team, layers[i], x, x, caches + i * rows, rows, cos, sin, ws, scores);
    const Share mine(rows, team);
    for (int64_t r = mine.first; r < mine.last; ++r)
      rms_norm(x + r * hidden, final_norm, eps, hidden, ws.normed.data() + r * hidden);
    team.barrier();
    PHASE_END(team, FINAL_NORM);
    linear_team(team, *head, ws.normed.data(), logits, rows, &ws.acts);
    PHASE_END(team, HEAD);
  });
}

// Prefill chunks of one or more sequences after the embedding, in one team: segment s is rows
// offsets[s] .. offsets[s + 1] - 1 of x, consecutive positions of one sequence; every layer in
// order, then the final norm and the head for every row (all_logits) or for each segment's last
// row. caches: (n_layers, segments), layer-major, each the layer's cache of the segment's sequence
// with start = the segment's first position (its rows are written); x (rows, hidden) is
// overwritten; cos/sin (rows, D) of each row's position; logits (rows or segments, N).
void hl_prefill_model(const HLDecoderLayer* layers, const HLLayerCache* caches, int64_t n_layers, int64_t segments,
                      const int64_t* offsets, float* x, const float* cos, const float* sin, const float* final_norm,
                      float eps, const HLLinear* head, float* logits, int32_t all_logits, int32_t n_threads) {
  Workspace& ws = shared_workspace();
  const int64_t hidden = layers[0].hidden, rows = offsets[segments];
  const int64_t logit_rows = all_logits ? rows : segments;
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_segments(layers[0], segments, offsets);
    team.barrier();
    std::vector<float> scores;
    for (int64_t i = 0; i < n_layers; ++i)
      decode_layer_team(team, layers[i], x, x, caches + i * segments, rows, cos, sin, ws, scores);
    const Share mine(logit_rows, team);
    for (int64_t r = mine.first; r < mine.last; ++r) {
      const int64_t row = all_logits ? r : offsets[r + 1] - 1;
      rms_norm(x + row * hidden, final_norm, eps, hidden, ws.normed.data() + r * hidden);
    }
    team.barrier();
    if (all_logits)  // the rows of the segments, each as its segment's own product would compute them
      products_team(team, *head, ws.normed.data(), logits, logit_rows, ws);
    else  // one row per segment: the product of one row, as alone
      linear_team(team, *head, ws.normed.data(), logits, logit_rows, &ws.acts);
  });
}

void hl_set_spin_wait(int32_t spins) { pool().set_spins(spins); }

int32_t hl_spin_wait() { return pool().spins(); }

}  // extern "C"

#ifdef HL_PROFILE
// Seconds per phase (the Phase order) accumulated since the library was loaded or reset.
extern "C" double* hl_phase_seconds() { return phase_seconds; }
#endif
