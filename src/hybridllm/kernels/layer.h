// One decoder layer of every supported family for the rows of a step, by the team: decode rows
// (one token of each of several sequences) or prefill segments (consecutive positions of one or
// more sequences).
//
// Self-contained. What a family adds is data in HLDecoderLayer (abi.h): q/k norms, partial rotary
// and the layer's rotary table, the score scale and soft-cap, GeGLU, the Gemma block's norms
// around attention and the MLP; the code is the same for every family.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "abi.h"
#include "activations.h"
#include "attention.h"
#include "common.h"
#include "kv_store.h"
#include "linear.h"
#include "thread_team.h"

namespace hl {

// ---- row-wise steps -------------------------------------------------------------------------
inline void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
  // x . x in common.h's sum_in_order order (the squares past the last whole LANES into lane 0):
  // the same bits on every build
  f32xL lanes = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const f32xL v = load<f32xL>(x + i);
    lanes = fma_lanes(v, v, lanes);
  }
  for (; i < n; ++i) lanes[0] = std::fma(x[i], x[i], lanes[0]);
  const float sum_sq = sum_in_order(lanes);
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = weight[j] * (x[j] * inv);
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
inline void silu_times(const float* __restrict gate, const float* __restrict up, float* __restrict out, int64_t n) {
  int64_t i = 0;
  for (; i + WLANES <= n; i += WLANES) {
    const f32xW g = load<f32xW>(gate + i);
    store(out + i, g / (1.0f + exp_vector(-g)) * load<f32xW>(up + i));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

// out[i] = gelu_tanh(gate[i]) * up[i], gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
inline void gelu_tanh_times(const float* __restrict gate, const float* __restrict up, float* __restrict out,
                            int64_t n) {
  constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  int64_t i = 0;
  for (; i + WLANES <= n; i += WLANES) {
    const f32xW g = load<f32xW>(gate + i);
    const f32xW inner = k * (g + 0.044715f * g * g * g);
    store(out + i, 0.5f * g * (1.0f + tanh_vector(inner)) * load<f32xW>(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + tanh_clamped(k * (g + 0.044715f * g * g * g))) * up[i];
  }
}

// Rotate the first r dimensions of one head vector in place, "rotate half" layout: cos/sin are
// (r,) tables; dimensions r .. D pass through (partial rotary).
inline void rotate_half(float* h, const float* cos, const float* sin, int64_t r) {
  const int64_t half = r / 2;
  float rotated[512];
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -h[i + half];
    rotated[i + half] = h[i];
  }
  for (int64_t i = 0; i < r; ++i) h[i] = h[i] * cos[i] + rotated[i] * sin[i];
}

// ---- the step's scratch -----------------------------------------------------------------------
// Scratch shared by a team for one step of `rows` tokens. The entry points keep one (the pool's
// lock: one team at a time) and size it under the lock (thread 0, then a barrier); its buffers
// only grow, so steps do not page-fault fresh memory.
struct Workspace {
  std::vector<float> normed, qkv, attn, proj, gate_up, mlp, h;
  AttentionParts parts;  // decode rows' attention blocks
  // Prefill: the rows are segments of consecutive positions, segment s rows offsets[s] ..
  // offsets[s + 1] - 1 of one sequence (prefill chunks of several sequences); else one token per row.
  bool prefill = false;
  int64_t segments = 0;
  const int64_t* offsets = nullptr;
  std::vector<int64_t> row_segment;  // (rows,): each prefill row's segment
  InputRows inputs;                  // the products' input rows, prepared by the team

  void resize(const HLDecoderLayer& w, int64_t rows) {
    const int64_t d = w.head_dim, q_size = w.n_heads * d, kv_size = w.n_kv_heads * d;
    grow(normed, rows * w.hidden);
    grow(qkv, rows * (q_size + 2 * kv_size));
    grow(attn, rows * q_size);
    grow(proj, rows * w.hidden);
    grow(gate_up, rows * 2 * w.intermediate);
    grow(mlp, rows * w.intermediate);
    grow(h, rows * w.hidden);
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
inline Workspace& shared_workspace() {
  static Workspace ws;
  return ws;
}

// ---- the layer ------------------------------------------------------------------------------
// One decoder layer for the `rows` rows of a step, by the team (abi.h's HLDecoderLayer says the
// block). x_in, x_out: (rows, hidden), x_in may alias x_out; cos/sin: (rows, n_rope_tables *
// rotary_dim) tables of each row's position. Row r's k and v are written at its position in its
// cache (Hkv, capacity, D): decode rows have one cache each (caches[r], at caches[r].start); with
// ws.prefill the rows are segments (caches holds one entry per segment, the layer's cache of its
// sequence with start = the segment's first position), and the attention is the chunks' causal
// kernel (attention.h: the same per-row arithmetic as decode rows). Each weight matrix is read once for all rows; each
// row's products are the same bits whatever the other rows and the team size.
inline void decoder_layer_team(const Team& team, const HLDecoderLayer& w, const float* x_in, float* x_out,
                               const HLLayerCache* caches, int64_t rows, const float* cos, const float* sin,
                               Workspace& ws, BlockScratch& scratch) {
  const int64_t hidden = w.hidden, d = w.head_dim, inter = w.intermediate, rot = w.rotary_dim;
  const int64_t q_size = w.n_heads * d, kv_size = w.n_kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const int64_t table = w.n_rope_tables * rot;  // a row's tables side by side
  const ScoreOptions scores_options{w.attn_scale, w.attn_softcap};
  const Share mine(rows, team);  // the rows this thread takes in the row-wise steps
  PHASE_END(team, BETWEEN_STEPS);
  for (int64_t r = mine.first; r < mine.last; ++r)
    rms_norm(x_in + r * hidden, w.attn_norm, w.eps, hidden, ws.normed.data() + r * hidden);
  team.barrier();
  PHASE_END(team, NORM);
  linear_team(team, w.qkv, ws.normed.data(), ws.qkv.data(), rows, &ws.inputs);
  PHASE_END(team, QKV);
  for (int64_t r = mine.first; r < mine.last; ++r) {
    float* qkv = ws.qkv.data() + r * qkv_size;
    const int64_t segment = ws.prefill ? ws.row_segment[r] : r;
    const HLLayerCache& c = caches[segment];
    const int64_t position = ws.prefill ? c.start + (r - ws.offsets[segment]) : c.start;
    for (int64_t head = 0; head < w.n_heads + w.n_kv_heads; ++head) {
      float* vector = qkv + head * d;
      const float* norm = head < w.n_heads ? w.q_norm : w.k_norm;
      if (norm != nullptr) rms_norm(vector, norm, w.eps, d, vector);
      rotate_half(vector, cos + r * table + w.rope_table * rot, sin + r * table + w.rope_table * rot, rot);
    }
    write_token(c, position, qkv + q_size, qkv + q_size + kv_size, w.n_kv_heads, d);
  }
  team.barrier();
  PHASE_END(team, ROPE_KV);
  if (ws.prefill)
    prefill_attention_team(team, ws.qkv.data(), qkv_size, caches, ws.offsets, ws.segments, w.n_heads, w.n_kv_heads,
                           d, scores_options, ws.attn.data(), scratch);
  else
    attention_team(team, ws.qkv.data(), qkv_size, caches, rows, w.n_heads, w.n_kv_heads, d, scores_options,
                   ws.attn.data(), ws.parts, scratch);
  const Share sequences(ws.prefill ? ws.segments : rows, team);  // a quantized residual's oldest tokens
  for (int64_t s = sequences.first; s < sequences.last; ++s) settle_residual(caches[s], w.n_kv_heads, d);
  team.barrier();
  PHASE_END(team, ATTENTION);
  linear_team(team, w.o, ws.attn.data(), ws.proj.data(), rows, &ws.inputs);
  PHASE_END(team, O_PROJ);
  for (int64_t r = mine.first; r < mine.last; ++r) {
    float* proj = ws.proj.data() + r * hidden;
    if (w.post_attn_norm != nullptr) rms_norm(proj, w.post_attn_norm, w.eps, hidden, proj);
    float* h = ws.h.data() + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) h[i] = x_in[r * hidden + i] + proj[i];
    rms_norm(h, w.mlp_norm, w.eps, hidden, ws.normed.data() + r * hidden);
  }
  team.barrier();
  PHASE_END(team, RESIDUAL_NORM);
  linear_team(team, w.gate_up, ws.normed.data(), ws.gate_up.data(), rows, &ws.inputs);
  PHASE_END(team, GATE_UP);
  for (int64_t r = mine.first; r < mine.last; ++r) {  // row r's (gate, up) -> act(gate) * up, as (rows, inter)
    const float* gate = ws.gate_up.data() + r * 2 * inter;
    if (w.activation == ACT_GELU_TANH)
      gelu_tanh_times(gate, gate + inter, ws.mlp.data() + r * inter, inter);
    else
      silu_times(gate, gate + inter, ws.mlp.data() + r * inter, inter);
  }
  team.barrier();
  PHASE_END(team, SILU);
  linear_team(team, w.down, ws.mlp.data(), ws.proj.data(), rows, &ws.inputs);
  PHASE_END(team, DOWN);
  for (int64_t r = mine.first; r < mine.last; ++r) {
    float* proj = ws.proj.data() + r * hidden;
    if (w.post_mlp_norm != nullptr) rms_norm(proj, w.post_mlp_norm, w.eps, hidden, proj);
    for (int64_t i = 0; i < hidden; ++i) x_out[r * hidden + i] = ws.h[r * hidden + i] + proj[i];
  }
  team.barrier();
  PHASE_END(team, RESIDUAL);
}

// The final norm and the head of the rows `rows_of` picks (logits (n_rows, N), soft-capped where
// softcap > 0), by the team.
inline void head_team(const Team& team, const float* x, int64_t hidden, const int64_t* picked, int64_t n_rows,
                      const float* final_norm, float eps, const HLLinear& head, float softcap, float* logits,
                      Workspace& ws) {
  const Share mine(n_rows, team);
  for (int64_t r = mine.first; r < mine.last; ++r)
    rms_norm(x + (picked == nullptr ? r : picked[r]) * hidden, final_norm, eps, hidden, ws.normed.data() + r * hidden);
  team.barrier();
  PHASE_END(team, FINAL_NORM);
  linear_team(team, head, ws.normed.data(), logits, n_rows, &ws.inputs);
  if (softcap > 0.0f) {
    const int64_t n = head.out_features;
    for (int64_t r = mine.first; r < mine.last; ++r) softcap_scores(logits + r * n, n, softcap);
    team.barrier();
  }
  PHASE_END(team, HEAD);
}

}  // namespace hl
