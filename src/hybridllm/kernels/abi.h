// The C ABI of the kernels: the structs Python fills (hybridllm/kernels/abi.py mirrors them field
// for field; ABI_VERSION guards the pairing) and the enums their fields take.
//
// Self-contained. No PyTorch: every tensor arrives as a raw pointer plus its sizes.
#pragma once

#include <cstdint>

namespace hl {

constexpr int32_t ABI_VERSION = 10;

// How a KV segment stores its tokens (attention.h reads every one in place).
enum KVFormat : int32_t {
  KV_F32 = 0,
  KV_F16 = 1,              // IEEE half: read into float32 registers, float32 accumulate (no float32 copy)
  KV_Q8 = 2,               // int8 codes, keys and values per token in groups of channels: value = code * scale + zero
  KV_Q4 = 3,               // the same with 4-bit codes, two per byte (element 2i in the low nibble)
  KV_Q8_CHANNEL_KEYS = 4,  // values as KV_Q8; keys per channel in groups of `group` tokens (KIVI)
  KV_Q4_CHANNEL_KEYS = 5,
};

constexpr int MAX_KV_SEGMENTS = 3;

// How a matrix (N, K) is stored. The quantized formats are tiles of 16 rows (qtypes.h).
enum WeightFormat : int32_t {
  FORMAT_F32 = 0,        // (N, K) float32 rows
  FORMAT_Q4 = 1,         // the engine's int4: value = (q - 8) * scale + zero, bfloat16 scale and zero per group
  FORMAT_I8_ROWS = 2,    // the engine's int8 per row: value = scale[n] * q; scales (N,) float32 in HLLinear.scales
  FORMAT_I8_GROUPS = 3,  // the engine's int8 per group: value = scale * q, float32 scale per group
  FORMAT_F16 = 4,        // (N, K) IEEE half rows
  FORMAT_BF16 = 5,       // (N, K) bfloat16 rows
  FORMAT_Q4_0 = 6,       // the GGUF types, each with its own scales kept as the file holds them
  FORMAT_Q4_1 = 7,
  FORMAT_Q5_0 = 8,
  FORMAT_Q5_1 = 9,
  FORMAT_Q8_0 = 10,
  FORMAT_Q4_K = 11,
  FORMAT_Q5_K = 12,
  FORMAT_Q6_K = 13,
  FORMAT_IQ4_NL = 14,
  FORMAT_IQ4_XS = 15,
  N_FORMATS = 16,
};

enum MlpActivation : int32_t {
  ACT_SILU = 0,       // SwiGLU (Llama, Qwen, Mistral, Phi-3)
  ACT_GELU_TANH = 1,  // GeGLU with gelu's tanh approximation (Gemma)
};

}  // namespace hl

extern "C" {

// One matrix of x @ W.T (+ bias).
struct HLLinear {
  int32_t format;  // WeightFormat
  int32_t has_bias;
  int64_t out_features;
  int64_t in_features;
  const void* weight;  // rows or tiles (qtypes.h)
  const void* scales;  // FORMAT_I8_ROWS: (N,) float32; else unused
  const float* bias;   // (N,) float32 when has_bias
  int32_t activation_digits;  // tiled formats: int8 digits per input value, 2 (exact) or 1 (activations.h)
};

// One product whose output is several matrices' outputs side by side (q, k, v; gate, up): the
// parts may have different formats (a Q6_K v beside Q4_K q and k).
struct HLProjection {
  HLLinear parts[3];
  int32_t n_parts;
};

// One decoder layer, as every supported family builds it:
//   Llama block: h = x + o(attn(norm(x))),  out = h + mlp(mlp_norm(h))
//   Gemma block: h = x + post_attn_norm(o(attn(norm(x)))),  out = h + post_mlp_norm(mlp(mlp_norm(h)))
// attn: q/k optionally normed per head (q_norm/k_norm), the first rotary_dim dimensions of each
// head rotated with cos/sin table `rope_table`, scores scaled by attn_scale and optionally
// soft-capped; mlp: act(gate) * up, then down.
struct HLDecoderLayer {
  HLProjection qkv;      // (H + 2 Hkv) * D outputs: q heads, then k heads, then v heads
  HLLinear o;            // H * D -> hidden
  HLProjection gate_up;  // 2 * intermediate outputs: gate, then up
  HLLinear down;         // intermediate -> hidden
  const float* attn_norm;       // (hidden,)
  const float* mlp_norm;        // (hidden,)
  const float* post_attn_norm;  // (hidden,) or null (Llama block)
  const float* post_mlp_norm;   // (hidden,) or null
  const float* q_norm;          // (head_dim,) or null
  const float* k_norm;          // (head_dim,) or null
  float eps;
  float attn_scale;    // scores = q . k * attn_scale
  float attn_softcap;  // scores = cap * tanh(scores / cap) when > 0
  int32_t activation;  // MlpActivation
  int32_t n_heads;
  int32_t n_kv_heads;
  int32_t head_dim;
  int32_t rotary_dim;  // <= head_dim: the first rotary_dim dimensions of each head rotate
  int32_t rope_table;  // which of the step's cos/sin tables (each rotary_dim wide) this layer reads
  int32_t n_rope_tables;
  int64_t hidden;
  int64_t intermediate;
};

// A run of one sequence's tokens in one layer's KV, as one store holds them: positions
// position .. position + tokens - 1 at buffer rows row0 .. row0 + tokens - 1 of every KV head.
// Dense formats: k, v (Hkv, capacity, D). Quantized: codes k, v (Hkv, capacity, D bytes, or D / 2
// for 4 bits); float16 scales and zeros per token (Hkv, capacity, D / group) for values and
// per-token keys, per channel (Hkv, capacity / key_group, D) for channel keys.
struct HLKVSegment {
  int32_t format;     // KVFormat
  int32_t group;      // channels per scale: values, and keys per token
  int32_t key_group;  // tokens per scale: keys per channel
  int32_t reserved;
  int64_t position;
  int64_t tokens;
  int64_t row0;
  int64_t capacity;  // rows per KV head in the buffers
  void* k;
  void* v;
  void* k_scale;
  void* k_zero;
  void* v_scale;
  void* v_zero;
};

// One layer's KV of one sequence for one step: up to three segments in position order holding
// positions 0 .. start + n - 1 (n: the step's tokens of the sequence; older ones may be left out
// when a sliding window hides them), the step's first position, and where its rows are written:
// segment `write` (dense or per-token quantized) at row write_row on. A sliding window attends
// the newest `window` keys of a position, its own included (0: all of them). `settle` > 0 (a
// quantized cache's full-precision residual): after the layer's attention the first `settle`
// rows of segment `write` are quantized onto segment write - 1 at row settle_row, and the rest of
// segment `write` moves down to its row0.
struct HLLayerCache {
  HLKVSegment segments[hl::MAX_KV_SEGMENTS];
  int32_t n_segments;
  int32_t write;
  int64_t write_row;
  int64_t start;
  int32_t window;
  int32_t settle;
  int64_t settle_row;
  // The first key position the token at `position` attends.
  int64_t first_visible(int64_t position) const {
    return window > 0 && position + 1 > window ? position + 1 - window : 0;
  }
};

}  // extern "C"
