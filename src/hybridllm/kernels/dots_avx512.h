// The tiled formats' products on 512-bit registers (AVX-512 with VNNI): one tile row block's 16
// weight rows in the 16 lanes of a register, a group's 8 code quads against 4 broadcast inputs
// per vpdpbusd, qtypes.h's float steps as fused multiply-adds. The same bits as
// dots_reference.h (integer dots are exact; the float steps are the same operations).
//
// Self-contained; its contents exist only where the build targets AVX-512 VNNI (HL_AVX512_VNNI).
#pragma once

#include <cstdint>

#include "activations.h"
#include "common.h"
#include "qtypes.h"

#if HL_AVX512_VNNI
namespace hl {
namespace avx512 {

// A group's 8 quads of unsigned codes (16 rows x 32 inputs), from its codes in the tile.
template <int32_t F>
inline void unpack_quads(const uint8_t* codes, __m512i q[8]) {
  constexpr TypeLayout T = layout_of(F);
  if constexpr (T.codes == Codes::BYTES) {
    for (int i = 0; i < 8; ++i) q[i] = _mm512_loadu_si512(codes + 64 * i);
  } else {
    constexpr int planes = T.codes == Codes::NIBBLES_1PLANE ? 1 : T.codes == Codes::NIBBLES_2PLANES ? 2 : 0;
    const uint8_t* nibbles = codes + planes * PLANE_BYTES;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i c = _mm512_loadu_si512(nibbles + 64 * j);
      q[j] = _mm512_and_si512(c, low);
      q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    }
    if constexpr (T.codes == Codes::IQ4) {
      alignas(16) uint8_t table[16];
      for (int i = 0; i < 16; ++i) table[i] = static_cast<uint8_t>(IQ4_VALUES[i] + 128);
      const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
      for (int i = 0; i < 8; ++i) q[i] = _mm512_shuffle_epi8(lut, q[i]);
    }
#if defined(__GFNI__)
    if constexpr (planes > 0) {
      // Quad i's high bits are bit i of each plane byte, placed at bit 4 (plane 0) and 5 (plane 1).
      // Quads 4h .. 4h + 3: one byte gathers their bits, plane 0's in bits 0-3 and plane 1's in 4-7
      // (a bitwise select of the planes shifted by 16-bit lanes: no bit crosses into a kept one),
      // then one affine bit transform per quad moves its two bits into place.
      const __m512i low_bits = _mm512_set1_epi8(0x0F);
      const __m512i plane0 = _mm512_loadu_si512(codes);
      const __m512i plane1 = planes == 2 ? _mm512_loadu_si512(codes + PLANE_BYTES) : _mm512_setzero_si512();
      const __m512i gathered[2] = {
          _mm512_ternarylogic_epi32(plane0, _mm512_slli_epi16(plane1, 4), low_bits, 0xE4),  // c ? a : b
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(plane0, 4), plane1, low_bits, 0xE4)};
      for (int i = 0; i < 8; ++i) {
        const int k = i % 4;  // output bit r takes the matrix's byte 7 - r
        const uint64_t matrix = (uint64_t{1} << k) << 24 | (planes == 2 ? (uint64_t{1} << (4 + k)) << 16 : 0);
        const __m512i high = _mm512_gf2p8affine_epi64_epi8(gathered[i / 4], _mm512_set1_epi64(static_cast<int64_t>(matrix)), 0);
        q[i] = _mm512_or_si512(q[i], high);
      }
    }
#else
    for (int p = 0; p < planes; ++p) {
      const __m512i plane = _mm512_loadu_si512(codes + p * PLANE_BYTES);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
      for (int i = 0; i < 8; ++i) {
        const __mmask64 set = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << i)));
        q[i] = _mm512_mask_add_epi8(q[i], set, q[i], bit);
      }
    }
#endif
  }
}

inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 bf16x16(const uint8_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 negate(__m512 v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }

// The 16 rows' scale(s) and min of group gi of a tile (scales_at on 16 lanes).
struct Scales16 {
  __m512 scale, scale_b, min;
};

template <int32_t F>
inline Scales16 group_scales(const uint8_t* tile, int64_t gi) {
  constexpr TypeLayout T = layout_of(F);
  const __m512 zero = _mm512_setzero_ps();
  if constexpr (T.scales == Scales::Q4_ENGINE) {
    const __m512 scale = bf16x16(tile);
    return {scale, zero, _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, bf16x16(tile + 32))};
  } else if constexpr (T.scales == Scales::F16) {
    return {f16x16(tile), zero, zero};
  } else if constexpr (T.scales == Scales::F16_MIN) {
    return {f16x16(tile), zero, f16x16(tile + 32)};
  } else if constexpr (T.scales == Scales::F32) {
    return {_mm512_loadu_ps(tile), zero, zero};
  } else if constexpr (T.scales == Scales::ROW) {
    return {_mm512_set1_ps(1.0f), zero, zero};
  } else if constexpr (T.scales == Scales::K_SCALE_MIN) {
    return {_mm512_mul_ps(f16x16(tile), u8x16(tile + 64 + gi * 16)), zero,
            negate(_mm512_mul_ps(f16x16(tile + 32), u8x16(tile + 64 + 128 + gi * 16)))};
  } else if constexpr (T.scales == Scales::K_HALVES) {
    const __m512 d = f16x16(tile);
    return {_mm512_mul_ps(d, i8x16(tile + 32 + 2 * gi * 16)), _mm512_mul_ps(d, i8x16(tile + 32 + (2 * gi + 1) * 16)),
            zero};
  } else {  // K_IQ4XS
    return {_mm512_mul_ps(f16x16(tile), i8x16(tile + 32 + gi * 16)), zero, zero};
  }
}

inline int32_t quad_bits(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A group's exact integer dots for one input row, one lane per weight row: (128 u.q + u.q_low) over
// inputs 0-15 (a) and 16-31 (b), without the offset. DIGITS 1: q_low is all 0, its dots are skipped.
template <int DIGITS = 2>
inline void group_dots(const __m512i q[8], const int8_t* hi, const int8_t* lo, __m512i& a, __m512i& b) {
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;  // 4 chains: the adds are exact
  for (int i = 0; i < 4; ++i) {
    h0 = _mm512_dpbusd_epi32(h0, q[i], _mm512_set1_epi32(quad_bits(hi + 4 * i)));
    h1 = _mm512_dpbusd_epi32(h1, q[i + 4], _mm512_set1_epi32(quad_bits(hi + 16 + 4 * i)));
    if constexpr (DIGITS == 2) {
      l0 = _mm512_dpbusd_epi32(l0, q[i], _mm512_set1_epi32(quad_bits(lo + 4 * i)));
      l1 = _mm512_dpbusd_epi32(l1, q[i + 4], _mm512_set1_epi32(quad_bits(lo + 16 + 4 * i)));
    }
  }
  if constexpr (DIGITS == 2) {
    a = _mm512_add_epi32(_mm512_slli_epi32(h0, 7), l0);
    b = _mm512_add_epi32(_mm512_slli_epi32(h1, 7), l1);
  } else {
    a = _mm512_slli_epi32(h0, 7);
    b = _mm512_slli_epi32(h1, 7);
  }
}

// qtypes.h's float steps of one group for one input row, 16 weight rows per register, from the
// dots of its halves. digit_sums: the row's (S_a, S_b) of the group. CENTERED: the dots are
// already against the codes less the type's offset (w, not u: the AMX tiles' signed codes), so
// the offset's terms are not subtracted again (the same integers either way).
template <int32_t F, bool CENTERED = false>
__attribute__((always_inline)) inline __m512 float_steps(__m512 acc, __m512i d_a, __m512i d_b, const Scales16& s,
                                                         float dot_scale, float sum, const int32_t* digit_sums) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int32_t OFFSET = CENTERED ? 0 : T.offset;
  const __m512 ds = _mm512_set1_ps(dot_scale);
  if constexpr (T.halves()) {
    if constexpr (OFFSET != 0) {
      d_a = _mm512_sub_epi32(d_a, _mm512_set1_epi32(OFFSET * digit_sums[0]));
      d_b = _mm512_sub_epi32(d_b, _mm512_set1_epi32(OFFSET * digit_sums[1]));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_a), _mm512_mul_ps(s.scale, ds), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_b), _mm512_mul_ps(s.scale_b, ds), acc);
  } else {
    __m512i d = _mm512_add_epi32(d_a, d_b);
    if constexpr (OFFSET != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(OFFSET * (digit_sums[0] + digit_sums[1])));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s.scale, ds), acc);
    if constexpr (T.has_min()) acc = _mm512_fmadd_ps(s.min, _mm512_set1_ps(sum), acc);
    return acc;
  }
}

// Input rows per pass: 8 quads + 4 x 4 chains + MT accumulators of 32 registers.
constexpr int ROWS_PER_PASS = 4;

// out[m, 0:n_valid] for input rows m0 .. m0 + MT - 1 of one row block (`tiles`: its first tile);
// DIGITS: the input rows' digits per value (1: acts.one_digit()).
template <int32_t F, int MT, int DIGITS = 2>
void tiled_rows(const uint8_t* tiles, int64_t n_tiles, const InputRows& acts, int64_t m0, float* out, int64_t n_out,
                int n_valid, const float* row_scales) {
  constexpr TypeLayout T = layout_of(F);
  constexpr int64_t TILE_BYTES = T.tile_bytes(), GROUPS = T.groups();
  __m512 acc[MT];
  InputRow a[MT];
  for (int m = 0; m < MT; ++m) {
    a[m] = acts.row(m0 + m);
    acc[m] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < n_tiles; ++s) {
    const uint8_t* tile = tiles + s * TILE_BYTES;
    for (int64_t gi = 0; gi < GROUPS; ++gi) {
      const uint8_t* codes = group_codes(T, tile, gi);
      prefetch_bytes(reinterpret_cast<uintptr_t>(codes) + PRODUCT_PREFETCH_BYTES, T.group_bytes);
      const int64_t g = s * GROUPS + gi;
      __m512i q[8];
      unpack_quads<F>(codes, q);
      const Scales16 scales = group_scales<F>(tile, gi);
      for (int m = 0; m < MT; ++m) {
        __m512i d_a, d_b;
        group_dots<DIGITS>(q, a[m].high(g), a[m].low(g), d_a, d_b);
        acc[m] = float_steps<F>(acc[m], d_a, d_b, scales, a[m].dot_scales[g], a[m].sums[g], a[m].digit_sums + 2 * g);
      }
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
  for (int m = 0; m < MT; ++m) {
    if constexpr (T.scales == Scales::ROW) acc[m] = _mm512_mul_ps(acc[m], _mm512_maskz_loadu_ps(valid, row_scales));
    _mm512_mask_storeu_ps(out + (m0 + m) * n_out, valid, acc[m]);
  }
}

}  // namespace avx512
}  // namespace hl
#endif
