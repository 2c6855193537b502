// What every kernel header shares: the instruction sets the build targets, vector types and
// their loads, exp on vectors, float16 / bfloat16 conversions, and the phase timers.
//
// Self-contained (compiles on its own: tests/test_kernel_headers.py); everything below lives in
// namespace hl. Nothing here holds state but the profiling counters (built with -DHL_PROFILE only).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The instruction sets the kernels are built for (what -march gave).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define HL_AVX512_VNNI 1  // 512-bit integer dots (dots_avx512.h)
#else
#define HL_AVX512_VNNI 0
#endif
#if !HL_AVX512_VNNI && defined(__AVX2__) && defined(__FMA__)
#define HL_AVX2 1  // 256-bit integer dots (dots_avx2.h), vpdpbusd where the CPU has AVX-VNNI
#else
#define HL_AVX2 0
#endif
#if HL_AVX512_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && defined(__x86_64__)
#define HL_AMX 1  // tile multiplies (dots_amx.h)
#else
#define HL_AMX 0
#endif

namespace hl {

constexpr int64_t GROUP = 32;  // inputs per quantization group: each group's integer dot is exact
constexpr int64_t TILE_ROWS = 16;  // weight rows per tile of every quantized type (qtypes.h)
// How far ahead of a group's codes the vector products ask for the codes they read next: 5 KiB
// (about twenty Q4_K groups). One-row products out of the caches on 2 threads, Q4_K and Q6_K: on
// Intel Sapphire Rapids 2.5 KiB read 4-9% more per second than 1.25 KiB, and 5 or 10 KiB the same
// as 2.5; on AMD Zen 5 5 KiB read 2-5% more than 2.5 KiB (Q6_K 47 GB/s, at the memory's rate),
// 7.5 and 10 KiB less. 512-row products: the same at 2.5 and 5 KiB.
constexpr int64_t PRODUCT_PREFETCH_BYTES = 5120;

// Where the kernels' software prefetches put the lines they ask for (the weights' codes ahead of
// the vector products, a decode block's KV rows ahead of the attention). AVX-512 builds: the
// second-level cache (__builtin_prefetch locality 1, `prefetcht2`); Intel Sapphire Rapids, 2
// threads, against locality 3 (`prefetcht0`): decode steps 8-10% faster at 512 (Llama-3.2-1B, the
// Mistral-shaped file: the weights read 9-11% more per second), 5-9% at 8K with a float16 KV; the
// decode attention alone 3-9% (on AMD Zen 5: the products the same, the attention 1-6% slower).
// Other builds: the first-level cache (`prefetcht0`, __builtin_prefetch's default; the portable
// build not measured); the AVX2 build on Zen 5 against `prefetcht2`: decode steps at 512 3-6%
// faster in five of six alternations (one 1% slower), the decode attention alone 5-10%
// (Qwen3-0.6B's and the Mistral shape's at 8K); on Sapphire Rapids its decode steps the same either
// way (the attention alone within 3%). A likely cause of the Intel gain (no hardware counters on
// those VMs to show it): a `prefetcht0` holds one of the first-level cache's few fill buffers until
// its line arrives, and those bound how many lines a core keeps in flight.
constexpr int PREFETCH_LOCALITY = HL_AVX512_VNNI ? 1 : 3;

// Asks for `bytes` bytes from address `first` into the cache level PREFETCH_LOCALITY names, a
// line at a time; changes no value. An integer address: the bytes asked for may lie past a
// buffer's end (a prefetch never faults). Always inlined into the loops that read: GCC drops a
// call to a function that only prefetches.
__attribute__((always_inline)) inline void prefetch_bytes(uintptr_t first, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(first + offset), 0, PREFETCH_LOCALITY);
}

// ---- vectors ------------------------------------------------------------------------------
// GCC/Clang vector extensions: one source that the compiler lowers to the registers -march
// offers. The float loops of attention and float32 weights run on LANES = 8 floats: one AVX2
// register (GCC lowers 16-float vectors on AVX2 through the stack, element by element), and on
// AVX-512 machines measured as fast as 16.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

constexpr int LANES = 8;
typedef float f32xL __attribute__((vector_size(LANES * 4)));

// Vectors of the row-wise float loops that need no AVX2 fallback shape (the one-row attention,
// activations): 16 floats on AVX-512, else LANES. Every lane does the same operations either way.
#if defined(__AVX512F__)
constexpr int WLANES = 16;
#else
constexpr int WLANES = LANES;
#endif
typedef float f32xW __attribute__((vector_size(WLANES * 4)));

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// a * b + c on every lane with one rounding (a fused multiply-add written out, never left to the
// compiler's contraction, which may differ between two loops computing the same value).
inline f32xL fma_lanes(f32xL a, f32xL b, f32xL c) {
#if defined(__FMA__)
  __m256 r = _mm256_fmadd_ps(load<__m256>(&a), load<__m256>(&b), load<__m256>(&c));
  return load<f32xL>(&r);
#else
  for (int i = 0; i < LANES; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
#endif
}

inline float sum_lanes(f32xL v) {
  f32x4 a, b;
  std::memcpy(&a, &v, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 16, 16);
  const f32x4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// 0 + v[0] + v[1] + ... + v[LANES - 1], added in that order. With running sums that take element i
// into lane i % LANES, the one order of the sums the kernels reduce (a row's squares, an activation
// group's values) on every build and CPU. (An `omp simd` reduction leaves its order to the compiler:
// GCC takes 8 lanes on AVX2 and Intel's AVX-512 targets but 16 where -march=native prefers 512-bit
// vectors, AMD Zen 5, so one product gave different bits on the two builds there.)
inline float sum_in_order(f32xL v) {
  float s = 0.0f;
  for (int i = 0; i < LANES; ++i) s += v[i];
  return s;
}

#if defined(__AVX512F__)
// Lanes 0-7 and 8-15 of a wide vector, in registers (a copy through the stack stalls on its store
// forwarding where the result feeds a loop).
inline void wide_halves(f32xW v, f32xL& low, f32xL& high) {
  const __m512 all = load<__m512>(&v);
  const __m256 a = _mm512_castps512_ps256(all), b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1));
  low = load<f32xL>(&a), high = load<f32xL>(&b);
}
#endif

// The lanes of v summed by halving: lane i + lane i + WLANES / 2, ... down to one (sum_lanes' order
// for the last eight).
inline float sum_wide(f32xW v) {
#if defined(__AVX512F__)
  f32xL low, high;
  wide_halves(v, low, high);
  return sum_lanes(low + high);
#else
  return sum_lanes(v);
#endif
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

// tanh(x) = 1 - 2 / (exp(2x) + 1) on every lane (saturates at +-1 through exp's clamp).
template <typename V>
inline V tanh_vector(V x) {
  return 1.0f - 2.0f / (exp_vector(x + x) + 1.0f);
}

inline float tanh_clamped(float x) { return 1.0f - 2.0f / (exp_clamped(x + x) + 1.0f); }

// ---- 16-bit floats --------------------------------------------------------------------------
inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE half -> float32 (exact).
inline float half_to_float(uint16_t h) {
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

// float32 -> IEEE half, round to nearest even (as PyTorch's .to(float16)).
inline uint16_t float_to_half(float f) {
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

// The 16-bit element types a buffer may hold (KV caches, float weights), as tags for overloads.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(uint16_t h) { return half_to_float(h); }  // float16 KV rows
inline float to_float(Half h) { return half_to_float(h.bits); }
inline float to_float(BFloat16 b) { return bf16_to_float(b.bits); }

// LANES consecutive values of any element type as float32.
inline f32xL load_lanes(const float* p) { return load<f32xL>(p); }

inline f32xL load_lanes(const uint16_t* p) {
#if defined(__F16C__)
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return load<f32xL>(&wide);
#else
  f32xL v;
  for (int i = 0; i < LANES; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

inline f32xL load_lanes(const Half* p) { return load_lanes(reinterpret_cast<const uint16_t*>(p)); }

inline f32xL load_lanes(const BFloat16* p) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return load<f32xL>(&wide);
#else
  f32xL v;
  for (int i = 0; i < LANES; ++i) v[i] = bf16_to_float(p[i].bits);
  return v;
#endif
}

inline f32xW load_wide(const float* p) { return load<f32xW>(p); }

inline f32xW load_wide(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return load<f32xW>(&wide);
#else
  return load_lanes(p);
#endif
}

// ---- phase timers (built only with -DHL_PROFILE, by tools/profile_decode.py) ------------------
enum Phase { BETWEEN_STEPS, NORM, QKV, ROPE_KV, ATTENTION, O_PROJ, RESIDUAL_NORM, GATE_UP, SILU, DOWN, RESIDUAL,
             FINAL_NORM, HEAD, N_PHASES };
#ifdef HL_PROFILE
inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline double phase_seconds[N_PHASES];  // accumulated by thread 0 (the others wait at the same barriers)
inline double phase_mark = 0.0;
#define PHASE_END(team, phase)                                        \
  do {                                                                \
    if ((team).thread == 0) {                                         \
      const double now = ::hl::seconds_now();                         \
      if (::hl::phase_mark > 0.0) ::hl::phase_seconds[phase] += now - ::hl::phase_mark; \
      ::hl::phase_mark = now;                                         \
    }                                                                 \
  } while (0)
#else
#define PHASE_END(team, phase) \
  do {                         \
  } while (0)
#endif

}  // namespace hl
