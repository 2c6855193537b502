// Attention of a layer's rows over their sequences' KV, read in place whatever stores it: one
// arithmetic per row, so a row's output is the same bits in a decode step, in a prefill chunk of
// any length, alone or in any batch, on any number of threads, and over any split of its keys into
// stores (a dense cache, a quantized cache's packed tokens and residual, a tiered cache's sinks,
// cold pages and hot window).
//
// Self-contained. The arithmetic of a row at position p with its G query heads sharing a KV head:
// the keys it sees ([first_visible(p), p]) in blocks of KEY_BLOCK aligned to absolute positions;
// per block, each key's score (a dot over D in vector lanes, FMAs in order, then a fixed
// transposing reduction; times the scale; soft-capped), the block's max m_b, p_t = exp(s_t - m_b),
// l_b = their sum, o_b = sum_t p_t v_t (FMAs in key order); the blocks merged in position order,
// (m, l, o) <- (max, l e^(m - m') + l_b e^(m_b - m'), o e^(m - m') + o_b e^(m_b - m')); the
// output o / l. A key or value is read as its store holds it, in registers: float32, float16
// widened (exact), or a quantized code widened (bytes, or 4-bit codes split by mask and shift)
// and dequantized as code * scale + zero with one FMA; so a token's float value is the same bits
// whichever store layout, kernel or thread reads it, and a block spanning several stores reads
// each run in place, no float copy.
//
// Decode rows: the blocks of a row go to the threads as items, a whole (row, KV head) merging its
// blocks as it goes where there are enough such pairs, else (row, KV head, a run of consecutive
// blocks) with each block's (m_b, l_b, o_b) kept and each (row, query head) merging its blocks in
// order after; their keys and values are read in place. Prefill chunks: items (chunk,
// QUERY_ROWS positions, KV head), each row merging its blocks as it goes; a block read by many
// queries is gathered once as float32 rows (the same values). The same block function and the
// same merge either way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "abi.h"
#include "common.h"
#include "thread_team.h"

namespace hl {

// How a layer's scores differ from q . k / sqrt(D): their scale, and a soft-cap (0: none).
struct ScoreOptions {
  float scale;
  float softcap;
};

constexpr int64_t KEY_BLOCK = 64;       // keys per block, aligned to absolute positions
constexpr int64_t MIN_BLOCKS_PER_ITEM = 4;   // a decode item's blocks: at least
constexpr int64_t MAX_BLOCKS_PER_ITEM = 32;  // and at most
constexpr int64_t QUERY_ROWS = 32;      // a prefill item's positions
constexpr int MAX_GROUP = 16;           // query heads per KV head the kernels take

inline f32xW fma_wide(f32xW a, f32xW b, f32xW c) {
#if defined(__AVX512F__)
  const __m512 r = _mm512_fmadd_ps(load<__m512>(&a), load<__m512>(&b), load<__m512>(&c));
  return load<f32xW>(&r);
#else
  return fma_lanes(a, b, c);  // WLANES == LANES
#endif
}

// scores[t] = cap * tanh(scores[t] / cap) for t < n.
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inverse = 1.0f / cap;
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) store(s + t, tanh_vector(load<f32xL>(s + t) * inverse) * cap);
  for (; t < n; ++t) s[t] = tanh_clamped(s[t] * inverse) * cap;
}

// The horizontal sums of four vectors (out[j] of v[j] only), in a fixed order: a transposing
// reduction in two stages. Per 128-bit chunk c of v[j] (lanes 4c .. 4c + 3):
//   chunk_c = (v[4c] + v[4c + 2]) + (v[4c + 1] + v[4c + 3])     (sum4_chunks: lane 4c + j of x)
// then across the chunks: (chunk_0 + chunk_2) + (chunk_1 + chunk_3) on AVX-512, chunk_0 + chunk_1 on
// AVX2 (sum4, or on AVX-512 sum_keys for 16 keys at once: the same additions, so the same bits).
#if defined(__AVX__) && !defined(__AVX512F__)
// sum4_chunks' two stages on 256 bits: a pair's partials (per 128 bits, lanes (0 + 2, 1 + 3) of
// each of two vectors: a b a b), then two pairs' partials into four vectors' chunk sums (a b c d).
inline __m256 pair_partials(__m256 a, __m256 b) { return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); }
inline __m256 quad_chunks(__m256 ab, __m256 cd) {
  return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
}
// The second stage across the chunks on AVX2: chunk_0 + chunk_1, lane by lane.
inline __m128 fold_chunks(__m256 x) { return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)); }
// Four keys' scores from two pairs' partials: their chunk sums folded, times the scale.
inline __m128 four_scores(__m256 ab, __m256 cd, __m128 factor) {
  return _mm_mul_ps(fold_chunks(quad_chunks(ab, cd)), factor);
}
#endif

#if defined(__AVX__)
inline f32xW sum4_chunks(const f32xW v[4]) {
#if defined(__AVX512F__)
  const __m512 a = load<__m512>(&v[0]), b = load<__m512>(&v[1]), c = load<__m512>(&v[2]), d = load<__m512>(&v[3]);
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
  return load<f32xW>(&x);
#elif defined(__AVX__)
  const __m256 x = quad_chunks(pair_partials(load<__m256>(&v[0]), load<__m256>(&v[1])),
                               pair_partials(load<__m256>(&v[2]), load<__m256>(&v[3])));
  return load<f32xW>(&x);
#endif
}
#endif

inline void sum4(const f32xW v[4], float out[4]) {
#if defined(__AVX512F__)
  const f32xW chunks = sum4_chunks(v);
  __m512 x = load<__m512>(&chunks);
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));  // chunks 0 + 2, 1 + 3
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));  // then their sum
  _mm_storeu_ps(out, _mm512_castps512_ps128(x));
#elif defined(__AVX__)
  const f32xW chunks = sum4_chunks(v);
  _mm_storeu_ps(out, fold_chunks(load<__m256>(&chunks)));
#else
  for (int j = 0; j < 4; ++j) out[j] = sum_wide(v[j]);
#endif
}

#if defined(__AVX__) && !defined(__AVX512F__)
// Two keys' sums (out[j] of v[j]): sum4's additions on two vectors (AVX2, where four queries'
// dots of four keys would not fit the registers).
inline void sum2(const f32xW v[2], float out[2]) {
  const __m256 ab = pair_partials(load<__m256>(&v[0]), load<__m256>(&v[1]));  // per 128 bits: a b a b
  const __m256 x = _mm256_add_ps(ab, _mm256_permute_ps(ab, 0x4E));             // a b a b, chunk sums
  const __m128 sums = fold_chunks(x);
  out[0] = _mm_cvtss_f32(sums);
  out[1] = _mm_cvtss_f32(_mm_movehdup_ps(sums));
}
#endif

#if defined(__AVX512F__)
// Sixteen keys' sums at once: x[k] = sum4_chunks of keys 4k .. 4k + 3 -> out[4k + j] = scale * the
// key's sum (sum4's additions, the four quads' chunks transposed together; AVX-512 only, where
// it measured faster).
inline void sum_keys(const f32xW x[4], float scale, float* out) {
  const __m512 x0 = load<__m512>(&x[0]), x1 = load<__m512>(&x[1]), x2 = load<__m512>(&x[2]), x3 = load<__m512>(&x[3]);
  // per pair of quads: chunks (0 + 2, 1 + 3) of each
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x44), _mm512_shuffle_f32x4(x0, x1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x44), _mm512_shuffle_f32x4(x2, x3, 0xEE));
  // quad k's (0 + 2) + (1 + 3) in chunk k
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  _mm512_storeu_ps(out, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}
#endif

// ---- reading stored rows --------------------------------------------------------------------
// How far ahead of its reading a decode block asks for the rows it will read: about 4 KiB (at
// least 4 rows). The kernels ask for row t + ahead as they read row t, a steady stream of
// requests a fixed distance ahead; the rows past a run's end that it asks for are the next
// block's (a head's rows are consecutive in their store). Measured on AMD Zen 5 at 8K against
// asking for each block's runs at its start (docs/performance.md): 1.1-1.6x the decode kernel's
// speed on the preset's head shapes; 2 KiB was slower, 8 KiB alike.
constexpr int64_t PREFETCH_AHEAD_BYTES = 4096;

inline int64_t rows_ahead(int64_t row_bytes) { return std::max<int64_t>(4, PREFETCH_AHEAD_BYTES / row_bytes); }

// The kernels read one KV head's keys or values of a run of tokens through a reader:
// vector(t, i) is row t's WLANES values from element i on (i and d multiples of WLANES),
// value(t, i) one value; the same float32 bits either way; prefetch(t) asks for row t + ahead
// (ahead 0: asks for nothing, as for a prefill block's rows, read by many queries from the
// cache). DenseRows: float32 as stored, float16 widened (exact). CodeRows: a quantized store's
// codes widened in registers, code * scale + zero with one rounding (an FMA); nothing is written
// back to memory.
template <typename T>
struct DenseRows {
  const T* rows;  // (n, d) from the run's first token
  int64_t d;
  int64_t ahead = 0;  // rows
  f32xW vector(int64_t t, int64_t i) const { return load_wide(rows + t * d + i); }
  float value(int64_t t, int64_t i) const { return to_float(rows[t * d + i]); }
  int64_t bytes_per_row() const { return d * static_cast<int64_t>(sizeof(T)); }
  __attribute__((always_inline)) void prefetch(int64_t t) const {
    if (ahead > 0) prefetch_bytes(reinterpret_cast<uintptr_t>(rows) + (t + ahead) * bytes_per_row(), bytes_per_row());
  }
};

template <bool FOUR>
inline float kv_code_at(const uint8_t* row, int64_t i) {
  return static_cast<float>(FOUR ? (i % 2 ? row[i / 2] >> 4 : row[i / 2] & 15) : row[i]);
}

// WLANES codes of a quantized row from element i on (a multiple of WLANES) as float32: bytes, or
// 4-bit codes two to a byte (element 2j in the low nibble of byte j) split by mask and shift and
// interleaved back into order. (GCC lowers a vector conversion from bytes to floats one lane at a
// time, hence the intrinsics.)
template <bool FOUR>
inline f32xW code_vector(const uint8_t* row, int64_t i) {
#if defined(__AVX512F__) || defined(__AVX2__)
  __m128i bytes;  // the WLANES codes in order, one per byte
  if constexpr (FOUR) {
    __m128i packed;
    if constexpr (WLANES == 16) {
      packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2));
    } else {
      int32_t four_bytes;
      std::memcpy(&four_bytes, row + i / 2, 4);
      packed = _mm_cvtsi32_si128(four_bytes);
    }
    const __m128i low = _mm_set1_epi8(15);
    bytes = _mm_unpacklo_epi8(_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low));
  } else {
    bytes = WLANES == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))
                         : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
  }
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
#else
  const __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
#endif
  return load<f32xW>(&wide);
#else
  f32xW codes;
  for (int l = 0; l < WLANES; ++l) codes[l] = kv_code_at<FOUR>(row, i + l);
  return codes;
#endif
}

// The float32 scales and zeros a CodeRows reads (widened from float16 once per run), where each
// row's start (row_at), and which of a row's scales each vector of WLANES values takes
// (vector_scale); the per-thread buffers only grow.
struct ScaleScratch {
  std::vector<float> scales, zeros;
  std::vector<int64_t> row_at, vector_scale;
  void reserve(int64_t values, int64_t rows, int64_t d) {
    if (static_cast<int64_t>(scales.size()) < values + LANES) scales.resize(values + LANES), zeros.resize(values + LANES);
    if (static_cast<int64_t>(row_at.size()) < rows) row_at.resize(rows);
    if (static_cast<int64_t>(vector_scale.size()) < d / WLANES + 1) vector_scale.resize(d / WLANES + 1);
  }
};

// n float16 values from `in` as float32 into `out` (exact; LANES at a time where they can).
inline void widen_halves(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) store(out + i, load_lanes(in + i));
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

// Rows of a quantized store's KV head, keys or values. Row t's scale and zero of element i sit at
// scales[row_at[t] + vector_scale[i / WLANES]] where one covers each vector of WLANES values
// (`per_vector`: per-token groups of a multiple of WLANES channels), else at
// scales[row_at[t] + i] (per channel: one row of d per token group; per-token groups of fewer
// channels: expanded per value).
template <bool FOUR>
struct CodeRows {
  const uint8_t* codes;  // the run's first row
  int64_t row_bytes;
  const float* scales;
  const float* zeros;
  const int64_t* row_at;
  const int64_t* vector_scale;
  bool per_vector;
  int64_t ahead = 0;  // rows

  int64_t bytes_per_row() const { return row_bytes; }
  f32xW vector(int64_t t, int64_t i) const {
    const f32xW c = code_vector<FOUR>(codes + t * row_bytes, i);
    if (per_vector) {
      const int64_t at = row_at[t] + vector_scale[i / WLANES];
      return fma_wide(c, f32xW{} + scales[at], f32xW{} + zeros[at]);
    }
    return fma_wide(c, load<f32xW>(scales + row_at[t] + i), load<f32xW>(zeros + row_at[t] + i));
  }
  float value(int64_t t, int64_t i) const {
    const int64_t at = row_at[t] + (per_vector ? vector_scale[i / WLANES] : i);
    return std::fma(kv_code_at<FOUR>(codes + t * row_bytes, i), scales[at], zeros[at]);
  }
  __attribute__((always_inline)) void prefetch(int64_t t) const {  // the codes (the scales sit in the scratch)
    if (ahead > 0) prefetch_bytes(reinterpret_cast<uintptr_t>(codes) + (t + ahead) * row_bytes, row_bytes);
  }
};

// Rows [row, row + n) of a quantized segment's KV head `head`, keys or values, as a CodeRows
// (their scales and zeros widened into `work`).
template <bool FOUR>
inline CodeRows<FOUR> code_rows(const HLKVSegment& seg, bool keys, int64_t head, int64_t row, int64_t n, int64_t d,
                                ScaleScratch& work) {
  const bool per_channel = keys && (seg.format == KV_Q8_CHANNEL_KEYS || seg.format == KV_Q4_CHANNEL_KEYS);
  const int64_t row_bytes = FOUR ? d / 2 : d;
  const auto* codes = static_cast<const uint8_t*>(keys ? seg.k : seg.v) + (head * seg.capacity + row) * row_bytes;
  const auto* scales = static_cast<const uint16_t*>(keys ? seg.k_scale : seg.v_scale);
  const auto* zeros = static_cast<const uint16_t*>(keys ? seg.k_zero : seg.v_zero);
  if (per_channel) {  // (Hkv, capacity / group, d): one row of d per token group the rows touch
    const int64_t group = seg.key_group, first = row / group, groups = (row + n - 1) / group - first + 1;
    work.reserve(groups * d, n, d);
    const int64_t at = (head * (seg.capacity / group) + first) * d;
    widen_halves(scales + at, groups * d, work.scales.data());
    widen_halves(zeros + at, groups * d, work.zeros.data());
    for (int64_t t = 0; t < n; ++t) work.row_at[t] = ((row + t) / group - first) * d;
    return {codes, row_bytes, work.scales.data(), work.zeros.data(), work.row_at.data(), nullptr, false};
  }
  // (Hkv, capacity, d / group): one per group of channels of each row, the run's rows contiguous
  const int64_t group = seg.group, groups = d / group, at = (head * seg.capacity + row) * groups;
  if (group % WLANES == 0) {
    work.reserve(n * groups, n, d);
    widen_halves(scales + at, n * groups, work.scales.data());
    widen_halves(zeros + at, n * groups, work.zeros.data());
    for (int64_t t = 0; t < n; ++t) work.row_at[t] = t * groups;
    for (int64_t v = 0; v < d / WLANES; ++v) work.vector_scale[v] = v * WLANES / group;
    return {codes, row_bytes, work.scales.data(), work.zeros.data(), work.row_at.data(), work.vector_scale.data(), true};
  }
  work.reserve(n * d, n, d);  // groups narrower than a vector: each value's scale and zero
  for (int64_t t = 0; t < n; ++t) {
    work.row_at[t] = t * d;
    for (int64_t i = 0; i < d; ++i)
      work.scales[t * d + i] = half_to_float(scales[at + t * groups + i / group]),
      work.zeros[t * d + i] = half_to_float(zeros[at + t * groups + i / group]);
  }
  return {codes, row_bytes, work.scales.data(), work.zeros.data(), work.row_at.data(), nullptr, false};
}

// A run of a block's keys and values, in one store: `n` tokens from buffer row `row` of KV head
// `head` of segment `seg`, or (seg null) float32 rows (n, d) at keys / values.
struct KVRun {
  const HLKVSegment* seg;
  const float* keys;
  const float* values;
  int64_t head, row, n;
};

// visit(reader) with the reader of a run's keys or values (as its store holds them); a store's
// rows are asked for ahead of their reading, a block's gathered rows (no store) are not.
template <typename Visit>
inline void read_run(const KVRun& run, bool keys, int64_t d, ScaleScratch& work, Visit&& visit) {
  if (run.seg == nullptr) return visit(DenseRows<float>{keys ? run.keys : run.values, d});
  const HLKVSegment& seg = *run.seg;
  const int64_t at = (run.head * seg.capacity + run.row) * d;
  const auto in_place = [&](auto rows) {
    rows.ahead = rows_ahead(rows.bytes_per_row());
    return visit(rows);
  };
  switch (seg.format) {
    case KV_F32: return in_place(DenseRows<float>{static_cast<const float*>(keys ? seg.k : seg.v) + at, d});
    case KV_F16: return in_place(DenseRows<uint16_t>{static_cast<const uint16_t*>(keys ? seg.k : seg.v) + at, d});
    case KV_Q4:
    case KV_Q4_CHANNEL_KEYS: return in_place(code_rows<true>(seg, keys, run.head, run.row, run.n, d, work));
    default: return in_place(code_rows<false>(seg, keys, run.head, run.row, run.n, d, work));
  }
}

// ---- scores --------------------------------------------------------------------------------
// scores[g * stride + t] = scale * q_g . key_t for G queries (q: G x d) and n keys (a reader's
// rows). d a multiple of WLANES: keys four at a time (each key vector read once for every
// query), the missing ones of the last four zeros (a key's dot does not depend on its
// neighbours); per key a dot in WLANES lanes (FMAs in order over d), then sum4's reduction
// (WLANES keys' worth of quads finished together by sum_keys). Else one key at a time, plain FMAs
// in order.
template <int VECS, int G, bool FULL, typename Keys>
inline void quad_dots(const float* q, const Keys& keys, int64_t t, int valid, f32xW dots[G][4]) {
  constexpr int64_t D = VECS * WLANES;
  if constexpr (FULL)
    for (int j = 0; j < 4; ++j) keys.prefetch(t + j);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) dots[g][j] = f32xW{};
  for (int i = 0; i < VECS; ++i) {
    f32xW k[4];
    for (int j = 0; j < 4; ++j) k[j] = (FULL || j < valid) ? keys.vector(t + j, i * WLANES) : f32xW{};
    for (int g = 0; g < G; ++g) {
      f32xW qv = load_wide(q + g * D + i * WLANES);
#if defined(__AVX512F__)  // one load for the four keys (GCC would fold it into each FMA: 28 loads per 24 FMAs)
      asm("" : "+v"(qv));
#endif
      for (int j = 0; j < 4; ++j) dots[g][j] = fma_wide(qv, k[j], dots[g][j]);
    }
  }
}

template <int VECS, int G, bool FULL, typename Keys>
inline void score_four(const float* q, const Keys& keys, int64_t t, int valid, float scale, float* scores,
                       int64_t stride) {
  f32xW dots[G][4];
  quad_dots<VECS, G, FULL>(q, keys, t, valid, dots);
  for (int g = 0; g < G; ++g) {
    float sums[4];
    sum4(dots[g], sums);
    for (int j = 0; j < (FULL ? 4 : valid); ++j) scores[g * stride + t + j] = sums[j] * scale;
  }
}

#if defined(__AVX512F__)
// keys t .. t + 15: their quads' chunk sums kept, then finished together
template <int VECS, int G, typename Keys>
inline void score_wide(const float* q, const Keys& keys, int64_t t, float scale, float* scores, int64_t stride) {
  f32xW chunks[G][4];
#pragma GCC unroll 1  // one quad's code, looped (four copies of a long quad body measured slower at d = 128)
  for (int k = 0; k < 4; ++k) {
    f32xW dots[G][4];
    quad_dots<VECS, G, true>(q, keys, t + 4 * k, 4, dots);
    for (int g = 0; g < G; ++g) chunks[g][k] = sum4_chunks(dots[g]);
  }
  for (int g = 0; g < G; ++g) sum_keys(chunks[g], scale, scores + g * stride + t);
}
#endif

#if defined(__AVX__) && !defined(__AVX512F__)
// The dots of keys t .. t + K - 1 with G queries (G x K accumulators and the K keys in registers,
// each query vector read from memory by its FMAs: 11 of AVX2's 16 registers for two keys and four
// queries, 15 for three). Always inlined: a call would pass the accumulators through memory.
template <int VECS, int G, int K, typename Keys>
__attribute__((always_inline)) inline void key_dots(const float* q, const Keys& keys, int64_t t, f32xW dots[G][K]) {
  constexpr int64_t D = VECS * WLANES;
  for (int k = 0; k < K; ++k) keys.prefetch(t + k);
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < K; ++k) dots[g][k] = f32xW{};
  for (int i = 0; i < VECS; ++i) {
    f32xW key[K];
    for (int k = 0; k < K; ++k) key[k] = keys.vector(t + k, i * WLANES);
    for (int g = 0; g < G; ++g) {
      const f32xW qv = load_wide(q + g * D + i * WLANES);
      for (int k = 0; k < K; ++k) dots[g][k] = fma_wide(qv, key[k], dots[g][k]);
    }
  }
}

// keys t, t + 1
template <int VECS, int G, typename Keys>
inline void score_pair(const float* q, const Keys& keys, int64_t t, float scale, float* scores, int64_t stride) {
  f32xW dots[G][2];
  key_dots<VECS, G, 2>(q, keys, t, dots);
  for (int g = 0; g < G; ++g) {
    float sums[2];
    sum2(dots[g], sums);
    scores[g * stride + t] = sums[0] * scale;
    scores[g * stride + t + 1] = sums[1] * scale;
  }
}

// keys t .. t + 2 (past d = 64): twelve chains of FMAs for four queries where a pair has eight, too
// few to cover the FMAs' latency (AMD Zen 5, the scores' loop from the first-level cache: 97% of
// the FMA peak against 82%); their sums by sum4's additions, the third key's pair partials taken
// with itself (each key's lanes sum only among themselves), so the same bits as a pair's or four's.
template <int VECS, int G, typename Keys>
inline void score_triple(const float* q, const Keys& keys, int64_t t, float scale, float* scores, int64_t stride) {
  f32xW dots[G][3];
  key_dots<VECS, G, 3>(q, keys, t, dots);
  const __m128 factor = _mm_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    const __m256 third = load<__m256>(&dots[g][2]);
    alignas(16) float sums[4];
    _mm_store_ps(sums, four_scores(pair_partials(load<__m256>(&dots[g][0]), load<__m256>(&dots[g][1])),
                                   pair_partials(third, third), factor));
    for (int k = 0; k < 3; ++k) scores[g * stride + t + k] = sums[k];
  }
}

// keys t .. t + 3 as two pairs, each pair's dots reduced to its partials at once (G registers kept
// beside the second pair's 11), then the four keys finished together: sum4's additions, so the
// same bits as score_pair's or score_four's, in fewer shuffles per key.
template <int VECS, int G, typename Keys>
inline void score_pairs(const float* q, const Keys& keys, int64_t t, float scale, float* scores, int64_t stride) {
  __m256 first[G];
  {
    f32xW dots[G][2];
    key_dots<VECS, G, 2>(q, keys, t, dots);
    for (int g = 0; g < G; ++g) first[g] = pair_partials(load<__m256>(&dots[g][0]), load<__m256>(&dots[g][1]));
  }
  f32xW dots[G][2];
  key_dots<VECS, G, 2>(q, keys, t + 2, dots);
  const __m128 factor = _mm_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    _mm_storeu_ps(scores + g * stride + t,
                  four_scores(first[g], pair_partials(load<__m256>(&dots[g][0]), load<__m256>(&dots[g][1])), factor));
  }
}
#endif

template <int VECS, int G, typename Keys>
void scores_fixed(const float* q, const Keys& keys, int64_t n, float scale, float* scores, int64_t stride) {
  int64_t t = 0;
#if defined(__AVX512F__)
  for (; t + WLANES <= n; t += WLANES) score_wide<VECS, G>(q, keys, t, scale, scores, stride);
#elif defined(__AVX__)
  if constexpr (G > 2) {  // G x 4 accumulators and four keys would spill: two keys at a time
    // up to d = 64, two pairs finished together (AMD Zen 5: the Llama and Qwen2.5 shapes' prefill
    // attention 1.14-1.20x, their decode 1.01-1.04x); at d = 128 that measured 0-8% slower (prefill)
    if constexpr (VECS <= 8)
      for (; t + 4 <= n; t += 4) score_pairs<VECS, G>(q, keys, t, scale, scores, stride);
    else
      for (; t + 3 <= n; t += 3) score_triple<VECS, G>(q, keys, t, scale, scores, stride);
    for (; t + 2 <= n; t += 2) score_pair<VECS, G>(q, keys, t, scale, scores, stride);
  }
#endif
  for (; t + 4 <= n; t += 4) score_four<VECS, G, true>(q, keys, t, 4, scale, scores, stride);
  if (t < n) score_four<VECS, G, false>(q, keys, t, static_cast<int>(n - t), scale, scores, stride);
}

template <int G, typename Keys>
void block_scores(const float* q, const Keys& keys, int64_t n, int64_t d, float scale, float* scores, int64_t stride) {
  if (d % WLANES == 0) {
    switch (d / WLANES) {
      case 1: return scores_fixed<1, G>(q, keys, n, scale, scores, stride);
      case 2: return scores_fixed<2, G>(q, keys, n, scale, scores, stride);
      case 4: return scores_fixed<4, G>(q, keys, n, scale, scores, stride);
      case 6: return scores_fixed<6, G>(q, keys, n, scale, scores, stride);
      case 8: return scores_fixed<8, G>(q, keys, n, scale, scores, stride);
      case 12: return scores_fixed<12, G>(q, keys, n, scale, scores, stride);  // d = 96 on 8 lanes (Phi-3)
      case 16: return scores_fixed<16, G>(q, keys, n, scale, scores, stride);
      case 32: return scores_fixed<32, G>(q, keys, n, scale, scores, stride);
      default: break;
    }
  }
  for (int64_t t = 0; t < n; ++t)
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s = std::fma(q[g * d + i], keys.value(t, i), s);
      scores[g * stride + t] = s * scale;
    }
}

// ---- values --------------------------------------------------------------------------------
// acc[g * d + i] = fma(p[g * stride + t], value_t[i], acc[g * d + i]) for t = 0 .. n - 1 in order
// (acc holds the sums so far: a block's keys may come from several stores; `fresh`: it holds
// zeros, which the registers start from instead of reading them).
// Value vectors per query held in registers at once when a block's G queries' whole rows (G x VECS
// vectors) are more than VALUE_ACCUMULATORS: the fewest passes over the rows whose spans (as even
// as can be) fit within them beside the G weights and a value vector. On AVX2's 16 registers 24
// accumulators (d = 96, two queries) spilled: 12 at a time measured 1.07-1.19x faster there
// (prefill); at 12 for every shape, d = 64 and the float16 decode reads measured slower (more
// passes over the rows), so 16, fewer where the weights need the room (four queries: 8; with
// BATCH_QUERIES 4 and score_pair, AMD Zen 5: prefill attention 1.05-1.19x, decode 1.02-1.06x).
// Spans need not divide VECS: two queries at d = 128 on AVX2 take 5, 5 and 6 vectors (12 FMA
// chains) where a divisor gave four passes of 4 (8 chains, too few to cover the FMAs' latency).
#if defined(__AVX512F__)
constexpr int VALUE_ACCUMULATORS = 24, VECTOR_REGS = 32;
#else
constexpr int VALUE_ACCUMULATORS = 16, VECTOR_REGS = 16;
#endif

// Whether g queries' accumulators of `span` vectors each fit beside their g weights and a value vector.
constexpr bool span_fits(int g, int span) { return g * span <= VALUE_ACCUMULATORS && g * span + g + 1 <= VECTOR_REGS; }

// The passes over a block's value rows for g queries of `vecs` vectors: the fewest whose spans (as
// even as can be: pass k takes vectors [k vecs / passes, (k + 1) vecs / passes)) fit; on 32
// registers only spans that divide vecs (four queries at d = 256, AMD Zen 5: three passes of 6, 5
// and 5 vectors measured 2-5% slower than four of 4).
constexpr int value_passes(int g, int vecs) {
  for (int passes = 1; passes < vecs; ++passes)
    if ((VECTOR_REGS == 16 || vecs % passes == 0) && span_fits(g, (vecs + passes - 1) / passes)) return passes;
  return vecs;
}

// One pass: vectors [first, first + SPAN) of every query's sums, each value vector read once (and
// asked for ahead by the first pass of the first queries).
template <int VECS, int G, int SPAN, bool PREFETCH, typename Values>
__attribute__((always_inline)) inline void accumulate_span(const Values& values, int64_t n, const float* p,
                                                           int64_t stride, float* acc, bool fresh, int first) {
  constexpr int64_t D = WLANES * VECS;
  f32xW a[G][SPAN];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < SPAN; ++i) a[g][i] = fresh ? f32xW{} : load<f32xW>(acc + g * D + WLANES * (first + i));
  for (int64_t t = 0; t < n; ++t) {
    if (PREFETCH && first == 0) values.prefetch(t);
    f32xW weight[G];
    for (int g = 0; g < G; ++g) weight[g] = f32xW{} + p[g * stride + t];
    for (int i = 0; i < SPAN; ++i) {
      const f32xW v = values.vector(t, WLANES * (first + i));
      for (int g = 0; g < G; ++g) a[g][i] = fma_wide(weight[g], v, a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < SPAN; ++i) store(acc + g * D + WLANES * (first + i), a[g][i]);
}

// G queries' sums in the passes value_passes sets, pass k over vectors [k VECS / P, (k + 1) VECS /
// P): spans of one size as a loop (the code of one pass: four inlined copies measured 2-8% slower
// on AVX-512), uneven ones each inlined.
template <int VECS, int G, bool PREFETCH, typename Values, int... PASS>
inline void accumulate_passes(const Values& values, int64_t n, const float* p, int64_t stride, float* acc, bool fresh,
                              std::integer_sequence<int, PASS...>) {
  constexpr int P = sizeof...(PASS);
  if constexpr (VECS % P == 0) {
    for (int first = 0; first < VECS; first += VECS / P)
      accumulate_span<VECS, G, VECS / P, PREFETCH>(values, n, p, stride, acc, fresh, first);
  } else {
    (accumulate_span<VECS, G, (PASS + 1) * VECS / P - PASS * VECS / P, PREFETCH>(values, n, p, stride, acc, fresh,
                                                                                 PASS * VECS / P),
     ...);
  }
}

// The queries whose sums go through the rows together: all G, but on 16 registers four queries
// with more than 8 vectors each (two per pass: 8 FMA chains) as three (four per pass: 12 chains)
// and then the fourth alone (8 per pass). AMD Zen 5, AVX2 build, d = 128 and 256 at 8K, float16
// KV: the decode attention 1.06-1.09x and 1.11-1.16x (with score_triple).
constexpr int value_query_group(int g, int vecs) { return VECTOR_REGS == 16 && g == 4 && vecs > 8 ? 3 : g; }

// Each sum's FMAs in key order, whatever the passes or the query groups: the same bits for any.
template <int VECS, int G, typename Values>
void accumulate_fixed(const Values& values, int64_t n, const float* p, int64_t stride, float* acc, bool fresh) {
  constexpr int FIRST_GROUP = value_query_group(G, VECS), REST = G - FIRST_GROUP;
  accumulate_passes<VECS, FIRST_GROUP, true>(values, n, p, stride, acc, fresh,
                                             std::make_integer_sequence<int, value_passes(FIRST_GROUP, VECS)>{});
  if constexpr (REST > 0)
    accumulate_passes<VECS, REST, false>(values, n, p + FIRST_GROUP * stride, stride, acc + FIRST_GROUP * WLANES * VECS,
                                         fresh, std::make_integer_sequence<int, value_passes(REST, VECS)>{});
}

template <int G, typename Values>
void accumulate_values(const Values& values, int64_t n, int64_t d, const float* p, int64_t stride, float* acc,
                       bool fresh) {
  if (d % WLANES == 0) {
    switch (d / WLANES) {
      case 1: return accumulate_fixed<1, G>(values, n, p, stride, acc, fresh);
      case 2: return accumulate_fixed<2, G>(values, n, p, stride, acc, fresh);
      case 4: return accumulate_fixed<4, G>(values, n, p, stride, acc, fresh);
      case 6: return accumulate_fixed<6, G>(values, n, p, stride, acc, fresh);
      case 8: return accumulate_fixed<8, G>(values, n, p, stride, acc, fresh);
      case 12: return accumulate_fixed<12, G>(values, n, p, stride, acc, fresh);
      case 16: return accumulate_fixed<16, G>(values, n, p, stride, acc, fresh);
      case 32: return accumulate_fixed<32, G>(values, n, p, stride, acc, fresh);
      default: break;
    }
  }
  if (fresh) std::fill(acc, acc + G * d, 0.0f);
  for (int g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] = std::fma(p[g * stride + t], values.value(t, i), acc[g * d + i]);
}

// For each of G rows of scores (row g at s + g * stride, n each): s[t] = exp(s[t] - shift[g]) for
// t < n, and sum[g] = their sum (lanes by index, then the tail one by one). The G rows' vectors
// interleaved: each exp is a chain of dependent steps, and G of them overlap.
template <int G>
inline void exp_shifted(float* s, int64_t stride, int64_t n, const float* shift, float* sum) {
  f32xW sums[G] = {};
  int64_t t = 0;
  for (; t + WLANES <= n; t += WLANES)
    for (int g = 0; g < G; ++g) {
      const f32xW e = exp_vector(load<f32xW>(s + g * stride + t) - shift[g]);
      store(s + g * stride + t, e);
      sums[g] += e;
    }
  for (int g = 0; g < G; ++g) {
    sum[g] = sum_wide(sums[g]);
    for (int64_t i = t; i < n; ++i) {
      float& x = s[g * stride + i];
      x = exp_clamped(x - shift[g]);
      sum[g] += x;
    }
  }
}

// ---- one block of one row ---------------------------------------------------------------------
// Per-thread scratch of the block function: scores, a prefill block's gathered rows, the scales
// of the run being read.
struct BlockScratch {
  std::vector<float> scores, keys, values;
  ScaleScratch scales;
  void reserve(int group, int64_t d) {
    if (static_cast<int64_t>(scores.size()) < group * KEY_BLOCK) scores.resize(group * KEY_BLOCK);
    if (static_cast<int64_t>(keys.size()) < KEY_BLOCK * d) keys.resize(KEY_BLOCK * d), values.resize(KEY_BLOCK * d);
  }
};

// A block's (or a row's merged) result per query: max m, sum l, output o (d).
struct Partial {
  float* m;
  float* l;
  float* o;  // (G, d)
};

// The keys and values [lo, hi) of one KV head: runs in position order, one per store.
struct BlockKV {
  KVRun runs[MAX_KV_SEGMENTS];
  int count;
};

// Every store's part of [lo, hi), read in place.
inline BlockKV block_kv(const HLLayerCache& cache, int64_t head, int64_t lo, int64_t hi) {
  BlockKV kv{};
  for (int s = 0; s < cache.n_segments; ++s) {
    const HLKVSegment& seg = cache.segments[s];
    const int64_t a = std::max(lo, seg.position), b = std::min(hi, seg.position + seg.tokens);
    if (a < b) kv.runs[kv.count++] = KVRun{&seg, nullptr, nullptr, head, seg.row0 + (a - seg.position), b - a};
  }
  return kv;
}

// Rows [0, n) of a reader into out (n, d): the values the kernels read, as float32.
template <typename Reader>
inline void gather_rows(const Reader& rows, int64_t n, int64_t d, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    rows.prefetch(t);
    int64_t i = 0;
    for (; i + WLANES <= d && d % WLANES == 0; i += WLANES) store(out + t * d + i, rows.vector(t, i));
    for (; i < d; ++i) out[t * d + i] = rows.value(t, i);
  }
}

// [lo, hi) as one run of float32 rows (a prefill block's, read by many queries): in place where
// one float32 store holds them all, else gathered into the scratch (float16 widened, codes
// dequantized: the very values the readers give in place).
inline KVRun gathered_kv(const HLLayerCache& cache, int64_t head, int64_t lo, int64_t hi, int64_t d,
                         BlockScratch& scratch) {
  const BlockKV kv = block_kv(cache, head, lo, hi);
  if (kv.count == 1 && kv.runs[0].seg->format == KV_F32) {
    const HLKVSegment& seg = *kv.runs[0].seg;
    const int64_t at = (head * seg.capacity + kv.runs[0].row) * d;
    return {nullptr, static_cast<const float*>(seg.k) + at, static_cast<const float*>(seg.v) + at, head, 0, hi - lo};
  }
  int64_t at = 0;
  for (int r = 0; r < kv.count; ++r) {
    for (bool keys : {true, false})
      read_run(kv.runs[r], keys, d, scratch.scales, [&](const auto& rows) {
        gather_rows(rows, kv.runs[r].n, d, (keys ? scratch.keys : scratch.values).data() + at * d);
      });
    at += kv.runs[r].n;
  }
  return {nullptr, scratch.keys.data(), scratch.values.data(), head, 0, hi - lo};
}

// max of s[0 .. n) (exact in any order): WLANES lanes, folded in registers.
inline float block_max(const float* s, int64_t n) {
  f32xW best = f32xW{} - INFINITY;
  int64_t t = 0;
  for (; t + WLANES <= n; t += WLANES) {
    const f32xW x = load<f32xW>(s + t);
    best = best > x ? best : x;
  }
#if defined(__AVX512F__)
  f32xL low8, high8;
  wide_halves(best, low8, high8);
  const f32xL eight = low8 > high8 ? low8 : high8;
#else
  const f32xL eight = best;
#endif
  f32x4 low, high;
  std::memcpy(&low, &eight, 16);
  std::memcpy(&high, reinterpret_cast<const char*>(&eight) + 16, 16);
  const f32x4 four = low > high ? low : high;
  float m = std::max(std::max(four[0], four[2]), std::max(four[1], four[3]));
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// G queries q (G, d) over a block's keys and values (its runs, each read in place as its store
// holds it): out.m/l/o per query, as the arithmetic at the top of this file says. The scores of
// each run go to its keys' places in `scores` ((G, KEY_BLOCK) scratch); the values accumulate
// run after run, in key order.
template <int G>
void attend_rows(const float* q, const BlockKV& kv, int64_t d, const ScoreOptions& options, Partial out,
                 BlockScratch& scratch) {
  float* scores = scratch.scores.data();
  int64_t n = 0;
  for (int r = 0; r < kv.count; ++r) {
    read_run(kv.runs[r], true, d, scratch.scales, [&](const auto& keys) {
      block_scores<G>(q, keys, kv.runs[r].n, d, options.scale, scores + n, KEY_BLOCK);
    });
    n += kv.runs[r].n;
  }
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * KEY_BLOCK;
    if (options.softcap > 0.0f) softcap_scores(s, n, options.softcap);
    out.m[g] = block_max(s, n);
  }
  exp_shifted<G>(scores, KEY_BLOCK, n, out.m, out.l);
  if (kv.count == 0) std::fill(out.o, out.o + G * d, 0.0f);
  int64_t at = 0;
  for (int r = 0; r < kv.count; ++r) {
    read_run(kv.runs[r], false, d, scratch.scales, [&](const auto& values) {
      accumulate_values<G>(values, kv.runs[r].n, d, scores + at, KEY_BLOCK, out.o, r == 0);
    });
    at += kv.runs[r].n;
  }
}

#if defined(__AVX512F__)
constexpr int BATCH_QUERIES = 6;  // 4 x 6 score accumulators, 4 keys and a query of 32 registers
#else
constexpr int BATCH_QUERIES = 4;  // of 16 registers: 4 x 2 score accumulators, 2 keys, a query
#endif

inline void attend_chunk(int count, const float* q, const BlockKV& kv, int64_t d, const ScoreOptions& options,
                         Partial out, BlockScratch& scratch) {
  switch (count) {
#define HL_COUNT(N) \
  case N:           \
    return attend_rows<N>(q, kv, d, options, out, scratch);
    HL_COUNT(1) HL_COUNT(2) HL_COUNT(3) HL_COUNT(4) HL_COUNT(5) HL_COUNT(6)
#undef HL_COUNT
    default:
      break;
  }
}

// `count` queries q (count, d) over the same block of keys and values, in chunks of as many query
// vectors as the registers hold (each query's arithmetic is its own: the chunking changes nothing
// but speed). `scratch.scores` holds (BATCH_QUERIES, KEY_BLOCK).
inline void attend_queries(int count, const float* q, const BlockKV& kv, int64_t d, const ScoreOptions& options,
                           Partial out, BlockScratch& scratch) {
  scratch.reserve(BATCH_QUERIES, d);
  for (int c0 = 0; c0 < count; c0 += BATCH_QUERIES) {
    const int c = std::min(BATCH_QUERIES, count - c0);
    const Partial part{out.m + c0, out.l + c0, out.o + c0 * d};
    attend_chunk(c, q + c0 * d, kv, d, options, part, scratch);
  }
}

inline bool supported_group(int group) { return group >= 1 && group <= MAX_GROUP; }

// x[t] = exp_clamped(x[t]) for t < n: WLANES at a time where they fit (exp_vector's lanes, the very
// same operations), then one by one.
inline void exp_each(float* x, int64_t n) {
  int64_t t = 0;
  for (; t + WLANES <= n; t += WLANES) store(x + t, exp_vector(load<f32xW>(x + t)));
  for (; t < n; ++t) x[t] = exp_clamped(x[t]);
}

// merge_into's step past the first block, its factors a = e^(m - top) and c = e^(m_b - top) given.
inline void merge_scaled(float& m, float& l, float* o, float top, float a, float c, float l_b, const float* o_b,
                         int64_t d) {
  l = std::fma(l, a, l_b * c);
  for (int64_t i = 0; i < d; ++i) o[i] = std::fma(o[i], a, o_b[i] * c);
  m = top;
}

// state <- state merged with a block's result (one query; `first`: state holds nothing yet).
inline void merge_into(float& m, float& l, float* o, float m_b, float l_b, const float* o_b, int64_t d, bool first) {
  if (first) {
    m = m_b, l = l_b;
    std::memcpy(o, o_b, d * sizeof(float));
    return;
  }
  const float top = std::max(m, m_b);
  merge_scaled(m, l, o, top, exp_clamped(m - top), exp_clamped(m_b - top), l_b, o_b, d);
}

// The blocks a row at `position` attends: [first, last] (block indices), its keys [lo, position].
struct RowBlocks {
  int64_t lo, first, last;
  RowBlocks(const HLLayerCache& cache, int64_t position) {
    lo = cache.first_visible(position);
    first = lo / KEY_BLOCK;
    last = position / KEY_BLOCK;
  }
  int64_t count() const { return last - first + 1; }
  int64_t block_lo(int64_t b) const { return std::max(lo, b * KEY_BLOCK); }
  static int64_t block_hi(int64_t b, int64_t position) { return std::min(position + 1, (b + 1) * KEY_BLOCK); }
};

// ---- decode rows ----------------------------------------------------------------------------
constexpr int64_t WHOLE_PAIRS_PER_THREAD = 4;  // (row, KV head) pairs per thread for whole-pair items

// A decode call's blocks per item. Where the (row, KV head) pairs give every thread at least
// WHOLE_PAIRS_PER_THREAD, each pair is one item (its `longest`-or-fewer blocks), which merges its
// blocks as it goes: no block results written and read back (on AMD Zen 5, the Mistral shape at
// 8K: that merge had 14% of the AVX2 build's attention samples, most on its loads of the kept
// results; the kernel 1-4% faster from the caches without it, the same from memory within noise).
// Else long runs of consecutive blocks (one KV head's keys and values read as long streams, which
// the hardware prefetcher keeps ahead of), yet about 8 items per thread for the claiming to even
// out. The items only share the work out: a row's blocks and their merge order, hence its bits, do
// not depend on them.
inline int64_t decode_blocks_per_item(int64_t blocks, int64_t pairs, int64_t longest, int threads) {
  const int64_t team = std::max(threads, 1);
  if (pairs >= WHOLE_PAIRS_PER_THREAD * team) return std::max<int64_t>(longest, 1);
  return std::clamp<int64_t>(blocks / (8 * team), MIN_BLOCKS_PER_ITEM, MAX_BLOCKS_PER_ITEM);
}

// The block results of decode rows, shared by a team; its buffers only grow.
struct AttentionParts {
  std::vector<float> out, max, sum;
  std::vector<int64_t> row_blocks, item_offsets;  // (rows + 1,): where each row's kept blocks / items start
  int64_t blocks_per_item = MIN_BLOCKS_PER_ITEM;   // this call's item size (decode_blocks_per_item)

  void reserve(int64_t blocks, int64_t group_outputs, int64_t rows) {
    grow(out, blocks * group_outputs);
    grow(max, blocks * group_outputs);
    grow(sum, blocks * group_outputs);
    grow(row_blocks, rows + 1);
    grow(item_offsets, rows + 1);
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  }
};

// Attention of decode rows: row r's queries q (H, D) at q + r * q_stride, at position
// caches[r].start, over its own KV -> out (rows, H, D), and where lse is not null the log-sum-exp
// of each (row, head)'s scores -> lse (rows, H) (a partial attention another part merges with), by
// the team (`parts` sized by thread 0 between barriers). Items (row, KV head, up to
// parts.blocks_per_item consecutive blocks) are claimed as the threads come; an item holding a
// whole row's blocks merges them as it goes, the other rows' (row, query head)s merge their kept
// block results in order after a barrier.
void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                    int64_t rows, int n_heads, int n_kv_heads, int64_t d, const ScoreOptions& options,
                    float* out, AttentionParts& parts, BlockScratch& scratch, float* lse = nullptr);

// ---- prefill chunks ---------------------------------------------------------------------------
// Attention of prefill chunks by the team: segment s is rows offsets[s] .. offsets[s + 1] - 1 of q
// (stride q_stride), consecutive positions from caches[s].start of the sequence whose layer KV is
// caches[s] -> out (rows, H, D). Items (segment, KV head, QUERY_ROWS positions: a head's last
// positions first) are claimed as the threads come; an item walks the blocks its rows see in
// order, each row merging its blocks as it goes (the queries of the rows that see a block whole go
// through it together).
void prefill_attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                            const int64_t* offsets, int64_t segments, int n_heads, int n_kv_heads, int64_t d,
                            const ScoreOptions& options, float* out, BlockScratch& scratch);

}  // namespace hl
