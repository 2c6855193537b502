// Causal attention of a prefill chunk: T consecutive positions of one sequence over its cache
// (the keys before the chunk and the chunk's own, already written), flash-attention style.
//
// Included by decode.cpp (one translation unit): uses its HLLayerCache, vectors, exp_clamped,
// load_lanes (float32 or float16 KV read as stored), Team.
//
// Work items are (block of QUERY_ROWS positions, KV head): the queries of every head sharing
// the KV head at those positions (QUERY_ROWS x group vectors) go through the keys in blocks of
// KEYS keys: each key block is transposed once (keys along the vector lanes), then every query
// vector's scores for the block are lanes of a few registers, the softmax runs online (running
// max and sum per query vector), and the values are accumulated with the outputs of a few query
// vectors in registers. Each key and value row is read once per item instead of once per query.
// Items go to the threads round-robin (later positions attend to more keys). Float32 arithmetic;
// the results depend on T and the positions only (not on the team size).

namespace prefill {

#if defined(__AVX512F__)
typedef float f32xA __attribute__((vector_size(64)));
#else
typedef float f32xA __attribute__((vector_size(32)));
#endif
constexpr int ALANES = sizeof(f32xA) / sizeof(float);
constexpr int KEY_VECS = 4;
constexpr int KEYS = KEY_VECS * ALANES;  // keys per block: 4 registers of scores per query vector
constexpr int64_t QUERY_ROWS = 32;
#if defined(__AVX512F__)
constexpr int SCORE_QUERIES = 4, VALUE_QUERIES = 4;  // query vectors per register tile
#else
constexpr int SCORE_QUERIES = 2, VALUE_QUERIES = 1;
#endif


inline f32xA load_a(const float* p) { return load<f32xA>(p); }

typedef int32_t i32xA __attribute__((vector_size(sizeof(f32xA))));

// exp_clamped (decode.cpp) on a whole vector: the same polynomial, branch-free lanes.
inline f32xA exp_lanes(f32xA x) {
  const f32xA lo = f32xA{} - 87.0f, hi = f32xA{} + 87.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32xA y = x * 1.44269504088896341f + 0.5f;
  i32xA n = __builtin_convertvector(y, i32xA);  // truncation, then floor for negatives
  f32xA nf = __builtin_convertvector(n, f32xA);
  const i32xA above = nf > y;
  n += above;  // the mask is -1 where trunc rounded up
  nf = __builtin_convertvector(n, f32xA);
  const f32xA r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f32xA p = f32xA{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32xA bits = (n + 127) << 23;
  f32xA scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Per-thread scratch of one work item.
struct AttentionScratch {
  std::vector<float> q, out, max, sum, rescale, scores, keys_t;
  void reserve(int64_t vectors, int64_t d) {
    q.resize(vectors * d);
    rescale.resize(vectors);
    out.resize(vectors * d);
    max.resize(vectors);
    sum.resize(vectors);
    scores.resize(vectors * KEYS);
    keys_t.resize(d * KEYS);
  }
};

// scores[v][0..KEYS) = q_v . keys_t[:, t] for VQ query vectors from v0 (keys along the lanes).
template <int VQ>
void score_block(const float* q, const float* keys_t, int64_t d, float* scores) {
  f32xA acc[VQ][KEY_VECS] = {};
  for (int64_t i = 0; i < d; ++i) {
    f32xA k[KEY_VECS];
    for (int j = 0; j < KEY_VECS; ++j) k[j] = load_a(keys_t + i * KEYS + j * ALANES);
    for (int v = 0; v < VQ; ++v) {
      const float qi = q[v * d + i];
      for (int j = 0; j < KEY_VECS; ++j) acc[v][j] += qi * k[j];
    }
  }
  for (int v = 0; v < VQ; ++v) std::memcpy(scores + v * KEYS, acc[v], sizeof acc[v]);
}

inline f32xA load_values(const float* p) { return load_a(p); }

inline f32xA load_values(const uint16_t* p) {  // float16 -> float32 lanes
  f32xA v;
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#else
  const f32xL lanes = load_lanes(p);
  std::memcpy(&v, &lanes, sizeof v);
#endif
  return v;
}

// out[v] = out[v] * rescale[v] + sum_t p[v][t] * values[t] for VQ query vectors, D = DV * ALANES
// (the outputs in registers while the block's value rows stream through).
template <int VQ, int DV, typename T>
void accumulate_block(const float* p, const float* rescale, const T* values, int64_t n_keys, float* out) {
  constexpr int64_t d = DV * ALANES;
  f32xA acc[VQ][DV];
  for (int v = 0; v < VQ; ++v)
    for (int i = 0; i < DV; ++i) acc[v][i] = load_a(out + v * d + i * ALANES) * rescale[v];
  for (int64_t t = 0; t < n_keys; ++t) {
    const T* row = values + t * d;
    for (int i = 0; i < DV; ++i) {
      const f32xA value = load_values(row + i * ALANES);
      for (int v = 0; v < VQ; ++v) acc[v][i] += p[v * KEYS + t] * value;
    }
  }
  for (int v = 0; v < VQ; ++v)
    for (int i = 0; i < DV; ++i) std::memcpy(out + v * d + i * ALANES, &acc[v][i], sizeof(f32xA));
}

// The same for any D, outputs in memory (whole vectors, then a scalar tail).
template <typename T>
void accumulate_any(const float* p, float rescale, const T* values, int64_t n_keys, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + ALANES <= d; i += ALANES) {
    f32xA acc = load_a(out + i) * rescale;
    for (int64_t t = 0; t < n_keys; ++t) acc += p[t] * load_values(values + t * d + i);
    std::memcpy(out + i, &acc, sizeof acc);
  }
  for (; i < d; ++i) {
    float acc = out[i] * rescale;
    for (int64_t t = 0; t < n_keys; ++t) acc += p[t] * to_float(values[t * d + i]);
    out[i] = acc;
  }
}

template <int DV, typename T>
void accumulate_fixed(int64_t vectors, const float* p, const float* rescale, const T* values, int64_t n_keys,
                      float* out) {
  constexpr int VQ = DV * VALUE_QUERIES <= 16 ? VALUE_QUERIES : 1;  // accumulators stay in registers
  constexpr int64_t d = DV * ALANES;
  int64_t v = 0;
  for (; v + VQ <= vectors; v += VQ)
    accumulate_block<VQ, DV>(p + v * KEYS, rescale + v, values, n_keys, out + v * d);
  for (; v < vectors; ++v) accumulate_block<1, DV>(p + v * KEYS, rescale + v, values, n_keys, out + v * d);
}

template <typename T>
void accumulate_queries(int64_t vectors, const float* p, const float* rescale, const T* values, int64_t n_keys,
                        int64_t d, float* out) {
  switch (d % ALANES == 0 ? d / ALANES : 0) {
    case 2: return accumulate_fixed<2>(vectors, p, rescale, values, n_keys, out);
    case 4: return accumulate_fixed<4>(vectors, p, rescale, values, n_keys, out);
    case 8: return accumulate_fixed<8>(vectors, p, rescale, values, n_keys, out);
    case 16: return accumulate_fixed<16>(vectors, p, rescale, values, n_keys, out);
    default: break;
  }
  for (int64_t v = 0; v < vectors; ++v) accumulate_any(p + v * KEYS, rescale[v], values, n_keys, d, out + v * d);
}

// One work item: rows [r0, r1) of the chunk, KV head kv_head. q: the chunk's q/k/v rows
// (stride q_stride, query heads first); cache: the layer's cache, `start` = the chunk's first
// position; out: (rows, H, D).
template <typename T>
void attention_item(const float* q, int64_t q_stride, const HLLayerCache& cache, int64_t r0, int64_t r1,
                    int64_t kv_head, int group, int64_t d, float* out, int64_t n_heads, AttentionScratch& s) {
  const int64_t vectors = (r1 - r0) * group;
  s.reserve(vectors, d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
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
    for (int64_t t = 0; t < KEYS; ++t) {  // the block's keys, transposed: keys_t[i][t]
      if (t < n_keys) {
        const T* key = keys + (k0 + t) * d;
        for (int64_t i = 0; i < d; ++i) s.keys_t[i * KEYS + t] = to_float(key[i]);
      } else {
        for (int64_t i = 0; i < d; ++i) s.keys_t[i * KEYS + t] = 0.0f;
      }
    }
    int64_t v = 0;
    for (; v + SCORE_QUERIES <= vectors; v += SCORE_QUERIES)
      score_block<SCORE_QUERIES>(s.q.data() + v * d, s.keys_t.data(), d, s.scores.data() + v * KEYS);
    for (; v < vectors; ++v) score_block<1>(s.q.data() + v * d, s.keys_t.data(), d, s.scores.data() + v * KEYS);
    for (v = 0; v < vectors; ++v) {  // mask, online softmax: p = exp(score - new max), rescale the past
      const int64_t r = r0 + v / group;
      const int64_t lo = std::max<int64_t>(first_key(r) - k0, 0), hi = std::min<int64_t>(cache.start + r + 1 - k0, n_keys);
      float* p = s.scores.data() + v * KEYS;
      float block_max = -INFINITY;
      for (int64_t t = lo; t < hi; ++t) block_max = std::max(block_max, p[t]);
      if (block_max == -INFINITY) {  // nothing of this block is visible to the row
        std::fill(p, p + KEYS, 0.0f);
        s.rescale[v] = 1.0f;
        continue;
      }
      const float new_max = std::max(s.max[v], block_max);
      s.rescale[v] = s.max[v] == -INFINITY ? 0.0f : exp_clamped(s.max[v] - new_max);
      f32xA sums = {};
      for (int64_t t0 = 0; t0 < KEYS; t0 += ALANES) {  // p = exp(score - max) where visible, else 0
        i32xA index;
        for (int i = 0; i < ALANES; ++i) index[i] = static_cast<int32_t>(t0 + i);
        const i32xA visible = (index >= static_cast<int32_t>(lo)) & (index < static_cast<int32_t>(hi));
        const f32xA e = exp_lanes(load_a(p + t0) - new_max);
        const f32xA kept = visible ? e : f32xA{};
        std::memcpy(p + t0, &kept, sizeof kept);
        sums += kept;
      }
      float sum = 0.0f;
      for (int i = 0; i < ALANES; ++i) sum += sums[i];
      s.sum[v] = s.sum[v] * s.rescale[v] + sum;
      s.max[v] = new_max;
    }
    accumulate_queries(vectors, s.scores.data(), s.rescale.data(), values + k0 * d, n_keys, d,
                                      s.out.data());
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int g = 0; g < group; ++g) {
      const int64_t v = (r - r0) * group + g;
      const float inv = 1.0f / s.sum[v];
      float* dst = out + (r * n_heads + kv_head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = s.out[v * d + i] * inv;
    }
}

// Attention of the chunk's `rows` positions (q rows at q with stride q_stride) over `cache`
// (start = the chunk's first position) -> out (rows, H, D), by the team.
void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache& cache, int64_t rows,
                    int n_heads, int n_kv_heads, int64_t head_dim, float* out) {
  thread_local AttentionScratch scratch;
  const int group = n_heads / n_kv_heads;
  const int64_t blocks = (rows + QUERY_ROWS - 1) / QUERY_ROWS, items = blocks * n_kv_heads;
  for (int64_t item = team.thread; item < items; item += team.size) {
    const int64_t block = item / n_kv_heads, kv_head = item % n_kv_heads;
    const int64_t r0 = block * QUERY_ROWS, r1 = std::min(rows, r0 + QUERY_ROWS);
    if (cache.kv_dtype == KV_F16)
      attention_item<uint16_t>(q, q_stride, cache, r0, r1, kv_head, group, head_dim, out, n_heads, scratch);
    else
      attention_item<float>(q, q_stride, cache, r0, r1, kv_head, group, head_dim, out, n_heads, scratch);
  }
  team.barrier();
}

}  // namespace prefill
