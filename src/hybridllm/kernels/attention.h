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
// output o / l. Quantized tokens are dequantized (code * scale + zero, one FMA) into a block's
// float scratch first; float16 tokens are converted in registers.
//
// Decode rows: the blocks of a row go to the threads as items (row, KV head, up to
// BLOCKS_PER_ITEM blocks), each block's (m_b, l_b, o_b) kept, then each (row, query head) merges
// its blocks in order. Prefill chunks: items (chunk, QUERY_ROWS positions, KV head), each row
// merging its blocks as it goes. The same block function and the same merge either way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
constexpr int64_t BLOCKS_PER_ITEM = 4;  // a decode item's blocks
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

// The horizontal sums of four vectors (out[j] of v[j] only), in a fixed order: a transposing reduction.
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

// ---- scores --------------------------------------------------------------------------------
// scores[g * stride + t] = scale * q_g . key_t for G queries (q: G x d) and n keys (rows of d,
// float32 or float16 as stored). d a multiple of WLANES: keys four at a time (each key vector
// loaded once for every query), the missing ones of the last four zeros (a key's dot does not
// depend on its neighbours); else one key at a time, plain FMAs in order.
template <int VECS, int G, bool FULL, typename T>
inline void score_four(const float* q, const T* keys, int64_t t, int valid, float scale, float* scores,
                       int64_t stride) {
  constexpr int64_t D = VECS * WLANES;
  f32xW dots[G][4] = {};
  for (int i = 0; i < VECS; ++i) {
    f32xW k[4];
    for (int j = 0; j < 4; ++j) k[j] = (FULL || j < valid) ? load_wide(keys + (t + j) * D + i * WLANES) : f32xW{};
    for (int g = 0; g < G; ++g) {
      const f32xW qv = load_wide(q + g * D + i * WLANES);
      for (int j = 0; j < 4; ++j) dots[g][j] = fma_wide(qv, k[j], dots[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float sums[4];
    sum4(dots[g], sums);
    for (int j = 0; j < (FULL ? 4 : valid); ++j) scores[g * stride + t + j] = sums[j] * scale;
  }
}

template <int VECS, int G, typename T>
void scores_fixed(const float* q, const T* keys, int64_t n, float scale, float* scores, int64_t stride) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) score_four<VECS, G, true>(q, keys, t, 4, scale, scores, stride);
  if (t < n) score_four<VECS, G, false>(q, keys, t, static_cast<int>(n - t), scale, scores, stride);
}

// scores[g * stride + t] = scale * q_g . key_t for G queries (q: G x d) and n keys (rows of d,
// float32 or float16 as stored): per key a dot in WLANES lanes (FMAs in order over d), then sum4's
// reduction. Keys four at a time (each key vector loaded once for every query); the missing ones
// of the last four are zeros (a key's dot does not depend on its neighbours). d not a multiple of
// WLANES: one key at a time, plain FMAs in order.
template <int G, typename T>
void block_scores(const float* q, const T* keys, int64_t n, int64_t d, float scale, float* scores, int64_t stride) {
  if (d % WLANES == 0) {
    switch (d / WLANES) {
      case 1: return scores_fixed<1, G>(q, keys, n, scale, scores, stride);
      case 2: return scores_fixed<2, G>(q, keys, n, scale, scores, stride);
      case 4: return scores_fixed<4, G>(q, keys, n, scale, scores, stride);
      case 6: return scores_fixed<6, G>(q, keys, n, scale, scores, stride);
      case 8: return scores_fixed<8, G>(q, keys, n, scale, scores, stride);
      case 16: return scores_fixed<16, G>(q, keys, n, scale, scores, stride);
      case 32: return scores_fixed<32, G>(q, keys, n, scale, scores, stride);
      default: break;
    }
  }
  for (int64_t t = 0; t < n; ++t)
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s = std::fma(q[g * d + i], to_float(keys[t * d + i]), s);
      scores[g * stride + t] = s * scale;
    }
}

// ---- values --------------------------------------------------------------------------------
// acc[g * d + i] = fma(p[g * stride + t], value_t[i], acc[g * d + i]) for t = 0 .. n - 1 in order
// (acc holds the sums so far: a block's keys may come from several stores).
template <int VECS, int G, typename T>
void accumulate_fixed(const T* values, int64_t n, const float* p, int64_t stride, float* acc) {
  constexpr int64_t D = WLANES * VECS;
  if constexpr (G * VECS <= 24) {
    f32xW a[G][VECS];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < VECS; ++i) a[g][i] = load<f32xW>(acc + g * D + WLANES * i);
    for (int64_t t = 0; t < n; ++t) {
      f32xW weight[G];
      for (int g = 0; g < G; ++g) weight[g] = f32xW{} + p[g * stride + t];
      for (int i = 0; i < VECS; ++i) {
        const f32xW v = load_wide(values + t * D + WLANES * i);
        for (int g = 0; g < G; ++g) a[g][i] = fma_wide(weight[g], v, a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < VECS; ++i) store(acc + g * D + WLANES * i, a[g][i]);
  } else {
    for (int g = 0; g < G; ++g) {
      f32xW a[VECS];
      for (int i = 0; i < VECS; ++i) a[i] = load<f32xW>(acc + g * D + WLANES * i);
      for (int64_t t = 0; t < n; ++t)
        for (int i = 0; i < VECS; ++i) a[i] = fma_wide(f32xW{} + p[g * stride + t], load_wide(values + t * D + WLANES * i), a[i]);
      for (int i = 0; i < VECS; ++i) store(acc + g * D + WLANES * i, a[i]);
    }
  }
}

template <int G, typename T>
void accumulate_values(const T* values, int64_t n, int64_t d, const float* p, int64_t stride, float* acc) {
  if (d % WLANES == 0) {
    switch (d / WLANES) {
      case 1: return accumulate_fixed<1, G>(values, n, p, stride, acc);
      case 2: return accumulate_fixed<2, G>(values, n, p, stride, acc);
      case 4: return accumulate_fixed<4, G>(values, n, p, stride, acc);
      case 6: return accumulate_fixed<6, G>(values, n, p, stride, acc);
      case 8: return accumulate_fixed<8, G>(values, n, p, stride, acc);
      case 16: return accumulate_fixed<16, G>(values, n, p, stride, acc);
      case 32: return accumulate_fixed<32, G>(values, n, p, stride, acc);
      default: break;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i) acc[g * d + i] = std::fma(p[g * stride + t], to_float(values[t * d + i]), acc[g * d + i]);
}

// s[t] = exp(s[t] - shift) for t < n; returns their sum (lanes by index, then the tail).
inline float exp_shifted(float* s, int64_t n, float shift) {
  f32xW sums = {};
  int64_t t = 0;
  for (; t + WLANES <= n; t += WLANES) {
    const f32xW e = exp_vector(load<f32xW>(s + t) - shift);
    store(s + t, e);
    sums += e;
  }
  float sum = sum_wide(sums);
  for (; t < n; ++t) {
    s[t] = exp_clamped(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

// ---- reading a segment -----------------------------------------------------------------------
// LANES codes of a quantized row from element i on, as float32: bytes, or 4-bit codes two to a
// byte (element i in the low nibble when i is even).
inline f32xL code_lanes(const uint8_t* row, int64_t i, bool four) {
  typedef uint8_t u8xL __attribute__((vector_size(LANES)));
  u8xL codes;
  if (four) {
    const uint8_t* pairs = row + i / 2;  // i is a multiple of LANES (even)
    for (int l = 0; l < LANES; l += 2) codes[l] = pairs[l / 2] & 15, codes[l + 1] = pairs[l / 2] >> 4;
  } else {
    codes = load<u8xL>(row + i);
  }
  return __builtin_convertvector(codes, f32xL);
}

// Rows [r0, r0 + n) of a quantized store's KV head as float32 (n, d): code * scale + zero, one
// fused multiply-add per value (the same bits whether a lane or the scalar tail computes it).
inline void dequantize_rows(const HLKVSegment& seg, bool keys, int64_t head, int64_t r0, int64_t n, int64_t d,
                            float* out) {
  const bool four = seg.format == KV_Q4 || seg.format == KV_Q4_CHANNEL_KEYS;
  const bool per_channel = keys && (seg.format == KV_Q8_CHANNEL_KEYS || seg.format == KV_Q4_CHANNEL_KEYS);
  const int64_t row_bytes = four ? d / 2 : d;
  const auto* codes = static_cast<const uint8_t*>(keys ? seg.k : seg.v) + head * seg.capacity * row_bytes;
  const auto* scales = static_cast<const uint16_t*>(keys ? seg.k_scale : seg.v_scale);
  const auto* zeros = static_cast<const uint16_t*>(keys ? seg.k_zero : seg.v_zero);
  const int64_t group = per_channel ? seg.key_group : seg.group;
  // Scale and zero of value i sit at scale_of[i / step]: per channel (keys in token groups, KIVI's)
  // one per channel of the row's token group, (Hkv, capacity / group, d); else one per group of
  // channels of the row, (Hkv, capacity, d / group).
  const int64_t step = per_channel ? 1 : group;
  const bool uniform = !per_channel && group % LANES == 0;  // one scale per LANES values
  float scale_lanes[LANES], zero_lanes[LANES];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = r0 + j;
    const uint8_t* c = codes + row * row_bytes;
    float* o = out + j * d;
    const int64_t at = per_channel ? (head * (seg.capacity / group) + row / group) * d
                                   : (head * seg.capacity + row) * (d / group);
    const uint16_t* scale_of = scales + at;
    const uint16_t* zero_of = zeros + at;
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) {
      f32xL scale, zero;
      if (per_channel) {
        scale = load_lanes(scale_of + i), zero = load_lanes(zero_of + i);
      } else if (uniform) {
        scale = f32xL{} + half_to_float(scale_of[i / step]), zero = f32xL{} + half_to_float(zero_of[i / step]);
      } else {
        for (int l = 0; l < LANES; ++l)
          scale_lanes[l] = half_to_float(scale_of[(i + l) / step]), zero_lanes[l] = half_to_float(zero_of[(i + l) / step]);
        scale = load<f32xL>(scale_lanes), zero = load<f32xL>(zero_lanes);
      }
      store(o + i, fma_lanes(code_lanes(c, i, four), scale, zero));
    }
    for (; i < d; ++i) {
      const int code = four ? (i % 2 ? c[i / 2] >> 4 : c[i / 2] & 15) : c[i];
      o[i] = std::fma(static_cast<float>(code), half_to_float(scale_of[i / step]), half_to_float(zero_of[i / step]));
    }
  }
}

// A run of keys or values of one KV head as rows a kernel reads: float32 or float16 in place, or
// a quantized run dequantized into `scratch`.
struct Rows {
  const void* data;
  bool half;
};

inline Rows segment_rows(const HLKVSegment& seg, bool keys, int64_t head, int64_t r0, int64_t n, int64_t d,
                         float* scratch) {
  if (seg.format == KV_F32 || seg.format == KV_F16) {
    const int64_t at = (head * seg.capacity + r0) * d;
    if (seg.format == KV_F16) return {static_cast<const uint16_t*>(keys ? seg.k : seg.v) + at, true};
    return {static_cast<const float*>(keys ? seg.k : seg.v) + at, false};
  }
  dequantize_rows(seg, keys, head, r0, n, d, scratch);
  return {scratch, false};
}

// ---- one block of one row ---------------------------------------------------------------------
// Per-thread scratch of the block function.
struct BlockScratch {
  std::vector<float> scores, keys, values;
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

// The keys and values [lo, hi) of one KV head as rows the kernels read: in place where one dense
// run holds them all (float16 too, unless `widen`), else gathered into the scratch as float32
// (float16 widened exactly, quantized tokens dequantized). Either way the same values.
struct BlockKV {
  const void* keys;
  const void* values;
  bool half;
};

inline BlockKV block_kv(const HLLayerCache& cache, int64_t head, int64_t lo, int64_t hi, int64_t d,
                        BlockScratch& scratch, bool widen) {
  for (int s = 0; s < cache.n_segments; ++s) {
    const HLKVSegment& seg = cache.segments[s];
    const bool dense = seg.format == KV_F32 || (seg.format == KV_F16 && !widen);
    if (dense && seg.position <= lo && hi <= seg.position + seg.tokens) {
      const Rows keys = segment_rows(seg, true, head, seg.row0 + (lo - seg.position), hi - lo, d, nullptr);
      const Rows values = segment_rows(seg, false, head, seg.row0 + (lo - seg.position), hi - lo, d, nullptr);
      return {keys.data, values.data, keys.half};
    }
  }
  for (int s = 0; s < cache.n_segments; ++s) {
    const HLKVSegment& seg = cache.segments[s];
    const int64_t a = std::max(lo, seg.position), b = std::min(hi, seg.position + seg.tokens);
    if (a >= b) continue;
    const int64_t row = seg.row0 + (a - seg.position);
    for (int k = 0; k < 2; ++k) {
      float* out = (k == 0 ? scratch.keys.data() : scratch.values.data()) + (a - lo) * d;
      if (seg.format == KV_F32) {
        std::memcpy(out, static_cast<const float*>(k == 0 ? seg.k : seg.v) + (head * seg.capacity + row) * d,
                    (b - a) * d * sizeof(float));
      } else if (seg.format == KV_F16) {
        const uint16_t* in = static_cast<const uint16_t*>(k == 0 ? seg.k : seg.v) + (head * seg.capacity + row) * d;
        for (int64_t i = 0; i < (b - a) * d; ++i) out[i] = half_to_float(in[i]);
      } else {
        dequantize_rows(seg, k == 0, head, row, b - a, d, out);
      }
    }
  }
  return {scratch.keys.data(), scratch.values.data(), false};
}

// max of s[0 .. n) (exact in any order).
inline float block_max(const float* s, int64_t n) {
  f32xL best = f32xL{} - INFINITY;
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    const f32xL x = load<f32xL>(s + t);
    best = best > x ? best : x;
  }
  float m = -INFINITY;
  for (int i = 0; i < LANES; ++i) m = std::max(m, best[i]);
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// G queries q (G, d) over n keys and values (rows of d, float32 or float16): out.m/l/o per query,
// as the arithmetic at the top of this file says. `scores`: (G, KEY_BLOCK) scratch.
template <int G, typename T>
void attend_rows(const float* q, const T* keys, const T* values, int64_t n, int64_t d, const ScoreOptions& options,
                 Partial out, float* scores) {
  block_scores<G>(q, keys, n, d, options.scale, scores, KEY_BLOCK);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * KEY_BLOCK;
    if (options.softcap > 0.0f) softcap_scores(s, n, options.softcap);
    out.m[g] = block_max(s, n);
    out.l[g] = exp_shifted(s, n, out.m[g]);
  }
  std::fill(out.o, out.o + G * d, 0.0f);
  accumulate_values<G>(values, n, d, scores, KEY_BLOCK, out.o);
}

#if defined(__AVX512F__)
constexpr int BATCH_QUERIES = 6;  // 4 x 6 score accumulators, 4 keys and a query of 32 registers
#else
constexpr int BATCH_QUERIES = 2;  // of 16 registers
#endif

template <typename T>
void attend_chunk(int count, const float* q, const T* keys, const T* values, int64_t n, int64_t d,
                  const ScoreOptions& options, Partial out, float* scores) {
  switch (count) {
#define HL_COUNT(N) \
  case N:           \
    return attend_rows<N>(q, keys, values, n, d, options, out, scores);
    HL_COUNT(1) HL_COUNT(2) HL_COUNT(3) HL_COUNT(4) HL_COUNT(5) HL_COUNT(6)
#undef HL_COUNT
    default:
      break;
  }
}

// `count` queries q (count, d) over the same n keys and values (kv: block_kv's rows), in chunks of
// as many query vectors as the registers hold (each query's arithmetic is its own: the chunking
// changes nothing but speed). `scratch.scores` holds (BATCH_QUERIES, KEY_BLOCK).
inline void attend_queries(int count, const float* q, const BlockKV& kv, int64_t n, int64_t d,
                           const ScoreOptions& options, Partial out, BlockScratch& scratch) {
  scratch.reserve(BATCH_QUERIES, d);
  for (int c0 = 0; c0 < count; c0 += BATCH_QUERIES) {
    const int c = std::min(BATCH_QUERIES, count - c0);
    const Partial part{out.m + c0, out.l + c0, out.o + c0 * d};
    if (kv.half)
      attend_chunk(c, q + c0 * d, static_cast<const uint16_t*>(kv.keys), static_cast<const uint16_t*>(kv.values), n,
                   d, options, part, scratch.scores.data());
    else
      attend_chunk(c, q + c0 * d, static_cast<const float*>(kv.keys), static_cast<const float*>(kv.values), n, d,
                   options, part, scratch.scores.data());
  }
}

inline bool supported_group(int group) { return group >= 1 && group <= MAX_GROUP; }

// state <- state merged with a block's result (one query; `first`: state holds nothing yet).
inline void merge_into(float& m, float& l, float* o, float m_b, float l_b, const float* o_b, int64_t d, bool first) {
  if (first) {
    m = m_b, l = l_b;
    std::memcpy(o, o_b, d * sizeof(float));
    return;
  }
  const float top = std::max(m, m_b);
  const float a = exp_clamped(m - top), c = exp_clamped(m_b - top);
  l = std::fma(l, a, l_b * c);
  for (int64_t i = 0; i < d; ++i) o[i] = std::fma(o[i], a, o_b[i] * c);
  m = top;
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
// The block results of decode rows, shared by a team; its buffers only grow.
struct AttentionParts {
  std::vector<float> out, max, sum;
  std::vector<int64_t> row_blocks, item_offsets;  // (rows + 1,): where each row's blocks / items start

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
// BLOCKS_PER_ITEM blocks) are claimed as the threads come; then each (row, query head) merges its
// blocks in order.
inline void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                           int64_t rows, int n_heads, int n_kv_heads, int64_t d, const ScoreOptions& options,
                           float* out, AttentionParts& parts, BlockScratch& scratch, float* lse = nullptr) {
  const int group = n_heads / n_kv_heads;
  if (team.thread == 0) {
    int64_t blocks = 0, items = 0;
    parts.reserve(0, 0, rows);
    for (int64_t r = 0; r < rows; ++r) {
      parts.row_blocks[r] = blocks;
      parts.item_offsets[r] = items;
      const RowBlocks rb(caches[r], caches[r].start);
      blocks += rb.count() * n_kv_heads;
      items += (rb.count() + BLOCKS_PER_ITEM - 1) / BLOCKS_PER_ITEM * n_kv_heads;
    }
    parts.reserve(blocks, static_cast<int64_t>(group) * (d + 2), rows);
    parts.row_blocks[rows] = blocks;
    parts.item_offsets[rows] = items;
  }
  team.barrier();
  const int64_t all_items = parts.item_offsets[rows];
  const int64_t stride = static_cast<int64_t>(group);  // one block's max/sum entries
  for (int64_t item = team.claim(); item < all_items; item = team.claim()) {
    const int64_t r = std::upper_bound(parts.item_offsets.begin(), parts.item_offsets.begin() + rows, item) -
                      parts.item_offsets.begin() - 1;
    const HLLayerCache& cache = caches[r];
    const RowBlocks rb(cache, cache.start);
    const int64_t items_per_head = (rb.count() + BLOCKS_PER_ITEM - 1) / BLOCKS_PER_ITEM;
    const int64_t local = item - parts.item_offsets[r];
    const int64_t head = local / items_per_head, chunk = local % items_per_head;
    for (int64_t i = chunk * BLOCKS_PER_ITEM; i < std::min(rb.count(), (chunk + 1) * BLOCKS_PER_ITEM); ++i) {
      const int64_t b = rb.first + i;
      const int64_t slot = parts.row_blocks[r] + head * rb.count() + i;  // (row, head, block)
      const Partial result{parts.max.data() + slot * stride, parts.sum.data() + slot * stride,
                           parts.out.data() + slot * stride * d};
      const int64_t lo = rb.block_lo(b), hi = RowBlocks::block_hi(b, cache.start);
      scratch.reserve(group, d);
      const BlockKV kv = block_kv(cache, head, lo, hi, d, scratch, false);
      attend_queries(group, q + r * q_stride + head * group * d, kv, hi - lo, d, options, result, scratch);
    }
  }
  team.barrier();
  const Share heads(rows * n_heads, team);
  for (int64_t i = heads.first; i < heads.last; ++i) {
    const int64_t r = i / n_heads, h = i % n_heads, head = h / group, g = h % group;
    const RowBlocks rb(caches[r], caches[r].start);
    float m = 0.0f, l = 0.0f;
    float* o = out + i * d;
    for (int64_t blk = 0; blk < rb.count(); ++blk) {
      const int64_t slot = parts.row_blocks[r] + head * rb.count() + blk;
      merge_into(m, l, o, parts.max[slot * stride + g], parts.sum[slot * stride + g],
                 parts.out.data() + (slot * stride + g) * d, d, blk == 0);
    }
    const float inverse = 1.0f / l;
    for (int64_t j = 0; j < d; ++j) o[j] *= inverse;
    if (lse != nullptr) lse[i] = m + std::log(l);
  }
  team.barrier();
}

// ---- prefill chunks ---------------------------------------------------------------------------
// Per-thread state of a prefill item: each row's merged result (max, sum per query, then the
// outputs), the block results of the rows that see a block whole, and their gathered queries.
struct PrefillScratch {
  std::vector<float> state, block, queries;
  void reserve(int64_t rows, int group, int64_t d) {
    const int64_t per_row = group * (d + 2);
    if (static_cast<int64_t>(state.size()) < rows * per_row) {
      state.resize(rows * per_row);
      block.resize(rows * per_row);
      queries.resize(rows * group * d);
    }
  }
};

// Attention of prefill chunks by the team: segment s is rows offsets[s] .. offsets[s + 1] - 1 of q
// (stride q_stride), consecutive positions from caches[s].start of the sequence whose layer KV is
// caches[s] -> out (rows, H, D). Items (segment, QUERY_ROWS positions, KV head) are claimed as the
// threads come; an item walks the blocks its rows see in order, each row merging its blocks as it
// goes (the queries of the rows that see a block whole go through it together).
inline void prefill_attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                                   const int64_t* offsets, int64_t segments, int n_heads, int n_kv_heads, int64_t d,
                                   const ScoreOptions& options, float* out, BlockScratch& scratch) {
  const int group = n_heads / n_kv_heads;
  const int64_t per_row = group * (d + 2);
  thread_local PrefillScratch work;
  work.reserve(QUERY_ROWS, group, d);
  int64_t items = 0;
  for (int64_t s = 0; s < segments; ++s) items += (offsets[s + 1] - offsets[s] + QUERY_ROWS - 1) / QUERY_ROWS * n_kv_heads;
  for (int64_t item = team.claim(); item < items; item = team.claim()) {
    int64_t s = 0, local = item;
    for (;; ++s) {
      const int64_t count = (offsets[s + 1] - offsets[s] + QUERY_ROWS - 1) / QUERY_ROWS * n_kv_heads;
      if (local < count) break;
      local -= count;
    }
    const HLLayerCache& cache = caches[s];
    const int64_t head = local % n_kv_heads, r0 = offsets[s] + local / n_kv_heads * QUERY_ROWS;
    const int64_t r1 = std::min(offsets[s + 1], r0 + QUERY_ROWS);
    auto position = [&](int64_t r) { return cache.start + (r - offsets[s]); };
    auto query = [&](int64_t r) { return q + r * q_stride + head * group * d; };
    // merge the block results of rows [ra, ra + n) (laid out m (n G), l (n G), o (n G, d)) into their states
    auto merge_rows = [&](int64_t ra, int64_t n, const float* results, int64_t b) {
      const float* m = results;
      const float* l = results + n * group;
      const float* o = results + 2 * n * group;
      for (int64_t i = 0; i < n; ++i) {
        float* st = work.state.data() + (ra + i - r0) * per_row;
        const bool first = b == RowBlocks(cache, position(ra + i)).first;
        for (int g = 0; g < group; ++g)
          merge_into(st[g], st[group + g], st + 2 * group + g * d, m[i * group + g], l[i * group + g],
                     o + (i * group + g) * d, d, first);
      }
    };
    scratch.reserve(BATCH_QUERIES, d);
    const int64_t first_block = RowBlocks(cache, position(r0)).first, last_block = position(r1 - 1) / KEY_BLOCK;
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t b_lo = b * KEY_BLOCK, b_hi = b_lo + KEY_BLOCK;
      // the block's keys and values the item's rows see, as float32 rows once for them all
      const int64_t kv_lo = std::max(b_lo, cache.first_visible(position(r0)));
      const int64_t kv_hi = std::min(b_hi, position(r1 - 1) + 1);
      const BlockKV kv = block_kv(cache, head, kv_lo, kv_hi, d, scratch, true);
      auto rows_from = [&](int64_t lo) {
        return BlockKV{static_cast<const float*>(kv.keys) + (lo - kv_lo) * d,
                       static_cast<const float*>(kv.values) + (lo - kv_lo) * d, false};
      };
      int64_t whole_first = r1, whole_last = r0;  // the rows that see the block whole: one run
      for (int64_t r = r0; r < r1; ++r) {
        const RowBlocks rb(cache, position(r));
        if (b < rb.first || b > rb.last) continue;  // the block is outside this row's keys
        const int64_t lo = rb.block_lo(b), hi = RowBlocks::block_hi(b, position(r));
        if (lo == b_lo && hi == b_hi) {
          whole_first = std::min(whole_first, r), whole_last = r + 1;
          continue;
        }
        const Partial result{work.block.data(), work.block.data() + group, work.block.data() + 2 * group};
        attend_queries(group, query(r), rows_from(lo), hi - lo, d, options, result, scratch);
        merge_rows(r, 1, work.block.data(), b);
      }
      if (whole_first < whole_last) {
        const int64_t n = whole_last - whole_first;
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(work.queries.data() + i * group * d, query(whole_first + i), group * d * sizeof(float));
        const Partial result{work.block.data(), work.block.data() + n * group, work.block.data() + 2 * n * group};
        attend_queries(static_cast<int>(n * group), work.queries.data(), rows_from(b_lo), KEY_BLOCK, d, options,
                       result, scratch);
        merge_rows(whole_first, n, work.block.data(), b);
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      const float* st = work.state.data() + (r - r0) * per_row;
      for (int g = 0; g < group; ++g) {
        const float inverse = 1.0f / st[group + g];
        float* o = out + (r * n_heads + head * group + g) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = st[2 * group + g * d + j] * inverse;
      }
    }
  }
  team.barrier();
}

}  // namespace hl
