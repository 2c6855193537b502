// Causal attention of prefill chunks: T consecutive positions of a sequence over its cache (the
// keys before the chunk and the chunk's own, already written), flash-attention style; the chunks
// of several sequences at once (segments).
//
// Self-contained. Work items are (block of QUERY_ROWS positions, KV head): the queries of every
// head sharing the KV head at those positions (QUERY_ROWS x group vectors) go through the keys in
// blocks of KEYS keys. Each key block is converted to float32 once per item, keys transposed
// (keys along the vector lanes) and values as rows; every query vector's scores for the block are
// then lanes of a few registers (tiles of SCORE_QUERIES query vectors x SCORE_VECS key vectors),
// the softmax runs online (running max and sum per query vector), and the values are accumulated
// in tiles of VALUE_QUERIES query vectors x VALUE_VECS output vectors held in registers. Each key
// and value row is read from the cache once per item instead of once per query. Items go to the
// threads round-robin (later positions attend to more keys). Float32 arithmetic; the results
// depend on T and the positions only (not on the team size).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "abi.h"
#include "attention.h"
#include "common.h"
#include "thread_team.h"

namespace hl {
namespace prefill {

#if defined(__AVX512F__)
typedef float f32xA __attribute__((vector_size(64)));
#else
typedef float f32xA __attribute__((vector_size(32)));
#endif
constexpr int ALANES = sizeof(f32xA) / sizeof(float);
constexpr int KEYS = 64;  // keys per block
constexpr int KEY_VECS = KEYS / ALANES;
constexpr int64_t QUERY_ROWS = 32;
#if defined(__AVX512F__)  // 32 registers
constexpr int SCORE_QUERIES = 6, SCORE_VECS = 4;  // 24 accumulators
constexpr int VALUE_QUERIES = 6, VALUE_VECS = 4;
#else  // 16 registers
constexpr int SCORE_QUERIES = 6, SCORE_VECS = 2;  // 12 accumulators, 2 key vectors, 1 broadcast
constexpr int VALUE_QUERIES = 3, VALUE_VECS = 4;  // 12 accumulators
#endif

inline f32xA load_a(const float* p) { return load<f32xA>(p); }

typedef int32_t i32xA __attribute__((vector_size(sizeof(f32xA))));

// Lanes t0 .. t0 + ALANES of a key block that lie in [lo, hi) (all bits set), else 0.
inline i32xA visible_lanes(int64_t t0, int64_t lo, int64_t hi) {
  i32xA index;
  for (int i = 0; i < ALANES; ++i) index[i] = static_cast<int32_t>(t0 + i);
  return (index >= static_cast<int32_t>(lo)) & (index < static_cast<int32_t>(hi));
}

// max(p[lo .. hi)) over a block's scores (-inf when the range is empty).
inline float visible_max(const float* p, int64_t lo, int64_t hi) {
  const f32xA none = f32xA{} - INFINITY;
  f32xA best = none;
  for (int64_t t0 = 0; t0 < KEYS; t0 += ALANES) {
    const f32xA x = visible_lanes(t0, lo, hi) ? load_a(p + t0) : none;
    best = best > x ? best : x;
  }
  float out = best[0];
  for (int i = 1; i < ALANES; ++i) out = std::max(out, best[i]);
  return out;
}

// max(p[0 .. KEYS)).
inline float lanes_max(const float* p) {
  f32xA best = load_a(p);
  for (int64_t t0 = ALANES; t0 < KEYS; t0 += ALANES) {
    const f32xA x = load_a(p + t0);
    best = best > x ? best : x;
  }
  float out = best[0];
  for (int i = 1; i < ALANES; ++i) out = std::max(out, best[i]);
  return out;
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

// A key block's n_keys rows in float32: keys transposed into keys_t (d, KEYS) (zero past
// n_keys), values as rows (n_keys, d); 8 x 8 tiles where whole.
static_assert(LANES == 8, "convert_block transposes 8 x 8 tiles of load_lanes vectors");

template <typename T>
void convert_block(const T* keys, const T* values, int64_t n_keys, int64_t d, float* keys_t, float* values_out) {
  const int64_t n_values = n_keys * d;
  int64_t j = 0;
  for (; j + 8 <= n_values; j += 8) {
    const f32x8t v = load_lanes(values + j);
    std::memcpy(values_out + j, &v, sizeof v);
  }
  for (; j < n_values; ++j) values_out[j] = to_float(values[j]);
  int64_t t = 0;
  for (; t + 8 <= n_keys; t += 8) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      f32x8t tile[8];
      for (int r = 0; r < 8; ++r) tile[r] = load_lanes(keys + (t + r) * d + i);
      transpose8(tile);
      for (int c = 0; c < 8; ++c) std::memcpy(keys_t + (i + c) * KEYS + t, &tile[c], sizeof tile[c]);
    }
    for (; i < d; ++i)
      for (int r = 0; r < 8; ++r) keys_t[i * KEYS + t + r] = to_float(keys[(t + r) * d + i]);
  }
  for (; t < n_keys; ++t)
    for (int64_t i = 0; i < d; ++i) keys_t[i * KEYS + t] = to_float(keys[t * d + i]);
  for (; t < KEYS; ++t)
    for (int64_t i = 0; i < d; ++i) keys_t[i * KEYS + t] = 0.0f;
}

// Per-thread scratch of one work item.
struct AttentionScratch {
  std::vector<float> q, out, max, sum, rescale, scores, keys_t, values;
  void reserve(int64_t vectors, int64_t d) {
    q.resize(vectors * d);
    rescale.resize(vectors);
    out.resize(vectors * d);
    max.resize(vectors);
    sum.resize(vectors);
    scores.resize(vectors * KEYS);
    keys_t.resize(d * KEYS);
    values.resize(KEYS * d);
  }
};

// scores[v][j * ALANES ..] = q_v . keys_t[:, key vector j] for VQ query vectors and KV key vectors
// (from key vector j0; keys along the lanes).
template <int VQ, int KV>
void score_tile(const float* q, const float* keys_t, int64_t d, int j0, float* scores) {
  f32xA acc[VQ][KV] = {};
  for (int64_t i = 0; i < d; ++i) {
    f32xA k[KV];
    for (int j = 0; j < KV; ++j) k[j] = load_a(keys_t + i * KEYS + (j0 + j) * ALANES);
    for (int v = 0; v < VQ; ++v) {
      const float qi = q[v * d + i];
      for (int j = 0; j < KV; ++j) acc[v][j] += qi * k[j];
    }
  }
  for (int v = 0; v < VQ; ++v)
    for (int j = 0; j < KV; ++j) std::memcpy(scores + v * KEYS + (j0 + j) * ALANES, &acc[v][j], sizeof(f32xA));
}

template <int VQ>
void score_queries(const float* q, const float* keys_t, int64_t d, float* scores) {
  for (int j0 = 0; j0 < KEY_VECS; j0 += SCORE_VECS) score_tile<VQ, SCORE_VECS>(q, keys_t, d, j0, scores);
}

// All `vectors` query vectors' scores for one key block.
inline void score_block(int64_t vectors, const float* q, const float* keys_t, int64_t d, float* scores) {
  int64_t v = 0;
  for (; v + SCORE_QUERIES <= vectors; v += SCORE_QUERIES)
    score_queries<SCORE_QUERIES>(q + v * d, keys_t, d, scores + v * KEYS);
  for (; v < vectors; ++v) score_queries<1>(q + v * d, keys_t, d, scores + v * KEYS);
}

// out[v][i0 .. i0 + DV * ALANES) = out * rescale[v] + sum_t p[v][t] * values[t][..] for VQ
// query vectors (values: the block's float32 rows (n_keys, d)), DV output vectors in registers.
template <int VQ, int DV>
void accumulate_tile(const float* p, const float* rescale, const float* values, int64_t n_keys, int64_t d, int64_t i0,
                     float* out) {
  f32xA acc[VQ][DV];
  for (int v = 0; v < VQ; ++v)
    for (int i = 0; i < DV; ++i) acc[v][i] = load_a(out + v * d + i0 + i * ALANES) * rescale[v];
  for (int64_t t = 0; t < n_keys; ++t) {
    f32xA value[DV];
    for (int i = 0; i < DV; ++i) value[i] = load_a(values + t * d + i0 + i * ALANES);
    for (int v = 0; v < VQ; ++v) {
      const float pv = p[v * KEYS + t];
      for (int i = 0; i < DV; ++i) acc[v][i] += pv * value[i];
    }
  }
  for (int v = 0; v < VQ; ++v)
    for (int i = 0; i < DV; ++i) std::memcpy(out + v * d + i0 + i * ALANES, &acc[v][i], sizeof(f32xA));
}

// The same for output columns [i0, d) one at a time (head sizes that are not whole vectors).
inline void accumulate_tail(const float* p, float rescale, const float* values, int64_t n_keys, int64_t d, int64_t i0,
                     float* out) {
  for (int64_t i = i0; i < d; ++i) {
    float acc = out[i] * rescale;
    for (int64_t t = 0; t < n_keys; ++t) acc += p[t] * values[t * d + i];
    out[i] = acc;
  }
}

template <int VQ>
void accumulate_queries(const float* p, const float* rescale, const float* values, int64_t n_keys, int64_t d,
                        float* out) {
  int64_t i0 = 0;
  for (; i0 + VALUE_VECS * ALANES <= d; i0 += VALUE_VECS * ALANES)
    accumulate_tile<VQ, VALUE_VECS>(p, rescale, values, n_keys, d, i0, out);
  for (; i0 + ALANES <= d; i0 += ALANES) accumulate_tile<VQ, 1>(p, rescale, values, n_keys, d, i0, out);
  if (i0 < d)
    for (int v = 0; v < VQ; ++v) accumulate_tail(p + v * KEYS, rescale[v], values, n_keys, d, i0, out + v * d);
}

// Every query vector's outputs for one key block (p: the block's softmax weights).
inline void accumulate_block(int64_t vectors, const float* p, const float* rescale, const float* values, int64_t n_keys,
                      int64_t d, float* out) {
  int64_t v = 0;
  for (; v + VALUE_QUERIES <= vectors; v += VALUE_QUERIES)
    accumulate_queries<VALUE_QUERIES>(p + v * KEYS, rescale + v, values, n_keys, d, out + v * d);
  for (; v < vectors; ++v) accumulate_queries<1>(p + v * KEYS, rescale + v, values, n_keys, d, out + v * d);
}

// One work item: rows [r0, r1) of the chunk, KV head kv_head. q: the chunk's q/k/v rows
// (stride q_stride, query heads first); cache: the layer's cache, `start` = the chunk's first
// position; out: (rows, H, D).
template <typename T>
void attention_item(const float* q, int64_t q_stride, const HLLayerCache& cache, int64_t r0, int64_t r1,
                    int64_t kv_head, int group, int64_t d, const ScoreOptions& options, float* out, int64_t n_heads,
                    AttentionScratch& s) {
  const int64_t vectors = (r1 - r0) * group;
  s.reserve(vectors, d);
  const float scale = options.scale;
  for (int64_t r = r0; r < r1; ++r)
    for (int g = 0; g < group; ++g) {
      const float* src = q + r * q_stride + (kv_head * group + g) * d;
      float* dst = s.q.data() + ((r - r0) * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale;
    }
  std::fill(s.out.begin(), s.out.begin() + vectors * d, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + vectors, -INFINITY);
  std::fill(s.sum.begin(), s.sum.begin() + vectors, 0.0f);
  const T* keys = static_cast<const T*>(cache.keys) + kv_head * cache.capacity * d;
  const T* values = static_cast<const T*>(cache.values) + kv_head * cache.capacity * d;
  // positions: row r is at cache.start + r and attends keys [first(r), start + r]
  auto first_key = [&](int64_t r) {
    const int64_t pos = cache.start + r;
    return cache.window > 0 && pos + 1 > cache.window ? pos + 1 - cache.window : int64_t{0};
  };
  const int64_t k_begin = first_key(r0), k_end = cache.start + r1;  // keys [k_begin, k_end)
  for (int64_t k0 = k_begin; k0 < k_end; k0 += KEYS) {
    const int64_t n_keys = std::min<int64_t>(KEYS, k_end - k0);
    convert_block(keys + k0 * d, values + k0 * d, n_keys, d, s.keys_t.data(), s.values.data());
    score_block(vectors, s.q.data(), s.keys_t.data(), d, s.scores.data());
    if (options.softcap > 0.0f) softcap_scores(s.scores.data(), vectors * KEYS, options.softcap);
    for (int64_t v = 0; v < vectors; ++v) {  // mask, online softmax: p = exp(score - new max), rescale the past
      const int64_t r = r0 + v / group;
      const int64_t lo = std::max<int64_t>(first_key(r) - k0, 0), hi = std::min<int64_t>(cache.start + r + 1 - k0, n_keys);
      float* p = s.scores.data() + v * KEYS;
      const float block_max = lo == 0 && hi == KEYS ? lanes_max(p) : visible_max(p, lo, hi);
      if (block_max == -INFINITY) {  // nothing of this block is visible to the row
        std::fill(p, p + KEYS, 0.0f);
        s.rescale[v] = 1.0f;
        continue;
      }
      const float new_max = std::max(s.max[v], block_max);
      s.rescale[v] = s.max[v] == -INFINITY ? 0.0f : s.max[v] == new_max ? 1.0f : exp_clamped(s.max[v] - new_max);
      f32xA sums = {};
      if (lo == 0 && hi == KEYS) {  // every key visible (all but the diagonal and window-edge blocks)
        for (int64_t t0 = 0; t0 < KEYS; t0 += ALANES) {
          const f32xA e = exp_vector(load_a(p + t0) - new_max);
          std::memcpy(p + t0, &e, sizeof e);
          sums += e;
        }
      } else {
        for (int64_t t0 = 0; t0 < KEYS; t0 += ALANES) {  // p = exp(score - max) where visible, else 0
          const f32xA e = exp_vector(load_a(p + t0) - new_max);
          const f32xA kept = visible_lanes(t0, lo, hi) ? e : f32xA{};
          std::memcpy(p + t0, &kept, sizeof kept);
          sums += kept;
        }
      }
      float sum = 0.0f;
      for (int i = 0; i < ALANES; ++i) sum += sums[i];
      s.sum[v] = s.sum[v] * s.rescale[v] + sum;
      s.max[v] = new_max;
    }
    accumulate_block(vectors, s.scores.data(), s.rescale.data(), s.values.data(), n_keys, d, s.out.data());
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int g = 0; g < group; ++g) {
      const int64_t v = (r - r0) * group + g;
      const float inv = 1.0f / s.sum[v];
      float* dst = out + (r * n_heads + kv_head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = s.out[v * d + i] * inv;
    }
}

// Attention of prefill chunks of several sequences by the team: segment s is rows offsets[s] ..
// offsets[s + 1] - 1 of q (stride q_stride), consecutive positions of the sequence whose layer
// cache is caches[s] (start = the segment's first position) -> out (rows, H, D). Work items
// (segment, block of query rows, KV head) go to the threads round-robin; a row's result depends
// on its segment's positions only.
inline void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                           const int64_t* offsets, int64_t segments, int n_heads, int n_kv_heads, int64_t head_dim,
                           const ScoreOptions& options, float* out) {
  thread_local AttentionScratch scratch;
  const int group = n_heads / n_kv_heads;
  int64_t first_item = 0;  // of segment s
  int64_t item = team.thread;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t rows = offsets[s + 1] - offsets[s];
    const int64_t items = (rows + QUERY_ROWS - 1) / QUERY_ROWS * n_kv_heads;
    const float* q_s = q + offsets[s] * q_stride;
    float* out_s = out + offsets[s] * n_heads * head_dim;
    for (; item < first_item + items; item += team.size) {
      const int64_t block = (item - first_item) / n_kv_heads, kv_head = (item - first_item) % n_kv_heads;
      const int64_t r0 = block * QUERY_ROWS, r1 = std::min(rows, r0 + QUERY_ROWS);
      if (caches[s].kv_dtype == KV_F16)
        attention_item<uint16_t>(q_s, q_stride, caches[s], r0, r1, kv_head, group, head_dim, options, out_s,
                                  n_heads, scratch);
      else
        attention_item<float>(q_s, q_stride, caches[s], r0, r1, kv_head, group, head_dim, options, out_s, n_heads,
                               scratch);
    }
    first_item += items;
  }
  team.barrier();
}

}  // namespace prefill
}  // namespace hl
