// The tiled formats' products on 256-bit registers (AVX2 + FMA): each tile row block in two
// halves of 8 weight rows, every lane the operations of the 512-bit kernel's lane and of
// dots_reference.h (the same bits). Integer dots by vpdpbusd where the CPU has AVX-VNNI, else
// vpmaddubsw + vpmaddwd: those saturate past 2^15 per pair, so codes that use all 8 bits (int8,
// IQ4) are taken as signed magnitudes (|w| . sign(x, w): |w| <= 128) and the rest (<= 63) as
// they are, their vpmaddubsw results summed in 16-bit lanes as far as that stays exact (against
// the high digits 8 of 4-bit codes, 4 of 5-bit, 2 of 6-bit; the low digits, half their size,
// 17, 8, 4) before one vpmaddwd widens them; either way the same exact integers.
//
// Self-contained; its contents exist only in AVX2 builds without AVX-512 VNNI (HL_AVX2).
#pragma once

#include <cstdint>

#include "activations.h"
#include "common.h"
#include "qtypes.h"

#if HL_AVX2
namespace hl {
namespace avx2 {

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool VNNI = true;
inline __m256i dot_accumulate(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
}
#else
constexpr bool VNNI = false;
// 8 lanes, each acc + the sum of 4 products of unsigned bytes a and signed bytes b (|a b| 2 < 2^15).
inline __m256i dot_accumulate(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
#endif

// Whether format F's dots run on signed magnitudes here (8-bit codes without VNNI).
template <int32_t F>
constexpr bool signed_codes() {
  return !VNNI && layout_of(F).wide();
}

// ---- a group's quads --------------------------------------------------------------------------
// A quad: 8 weight rows' codes of 4 consecutive inputs, one register. What the quads of one group
// read besides their codes: the two planes' bits (Q6_K), bit i of plane 0 beside bit i of plane 1
// for each half (at bits i, i + 1 for even i; i - 1, i for odd i: each source bit has a 0 beside
// it), so that one shift, mask and or per quad moves both of its bits (30 operations for 48;
// one-row Q6_K products from the cache 59 -> 66 GMAC/s on 2 threads); and the IQ4 table.
struct QuadSource {
  const uint8_t* codes;
  __m256i paired[2][2];
  __m256i lut;
};

template <int32_t F>
__attribute__((always_inline)) inline QuadSource quad_source(const uint8_t* codes) {
  constexpr TypeLayout T = layout_of(F);
  QuadSource src{codes, {}, _mm256_setzero_si256()};
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (T.codes == Codes::NIBBLES_2PLANES) {
    const __m256i even_bits = _mm256_set1_epi8(0x55), odd_bits = _mm256_set1_epi8(static_cast<char>(0xAA));
    for (int half = 0; half < 2; ++half) {
      const __m256i plane0 = load(codes + 32 * half), plane1 = load(codes + PLANE_BYTES + 32 * half);
      src.paired[half][0] =
          _mm256_or_si256(_mm256_and_si256(plane0, even_bits), _mm256_slli_epi16(_mm256_and_si256(plane1, even_bits), 1));
      src.paired[half][1] =
          _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(plane0, odd_bits), 1), _mm256_and_si256(plane1, odd_bits));
    }
  }
  if constexpr (T.codes == Codes::IQ4) {
    alignas(16) uint8_t table[16];
    for (int i = 0; i < 16; ++i)
      table[i] = static_cast<uint8_t>(signed_codes<F>() ? IQ4_VALUES[i] : IQ4_VALUES[i] + 128);
    src.lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
  }
  return src;
}

// Quad i (inputs 4i .. 4i + 3) of half h (rows 8h .. 8h + 7): unsigned codes, or for
// signed_codes<F> the signed values w = u - offset. (i and h are constants wherever it is
// inlined: the loops calling it are unrolled.)
template <int32_t F>
__attribute__((always_inline)) inline __m256i quad_at(const QuadSource& src, int half, int i) {
  constexpr TypeLayout T = layout_of(F);
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (T.codes == Codes::BYTES) {
    const __m256i q = load(src.codes + 64 * i + 32 * half);
    if constexpr (signed_codes<F>()) return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
    return q;
  } else {
    constexpr int planes = T.codes == Codes::NIBBLES_1PLANE ? 1 : T.codes == Codes::NIBBLES_2PLANES ? 2 : 0;
    const __m256i c = load(src.codes + planes * PLANE_BYTES + 64 * (i & 3) + 32 * half);
    __m256i q = _mm256_and_si256(i < 4 ? c : _mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x0F));
    if constexpr (T.codes == Codes::IQ4) q = _mm256_shuffle_epi8(src.lut, q);
    if constexpr (planes == 2) {
      const int shift = 4 - (i & ~1);
      const __m256i paired = src.paired[half][i & 1];
      const __m256i moved = shift > 0   ? _mm256_slli_epi16(paired, shift)
                            : shift < 0 ? _mm256_srli_epi16(paired, -shift)
                                        : paired;
      q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
    } else if constexpr (planes == 1) {
      const __m256i plane = load(src.codes + 32 * half);
      const int shift = 4 - i;
      const __m256i moved = shift > 0   ? _mm256_slli_epi16(plane, shift)
                            : shift < 0 ? _mm256_srli_epi16(plane, -shift)
                                        : plane;
      q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(16)));
    }
    return q;
  }
}

// Half h's 8 quads of a group at once (for the passes of several input rows, which keep them):
// the other half's plane bits, never read, are dropped by the compiler, and the nibble bytes that
// quads j and j + 4 share are loaded once.
template <int32_t F>
__attribute__((always_inline)) inline void unpack_quads(const uint8_t* codes, int half, __m256i q[8]) {
  const QuadSource src = quad_source<F>(codes);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) q[i] = quad_at<F>(src, half, i);
}

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256 bf16x8(const uint8_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline __m128i bytes8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm_cvtsi64_si128(v);
}

inline __m256 u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(p))); }
inline __m256 i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(p))); }

inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }

struct Scales8 {
  __m256 scale, scale_b, min;
};

// Rows 8h .. 8h + 7's scale(s) and min of group gi of a tile.
template <int32_t F>
inline Scales8 group_scales(const uint8_t* tile, int64_t gi, int half) {
  constexpr TypeLayout T = layout_of(F);
  const int64_t r = 8 * half;
  const __m256 zero = _mm256_setzero_ps();
  if constexpr (T.scales == Scales::Q4_ENGINE) {
    const __m256 scale = bf16x8(tile + 2 * r);
    return {scale, zero, _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, bf16x8(tile + 32 + 2 * r))};
  } else if constexpr (T.scales == Scales::F16) {
    return {f16x8(tile + 2 * r), zero, zero};
  } else if constexpr (T.scales == Scales::F16_MIN) {
    return {f16x8(tile + 2 * r), zero, f16x8(tile + 32 + 2 * r)};
  } else if constexpr (T.scales == Scales::F32) {
    return {_mm256_loadu_ps(reinterpret_cast<const float*>(tile) + r), zero, zero};
  } else if constexpr (T.scales == Scales::ROW) {
    return {_mm256_set1_ps(1.0f), zero, zero};
  } else if constexpr (T.scales == Scales::K_SCALE_MIN) {
    return {_mm256_mul_ps(f16x8(tile + 2 * r), u8x8(tile + 64 + gi * 16 + r)), zero,
            negate(_mm256_mul_ps(f16x8(tile + 32 + 2 * r), u8x8(tile + 64 + 128 + gi * 16 + r)))};
  } else if constexpr (T.scales == Scales::K_HALVES) {
    const __m256 d = f16x8(tile + 2 * r);
    return {_mm256_mul_ps(d, i8x8(tile + 32 + 2 * gi * 16 + r)), _mm256_mul_ps(d, i8x8(tile + 32 + (2 * gi + 1) * 16 + r)),
            zero};
  } else {  // K_IQ4XS
    return {_mm256_mul_ps(f16x8(tile + 2 * r), i8x8(tile + 32 + gi * 16 + r)), zero, zero};
  }
}

inline int32_t quad_bits(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One quad's dot with 4 broadcast inputs x: u . x, or for signed codes |w| . sign(x, w).
template <int32_t F>
inline __m256i quad_dot(__m256i acc, __m256i quad, const int8_t* x) {
  const __m256i inputs = _mm256_set1_epi32(quad_bits(x));
  if constexpr (signed_codes<F>()) return dot_accumulate(acc, _mm256_abs_epi8(quad), _mm256_sign_epi8(inputs, quad));
  return dot_accumulate(acc, quad, inputs);
}

// The largest unsigned code of format F.
template <int32_t F>
constexpr int32_t code_max() {
  constexpr Codes C = layout_of(F).codes;
  return C == Codes::NIBBLES ? 15 : C == Codes::NIBBLES_1PLANE ? 31 : C == Codes::NIBBLES_2PLANES ? 63 : 255;
}

// The largest size of an input digit: the high digit's |q| <= 127, the low digit's |q_low| <= 64
// (activations.h).
constexpr int32_t digit_max(int16_t weight) { return weight == 128 ? 127 : 64; }

// How many vpmaddubsw results of format F's codes against digits of size <= DIGIT_MAX sum exactly
// in 16-bit lanes: each is at most 2 * code_max * DIGIT_MAX in size (1: widen each at once). Only
// the dots without VNNI on unsigned codes sum in 16 bits.
template <int32_t F, int32_t DIGIT_MAX>
constexpr int int16_terms() {
  if constexpr (VNNI || signed_codes<F>()) return 1;
  return 32767 / (2 * code_max<F>() * DIGIT_MAX);
}

// Pins v to a register at this point: GCC may not reassociate a chain of sums through it (it
// would otherwise turn a group's serial 16-bit runs into a tree that keeps every product live,
// and spill).
__attribute__((always_inline)) inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// WEIGHT * sum over the N quads q[0 .. N) of quad i's dot with inputs x + 4i (8 int32 lanes,
// exact; WEIGHT 128: the high digits, 1: the low ones): in runs of int16_terms products summed in
// 16-bit lanes, each run widened (and weighted) by one vpmaddwd, where F's codes allow; else
// product by product.
template <int32_t F, int N, int16_t WEIGHT>
inline __m256i quads_dot(const __m256i* q, const int8_t* x) {
  constexpr int RUN = int16_terms<F, digit_max(WEIGHT)>();
  __m256i total = _mm256_setzero_si256();
  if constexpr (RUN == 1) {
    __m256i other = total;  // two chains
    for (int i = 0; i < N; i += 2) {
      total = quad_dot<F>(total, q[i], x + 4 * i);
      if (i + 1 < N) other = quad_dot<F>(other, q[i + 1], x + 4 * i + 4);
    }
    total = _mm256_add_epi32(total, other);
    return WEIGHT == 1 ? total : _mm256_slli_epi32(total, 7);
  } else {
    for (int r = 0; r < N; r += RUN) {
      __m256i run = _mm256_maddubs_epi16(q[r], _mm256_set1_epi32(quad_bits(x + 4 * r)));
      for (int i = r + 1; i < r + RUN && i < N; ++i) {
        run = _mm256_add_epi16(run, _mm256_maddubs_epi16(q[i], _mm256_set1_epi32(quad_bits(x + 4 * i))));
        in_register(run);
      }
      total = _mm256_add_epi32(total, _mm256_madd_epi16(run, _mm256_set1_epi16(WEIGHT)));
    }
    return total;
  }
}

// qtypes.h's float steps of group g for one input row a and 8 weight rows (their scales s), from
// the exact dots over the group's inputs 0-15 (d_a) and 16-31 (d_b) before the offset; a type
// without halves takes their sum (d_b may be zero: d_a over all 32).
template <int32_t F>
__attribute__((always_inline)) inline __m256 float_steps(__m256 acc, __m256i d_a, __m256i d_b, const Scales8& s,
                                                         const InputRow& a, int64_t g) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int32_t OFFSET = signed_codes<F>() ? 0 : T.offset;  // signed codes carry their offset
  const int32_t* sums = a.digit_sums + 2 * g;
  const __m256 ds = _mm256_set1_ps(a.dot_scales[g]);
  if constexpr (T.halves()) {
    d_a = _mm256_sub_epi32(d_a, _mm256_set1_epi32(OFFSET * sums[0]));
    d_b = _mm256_sub_epi32(d_b, _mm256_set1_epi32(OFFSET * sums[1]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_a), _mm256_mul_ps(s.scale, ds), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_b), _mm256_mul_ps(s.scale_b, ds), acc);
  } else {
    __m256i d = _mm256_add_epi32(d_a, d_b);
    if constexpr (OFFSET != 0) d = _mm256_sub_epi32(d, _mm256_set1_epi32(OFFSET * (sums[0] + sums[1])));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s.scale, ds), acc);
    if constexpr (T.has_min()) acc = _mm256_fmadd_ps(s.min, _mm256_set1_ps(a.sums[g]), acc);
    return acc;
  }
}

// Group gi (g overall) of a tile against input rows a[0 .. MT) for half h (weight rows 8h ..
// 8h + 7), into acc[0 .. MT); DIGITS: the input rows' digits per value (1: acts.one_digit(), the
// zero low digits' dots skipped).
template <int32_t F, int MT, int DIGITS>
__attribute__((always_inline)) inline void group_rows(const uint8_t* tile, int64_t gi, int64_t g, int half,
                                                      const InputRow* a, __m256* acc) {
  constexpr TypeLayout T = layout_of(F);
  const uint8_t* codes = group_codes(T, tile, gi);
  __m256i q[8];
  unpack_quads<F>(codes, half, q);
  const Scales8 scales = group_scales<F>(tile, gi, half);
  for (int m = 0; m < MT; ++m) {
    const int8_t* hi = a[m].high(g);
    const int8_t* lo = a[m].low(g);
    // 128 (u . q) + u . q_low over inputs 0-15 and 16-31 (halves), or all 32 (in d_a)
    __m256i d_a, d_b = _mm256_setzero_si256();
    if constexpr (T.halves()) {
      d_a = quads_dot<F, 4, 128>(q, hi);
      d_b = quads_dot<F, 4, 128>(q + 4, hi + 16);
      if constexpr (DIGITS == 2) {
        d_a = _mm256_add_epi32(d_a, quads_dot<F, 4, 1>(q, lo));
        d_b = _mm256_add_epi32(d_b, quads_dot<F, 4, 1>(q + 4, lo + 16));
      }
    } else {
      d_a = quads_dot<F, 8, 128>(q, hi);
      if constexpr (DIGITS == 2) d_a = _mm256_add_epi32(d_a, quads_dot<F, 8, 1>(q, lo));
    }
    acc[m] = float_steps<F>(acc[m], d_a, d_b, scales, a[m], g);
  }
}

// out[m, 8h : 8h + 8) (the valid ones of n_valid) of half h's accumulators acc[0 .. MT).
template <int32_t F, int MT>
inline void store_half(const __m256* acc, int half, int64_t m0, float* out, int64_t n_out, int n_valid,
                       const float* row_scales) {
  for (int m = 0; m < MT; ++m) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[m]);
    float* o = out + (m0 + m) * n_out + 8 * half;
    for (int j = 0; j < 8 && 8 * half + j < n_valid; ++j)
      o[j] = layout_of(F).scales == Scales::ROW ? lanes[j] * row_scales[8 * half + j] : lanes[j];
  }
}

// Half h of out[m, :] for input rows a[0 .. MT) (m0 ..) of one row block (`tiles`: its first
// tile), every group of every tile in order.
template <int32_t F, int MT, int DIGITS>
void half_pass(const uint8_t* tiles, int64_t n_tiles, const InputRow* a, int half, int64_t m0, float* out,
               int64_t n_out, int n_valid, const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t TILE_BYTES = T.tile_bytes(), GROUPS = T.groups();
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n_tiles; ++s) {
    const uint8_t* tile = tiles + s * TILE_BYTES;
    for (int64_t gi = 0; gi < GROUPS; ++gi) {
      const uint8_t* codes = group_codes(T, tile, gi);
      prefetch_bytes(reinterpret_cast<uintptr_t>(codes) + PRODUCT_PREFETCH_BYTES, T.group_bytes);
      group_rows<F, MT, DIGITS>(tile, gi, s * GROUPS + gi, half, a, acc);
    }
  }
  store_half<F, MT>(acc, half, m0, out, n_out, n_valid, row_scales);
}

// ---- one input row (decode): both halves quad by quad ---------------------------------------
// With one input row, a group's 16 weight rows are two halves against the same inputs: each quad's
// broadcast inputs serve both halves, so the pass goes quad by quad (two quads, two broadcasts
// and a few sums live at once), each group's codes read once, in order. Half by half, the 16
// broadcasts of a group were either loaded twice behind a compiler barrier, which kept the
// accumulators in memory, or hoisted and spilled; and GCC turned each serial 16-bit run into a
// tree that kept every product live (in_register stops that). AMD Zen 5, one row against 8192 x
// 2048 weights in the cache, one thread, GMAC/s: Q4_K 47 -> 60, Q8_0 38 -> 40, Q6_K and Q5_0
// within 3%. The integer dots are the same exact sums as group_rows', the float steps the same
// (float_steps): the same bits.

// The dots of quads [FIRST, FIRST + N) of both halves with one row's digits hi (and lo): d[h] =
// 128 (u . q) + u . q_low over those quads (quad i against inputs 4i .. 4i + 3), as quads_dot
// sums them: in 16-bit runs widened by vpmaddwd where F's codes allow, else product by product.
template <int32_t F, int FIRST, int N, int DIGITS>
__attribute__((always_inline)) inline void quads_dot_halves(const QuadSource& src, const int8_t* hi, const int8_t* lo,
                                                            __m256i d[2]) {
  constexpr int RUN_HIGH = int16_terms<F, digit_max(128)>(), RUN_LOW = int16_terms<F, digit_max(1)>();
  const __m256i zero = _mm256_setzero_si256();
  if constexpr (RUN_HIGH == 1) {
    __m256i high[2] = {zero, zero}, low[2] = {zero, zero};
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
      const int i = FIRST + k;
      for (int h = 0; h < 2; ++h) {
        const __m256i q = quad_at<F>(src, h, i);
        high[h] = quad_dot<F>(high[h], q, hi + 4 * i);
        in_register(high[h]);
        if constexpr (DIGITS == 2) {
          low[h] = quad_dot<F>(low[h], q, lo + 4 * i);
          in_register(low[h]);
        }
      }
    }
    for (int h = 0; h < 2; ++h)
      d[h] = DIGITS == 2 ? _mm256_add_epi32(_mm256_slli_epi32(high[h], 7), low[h]) : _mm256_slli_epi32(high[h], 7);
  } else {
    __m256i high_run[2] = {zero, zero}, low_run[2] = {zero, zero};
    bool started[2] = {false, false};  // (known at each unrolled step: the first widened run is d's start)
    const auto widen_into = [&](int h, __m256i widened) {
      d[h] = started[h] ? _mm256_add_epi32(d[h], widened) : widened;
      started[h] = true;
    };
#pragma GCC unroll 8
    for (int k = 0; k < N; ++k) {
      const int i = FIRST + k;
      const __m256i high_inputs = _mm256_set1_epi32(quad_bits(hi + 4 * i));
      const __m256i low_inputs = DIGITS == 2 ? _mm256_set1_epi32(quad_bits(lo + 4 * i)) : zero;
      for (int h = 0; h < 2; ++h) {
        const __m256i q = quad_at<F>(src, h, i);
        const __m256i p = _mm256_maddubs_epi16(q, high_inputs);
        high_run[h] = k % RUN_HIGH == 0 ? p : _mm256_add_epi16(high_run[h], p);
        in_register(high_run[h]);
        if (k % RUN_HIGH == RUN_HIGH - 1 || k == N - 1)
          widen_into(h, _mm256_madd_epi16(high_run[h], _mm256_set1_epi16(128)));
        if constexpr (DIGITS == 2) {
          const __m256i p_low = _mm256_maddubs_epi16(q, low_inputs);
          low_run[h] = k % RUN_LOW == 0 ? p_low : _mm256_add_epi16(low_run[h], p_low);
          in_register(low_run[h]);
          if (k % RUN_LOW == RUN_LOW - 1 || k == N - 1)
            widen_into(h, _mm256_madd_epi16(low_run[h], _mm256_set1_epi16(1)));
        }
        if (started[h]) in_register(d[h]);
      }
    }
  }
}

// Group gi (g overall) of a tile against one input row a, both halves: acc[h] as group_rows<F, 1,
// DIGITS> leaves it for half h.
template <int32_t F, int DIGITS>
__attribute__((always_inline)) inline void group_one_row(const uint8_t* tile, int64_t gi, int64_t g, const InputRow& a,
                                                         __m256 acc[2]) {
  constexpr TypeLayout T = layout_of(F);
  const QuadSource src = quad_source<F>(group_codes(T, tile, gi));
  const int8_t* hi = a.high(g);
  const int8_t* lo = a.low(g);
  __m256i d_a[2], d_b[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  if constexpr (T.halves()) {
    quads_dot_halves<F, 0, 4, DIGITS>(src, hi, lo, d_a);
    quads_dot_halves<F, 4, 4, DIGITS>(src, hi, lo, d_b);
  } else {
    quads_dot_halves<F, 0, 8, DIGITS>(src, hi, lo, d_a);
  }
  for (int h = 0; h < 2; ++h) acc[h] = float_steps<F>(acc[h], d_a[h], d_b[h], group_scales<F>(tile, gi, h), a, g);
}

// out[m0, 0 : n_valid) (n_valid > 8) of one input row against one row block, every group of
// every tile in order.
template <int32_t F, int DIGITS>
void one_row_pass(const uint8_t* tiles, int64_t n_tiles, const InputRow& a, int64_t m0, float* out, int64_t n_out,
                  int n_valid, const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t TILE_BYTES = T.tile_bytes(), GROUPS = T.groups();
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // (never addressed: kept in registers)
  for (int64_t s = 0; s < n_tiles; ++s) {
    const uint8_t* tile = tiles + s * TILE_BYTES;
    for (int64_t gi = 0; gi < GROUPS; ++gi) {
      const uint8_t* codes = group_codes(T, tile, gi);
      prefetch_bytes(reinterpret_cast<uintptr_t>(codes) + PRODUCT_PREFETCH_BYTES, T.group_bytes);
      group_one_row<F, DIGITS>(tile, gi, s * GROUPS + gi, a, acc);
    }
  }
  const __m256 half0 = acc[0], half1 = acc[1];
  store_half<F, 1>(&half0, 0, m0, out, n_out, n_valid, row_scales);
  store_half<F, 1>(&half1, 1, m0, out, n_out, n_valid, row_scales);
}

// out[m, 0 : n_valid) for input rows m0 .. m0 + MT - 1 of one row block (`tiles`: its first tile);
// DIGITS: the input rows' digits per value (1: acts.one_digit(), the zero low digits' dots
// skipped). Several rows: half by half (the unpacked quads serve MT rows; two halves'
// accumulators would spill). One row (decode): both halves in one pass (one_row_pass; reading
// each group's codes once, in order, instead of a pass per half measured, one row against 32768 x
// 2048 weights streamed from memory on 2 threads: Q4_K 75 -> 88 GMAC/s, Q6_K 47 -> 57).
template <int32_t F, int MT, int DIGITS = 2>
void tiled_rows(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, int64_t m0, float* out, int64_t n_out,
                int n_valid, const float* row_scales) {
  InputRow a[MT];
  for (int m = 0; m < MT; ++m) a[m] = acts.row(m0 + m);
  if constexpr (MT == 1) {  // (a constexpr test: no two-half pass is instantiated for several rows)
    if (n_valid > 8) return one_row_pass<F, DIGITS>(tiles, n_tiles, a[0], m0, out, n_out, n_valid, row_scales);
  }
  half_pass<F, MT, DIGITS>(tiles, n_tiles, a, 0, m0, out, n_out, n_valid, row_scales);
  if (n_valid > 8) half_pass<F, MT, DIGITS>(tiles, n_tiles, a, 1, m0, out, n_out, n_valid, row_scales);
}

// Input rows per pass: the group's 8 quads are unpacked once for 4 rows (measured on Q4_1, Q4_K
// and Q6_K 512-row products: 1.6-1.9x one row per pass; 6 rows spill registers and are slower).
constexpr int ROWS_PER_PASS = 4;

}  // namespace avx2
}  // namespace hl
#endif
