// The attention of decode rows: one query position per row over its own cache, its grouped
// query heads together, split into (KV head, token chunk) items merged by log-sum-exp.
//
// Self-contained. How a row's attention is cut into items depends on its length only (not on
// the team size or the batch), so the chunks, and the order their results are merged in, are the
// same alone or in any batch, on any number of threads. Keys and values are read as the cache
// stores them (float32 or float16, converted in registers, float32 accumulation).
#pragma once

#include <cmath>
#include <cstdint>
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

// scores[t] = cap * tanh(scores[t] / cap) for t < n.
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inverse = 1.0f / cap;
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) store(s + t, tanh_vector(load<f32xL>(s + t) * inverse) * cap);
  for (; t < n; ++t) s[t] = tanh_clamped(s[t] * inverse) * cap;
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
      case 32: done = accumulate_values_group<32>(values, len, group, scores, stride, acc); break;
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

// One token's grouped-query attention of work item `item` (kv head, token chunk) of a row:
// its running max, sum and weighted values per query head of the group.
template <typename T>
void attention_item(const float* q, const T* k_cache, const T* v_cache, int64_t capacity, int64_t total,
                    int group, int64_t d, const ScoreOptions& options, const AttentionSplit& split, int64_t item,
                    float* part_out, float* part_max, float* part_sum, std::vector<float>& scores) {
  const int64_t chunk = split.chunk;
  if (static_cast<int64_t>(scores.size()) < group * chunk) scores.resize(group * chunk);
  const int64_t kv_head = item / split.n_chunks;
  const int64_t t0 = (item % split.n_chunks) * chunk;
  const int64_t len = std::min(total, t0 + chunk) - t0;
  const T* keys = k_cache + kv_head * capacity * d;
  const T* values = v_cache + kv_head * capacity * d;
  score_chunk(q + kv_head * group * d, keys + t0 * d, len, group, d, options.scale, scores.data(), chunk);
  for (int g = 0; g < group; ++g) {
    float* s = scores.data() + g * chunk;
    if (options.softcap > 0.0f) softcap_scores(s, len, options.softcap);
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
    part_max[item * group + g] = m;
    part_sum[item * group + g] = exp_shifted(s, len, m);
  }
  accumulate_values(values + t0 * d, len, group, d, scores.data(), chunk, part_out + item * group * d);
}

// Query head h's output (D,) from a row's work items, merged exactly, chunk by chunk in order.
inline void merge_head(int h, int group, int64_t d, const AttentionSplit& split, const float* part_out,
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

// The partial results of the rows' attention items, shared by a team; its buffers only grow.
struct AttentionParts {
  std::vector<float> out, max, sum;
  std::vector<int64_t> item_offsets;  // (rows + 1,): where each row's items start

  void reserve(int64_t rows, int n_heads, int n_kv_heads, int64_t head_dim) {
    const int64_t group = n_heads / n_kv_heads, items = AttentionSplit::max_items(n_kv_heads);
    grow(out, rows * items * group * head_dim);
    grow(max, rows * items * group);
    grow(sum, rows * items * group);
    grow(item_offsets, rows + 1);
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  }
};

// Attention of each row's queries q (H, D) (row r at q + r * q_stride) over its own cache
// (caches[r]: (Hkv, capacity, D), its first start + 1 tokens) -> out (rows, H, D), by the team
// (`parts` reserved for the rows). The work items of every row (kv head, token chunk) are shared
// out together, then each (row, query head) is merged. `scores` is the calling thread's scratch.
inline void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                           int64_t rows, int n_heads, int n_kv_heads, int head_dim, const ScoreOptions& options,
                           float* out, AttentionParts& parts, std::vector<float>& scores) {
  const int group = n_heads / n_kv_heads;
  const int64_t d = head_dim, row_items = AttentionSplit::max_items(n_kv_heads);
  int64_t* offsets = parts.item_offsets.data();  // every thread computes the same prefix sums
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
    float* part_out = parts.out.data() + r * row_items * group * d;
    float* part_max = parts.max.data() + r * row_items * group;
    float* part_sum = parts.sum.data() + r * row_items * group;
    const int64_t skip = c.first() * d;  // a sliding window starts `first` rows into every head
    if (c.kv_dtype == KV_F16)
      attention_item(q + r * q_stride, static_cast<const uint16_t*>(c.keys) + skip,
                     static_cast<const uint16_t*>(c.values) + skip, c.capacity, c.attended(), group, d, options,
                     split, i - offsets[r], part_out, part_max, part_sum, scores);
    else
      attention_item(q + r * q_stride, static_cast<const float*>(c.keys) + skip,
                     static_cast<const float*>(c.values) + skip, c.capacity, c.attended(), group, d, options, split,
                     i - offsets[r], part_out, part_max, part_sum, scores);
  }
  team.barrier();  // every item is done
  const Share heads(rows * n_heads, team);
  for (int64_t i = heads.first; i < heads.last; ++i) {
    const int64_t row = i / n_heads;
    const int h = static_cast<int>(i % n_heads);
    merge_head(h, group, d, AttentionSplit(caches[row].attended(), n_kv_heads),
               parts.out.data() + row * row_items * group * d, parts.max.data() + row * row_items * group,
               parts.sum.data() + row * row_items * group, out + i * d);
  }
  team.barrier();
}

}  // namespace hl
