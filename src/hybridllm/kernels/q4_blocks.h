// int4 weights in blocks of 16 rows x 32 inputs: the one layout every Q4 product reads (decode
// rows, AMX tiles, prefill panels), and the decode products on vector registers.
//
// Included by decode.cpp (one translation unit) inside its namespace: uses GROUP, bf16_to_float,
// load, the vector types and ActivationRows (activations.h).
//
// A matrix (N, K) is (ceil(N/16), K/32) blocks of Q4_BLOCK_BYTES, block row by block row (a
// thread reads its output rows as one sequential stream); rows past N are zeros. A block holds
// one group (32 inputs) of 16 consecutive rows:
//   [0, 32)    the rows' scales, bfloat16        value = (q - 8) * scale + zero
//   [32, 64)   the rows' zeros, bfloat16
//   [64, 320)  the codes: 4 chunks of 64 bytes; chunk j's byte 4n + t holds row n's code for
//              input 4j + t in its low nibble and for input 16 + 4j + t in its high nibble.
// Unpacked, the codes are 8 quads of 64 bytes (the low nibbles of chunks 0..3, then their high
// nibbles): quad i's byte 4n + t is row n's code for input 4i + t. A quad is the operand of an
// integer dot against 4 broadcast inputs (vpdpbusd: 16 rows at once), and the 8 quads are an
// AMX B tile (8 rows of 16 x 4 bytes), as they are.
//
// The arithmetic (the same in every kernel, so a row's result does not depend on which kernel,
// register width or batch computed it): per group g, the exact integer dot of the codes with the
// two digits of the input row (activations.h), D = 128 (q . x_q) + q . x_q_low, then
//   acc = fma(float(D), scale[n] * dot_scales[g], acc)
//   acc = fma(zero[n] - 8 scale[n], sums[g], acc)        (zero - 8 scale: one fma)
// over the groups in order from acc = 0; then the bias is added.

constexpr int64_t Q4_ROWS = 16;
constexpr int64_t Q4_BLOCK_BYTES = 64 + 256;
constexpr int64_t Q4_QUAD_BYTES = 64;

// Row n's 16 code bytes of a block in GGUF order (byte j = q[j] | q[j + 16] << 4).
inline void q4_row_codes(const uint8_t* block, int64_t n, uint8_t out[16]) {
  for (int j = 0; j < 4; ++j) std::memcpy(out + 4 * j, block + 64 + 64 * j + 4 * n, 4);
}

inline float q4_scale(const uint8_t* block, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, block + 2 * n, 2);
  return bf16_to_float(bits);
}

inline float q4_zero(const uint8_t* block, int64_t n) { return q4_scale(block + 32, n); }

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool QUANTIZED_ACTIVATIONS = true;

// 4 input bytes (one quad of an input row) in every 32-bit lane.
inline int32_t quad_bits(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 8 lanes, each acc + the sum of 4 products of unsigned bytes a and signed bytes b.
inline __m256i dot_accumulate(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));  // |a b| 2 < 2^15
#endif
}

#if HL_AVX512_VNNI
// The 16 scales (or zeros) of a block as float32.
inline __m512 bf16x16(const uint8_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// A block's 8 code quads (the codes 0..15 as unsigned bytes).
inline void unpack_quads(const uint8_t* block, __m512i quads[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i c = _mm512_loadu_si512(block + 64 + 64 * j);
    quads[j] = _mm512_and_si512(c, low);
    quads[j + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
  }
}

// The group's exact integer dots for one input row, one lane per weight row: 128 (q . hi) + q . lo.
inline __m512i group_dots(const __m512i quads[8], const int8_t* hi, const int8_t* lo) {
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;  // 4 chains: the adds are exact
  for (int i = 0; i < 4; ++i) {
    h0 = _mm512_dpbusd_epi32(h0, quads[i], _mm512_set1_epi32(quad_bits(hi + 4 * i)));
    h1 = _mm512_dpbusd_epi32(h1, quads[i + 4], _mm512_set1_epi32(quad_bits(hi + 16 + 4 * i)));
    l0 = _mm512_dpbusd_epi32(l0, quads[i], _mm512_set1_epi32(quad_bits(lo + 4 * i)));
    l1 = _mm512_dpbusd_epi32(l1, quads[i + 4], _mm512_set1_epi32(quad_bits(lo + 16 + 4 * i)));
  }
  return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 7), _mm512_add_epi32(l0, l1));
}

// The float steps of one group (see the top of this file), 16 weight rows per register.
// dot_scale and sum are read from memory and broadcast inside the multiplies.
inline __m512 accumulate_group(__m512 acc, __m512i dots, __m512 scale, __m512 zero_term, const float* dot_scale,
                               const float* sum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale, _mm512_set1_ps(*dot_scale)), acc);
  return _mm512_fmadd_ps(zero_term, _mm512_set1_ps(*sum), acc);
}

inline __m512 zero_terms(__m512 scale, __m512 zero) { return _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero); }

constexpr int Q4_TILE = 4;  // input rows per pass: 8 quads + 4 x 4 chains + 4 accumulators of 32 registers

// out[m, 0:n_valid] for input rows m0 .. m0 + MT - 1 of one block row (`blocks`: its first group).
template <int MT>
void q4_rows(const uint8_t* blocks, const ActivationRows& acts, int64_t m0, int64_t groups, float* out,
             int64_t n_out, int n_valid) {
  __m512 acc[MT];
  Activation a[MT];
  for (int m = 0; m < MT; ++m) {
    a[m] = acts.row(m0 + m);
    acc[m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = blocks + g * Q4_BLOCK_BYTES;
    for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) __builtin_prefetch(block + 4 * Q4_BLOCK_BYTES + line);
    const __m512 scale = bf16x16(block), zero_term = zero_terms(scale, bf16x16(block + 32));
    __m512i quads[8];
    unpack_quads(block, quads);
    for (int m = 0; m < MT; ++m)
      acc[m] = accumulate_group(acc[m], group_dots(quads, a[m].high(g), a[m].low(g)), scale,
                                zero_term, a[m].dot_scales + g, a[m].sums + g);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * n_out, valid, acc[m]);
}
#else
// 256-bit registers: each block row in two halves of 8 weight rows, every lane the operations of
// the 512-bit kernel's lane (the same bits).

inline __m256 bf16x8(const uint8_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

constexpr int Q4_TILE = 1;  // 16 registers: 8 quads + 4 chains + the accumulator

template <int MT>
void q4_rows(const uint8_t* blocks, const ActivationRows& acts, int64_t m0, int64_t groups, float* out,
             int64_t n_out, int n_valid) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2 && 8 * half < n_valid; ++half) {
    for (int m = 0; m < MT; ++m) {
      const Activation a = acts.row(m0 + m);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = blocks + g * Q4_BLOCK_BYTES;
        for (int line = 0; line < Q4_BLOCK_BYTES; line += 64) __builtin_prefetch(block + 4 * Q4_BLOCK_BYTES + line);
        const __m256 scale = bf16x8(block + 16 * half);
        const __m256 zero_term = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, bf16x8(block + 32 + 16 * half));
        __m256i quads[8];
        for (int j = 0; j < 4; ++j) {
          const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 + 64 * j + 32 * half));
          quads[j] = _mm256_and_si256(c, low);
          quads[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        }
        const int8_t* hi = a.high(g);
        const int8_t* lo = a.low(g);
        __m256i h0 = _mm256_setzero_si256(), h1 = h0, l0 = h0, l1 = h0;
        for (int i = 0; i < 4; ++i) {
          h0 = dot_accumulate(h0, quads[i], _mm256_set1_epi32(quad_bits(hi + 4 * i)));
          h1 = dot_accumulate(h1, quads[i + 4], _mm256_set1_epi32(quad_bits(hi + 16 + 4 * i)));
          l0 = dot_accumulate(l0, quads[i], _mm256_set1_epi32(quad_bits(lo + 4 * i)));
          l1 = dot_accumulate(l1, quads[i + 4], _mm256_set1_epi32(quad_bits(lo + 16 + 4 * i)));
        }
        const __m256i dots = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(h0, h1), 7), _mm256_add_epi32(l0, l1));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, _mm256_set1_ps(a.dot_scales[g])),
                              acc);
        acc = _mm256_fmadd_ps(zero_term, _mm256_set1_ps(a.sums[g]), acc);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      float* o = out + (m0 + m) * n_out + 8 * half;
      for (int j = 0; j < 8 && 8 * half + j < n_valid; ++j) o[j] = lanes[j];
    }
  }
}
#endif
#else
constexpr bool QUANTIZED_ACTIVATIONS = false;  // portable float path
constexpr int Q4_TILE = 1;

// Other CPUs: float32 products over the codes, per weight row and group in input order; the same
// float steps around them (with the float sum of code x value in place of the integer dot).
template <int MT>
void q4_rows(const uint8_t* blocks, const ActivationRows& acts, int64_t m0, int64_t groups, float* out,
             int64_t n_out, int n_valid) {
  for (int m = 0; m < MT; ++m) {
    const Activation a = acts.row(m0 + m);
    for (int n = 0; n < n_valid; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = blocks + g * Q4_BLOCK_BYTES;
        uint8_t codes[16];
        q4_row_codes(block, n, codes);
        const float* x = a.x + g * GROUP;
        float dot = 0.0f;
        for (int j = 0; j < 16; ++j) dot += static_cast<float>(codes[j] & 15) * x[j];
        for (int j = 0; j < 16; ++j) dot += static_cast<float>(codes[j] >> 4) * x[16 + j];
        const float scale = q4_scale(block, n);
        acc = std::fma(dot, scale, acc);
        acc = std::fma(std::fma(-8.0f, scale, q4_zero(block, n)), a.sums[g], acc);
      }
      out[(m0 + m) * n_out + n] = acc;
    }
  }
}
#endif
