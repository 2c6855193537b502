// Native CPU kernels for the steps of a Llama-family model (every family in
// hybridllm.config.ARCHITECTURES): decode rows (one token for each of several sequences),
// prefill chunks of one or more sequences, and their products, the translation unit the build
// compiles (hybridllm.kernels.build: -O3 -march=native -fopenmp-simd -pthread) and Python calls
// through ctypes (hybridllm.kernels.abi declares these functions; abi.h's structs).
//
// The headers beside this file, each self-contained (tests/test_kernel_headers.py compiles each
// alone), one concern each:
//   common.h          ISA macros, vectors, exp/tanh, 16-bit floats, phase timers
//   abi.h             the C structs and enums Python fills
//   thread_team.h     the persistent thread team (spin-then-sleep barriers, claimed items)
//   activations.h     input rows as two int8 digits per value (the integer dots' operands)
//   qtypes.h          every quantized weight format's tiles, packers and scalar accessors
//   dots_reference.h  the portable reference product of the quantized formats
//   dots_avx2.h, dots_avx512.h, dots_amx.h   the same products per instruction set (same bits)
//   dots_float.h      float32 / float16 / bfloat16 weights
//   linear.h          x @ W.T by a team, the kernel picked per build and row count
//   attention.h       attention of decode rows and prefill chunks over any KV store, one arithmetic per row
//                     (its two team entry points are defined in attention.cpp, the build's other
//                     translation unit, compiled beside this one)
//   kv_store.h        writing a step's KV rows (dense or quantized), settling a quantized residual
//   layer.h           one decoder layer of any family, the head; the step's workspace
//
// Batch-invariant and chunk-invariant: a row's products are the same bits alone, in any batch,
// in a prefill chunk of any length, on any number of threads (linear.h). Nothing is ever stored
// dequantized: every weight is read in place, in its file's own format.

#include <cstdint>
#include <vector>

#include "abi.h"
#include "activations.h"
#include "attention.h"
#include "common.h"
#include "dots_reference.h"
#include "kv_store.h"
#include "layer.h"
#include "linear.h"
#include "qtypes.h"
#include "thread_team.h"

using namespace hl;

// Only these entry points are exported (the build hides every other symbol): two builds loaded in
// one process (the tests load the native, AVX2 and portable ones) then keep their own thread pool
// and workspace, whose function-local statics would otherwise be bound process-wide (GNU unique
// symbols) to whichever build was loaded first.
#pragma GCC visibility push(default)
extern "C" {

int32_t hl_abi_version() { return ABI_VERSION; }

// The instruction set the quantized dot products were compiled for (what -march gave).
const char* hl_kernel_isa() {
#if HL_AVX512_VNNI
  return "avx512-vnni";
#elif HL_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  return "avx2-vnni";
#elif HL_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

// ---- weights --------------------------------------------------------------------------------
// Bytes of the tiles of an (n, k) matrix of a tiled format (0 for float formats).
int64_t hl_tiled_bytes(int32_t format, int64_t n, int64_t k) {
  return is_tiled(format) && k % layout_of(format).super == 0 ? tiled_bytes(format, n, k) : 0;
}

// GGUF rows (n rows of k values, each k / values-per-block blocks) -> tiles (hl_tiled_bytes
// bytes at dst), by a team over the row blocks. Returns 0, or -1 for a format or k it cannot pack.
int32_t hl_pack_gguf(int32_t format, const uint8_t* src, int64_t n, int64_t k, uint8_t* dst, int32_t n_threads) {
  const GGUFBlock block = gguf_block(format);
  if (block.values == 0 || k % block.values != 0) return -1;
  const TypeLayout t = layout_of(format);
  const int64_t row_bytes = k / block.values * block.bytes, n_tiles = k / t.super;
  const int64_t row_blocks = (n + TILE_ROWS - 1) / TILE_ROWS;
  run_team(n_threads, [&](const Team& team) {
    const Share mine(row_blocks, team);
    uint8_t* out = dst + mine.first * n_tiles * t.tile_bytes();
    std::memset(out, 0, (mine.last - mine.first) * n_tiles * t.tile_bytes());
    for (int64_t rb = mine.first; rb < mine.last; ++rb)
      for (int64_t r = 0; r < TILE_ROWS && rb * TILE_ROWS + r < n; ++r) {
        const uint8_t* row = src + (rb * TILE_ROWS + r) * row_bytes;
        for (int64_t s = 0; s < n_tiles; ++s)
          pack_gguf_block(format, row + s * block.bytes, dst + (rb * n_tiles + s) * t.tile_bytes(), r);
      }
  });
  return 0;
}

// The engine's int8 matrices -> tiles: FORMAT_I8_ROWS codes (n, k); FORMAT_I8_GROUPS codes
// (k/32, n, 32) with scales (k/32, n) float32 (its row scales stay in HLLinear.scales).
int32_t hl_pack_int8(int32_t format, const int8_t* codes, const float* scales, int64_t n, int64_t k, uint8_t* dst) {
  if ((format != FORMAT_I8_ROWS && format != FORMAT_I8_GROUPS) || k % GROUP != 0) return -1;
  const TypeLayout t = layout_of(format);
  const int64_t groups = k / GROUP;
  std::memset(dst, 0, tiled_bytes(format, n, k));
  for (int64_t row = 0; row < n; ++row)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* tile = tile_of(format, dst, k, row, g);
      const int64_t r = row % TILE_ROWS;
      const int8_t* group = format == FORMAT_I8_ROWS ? codes + row * k + g * GROUP : codes + (g * n + row) * GROUP;
      if (format == FORMAT_I8_GROUPS) std::memcpy(tile + 4 * r, scales + g * n + row, 4);
      for (int64_t i = 0; i < GROUP; ++i) put_code(t, tile + t.param_bytes, r, i, static_cast<uint8_t>(group[i] ^ 0x80));
    }
  return 0;
}

// Rows `rows[i]` of a matrix as float32 values -> out (n, K): embedding lookups in the head's own
// tiles (one copy of a tied table), and the tests' dequantized reference.
void hl_dequantize_rows(const HLLinear* w, const int64_t* rows, int64_t n, float* out) {
  const int64_t k = w->in_features;
  for (int64_t i = 0; i < n; ++i) {
    float* o = out + i * k;
    const int64_t row = rows[i];
    switch (w->format) {
      case FORMAT_F32:
        std::memcpy(o, static_cast<const float*>(w->weight) + row * k, k * sizeof(float));
        break;
      case FORMAT_F16:
        for (int64_t j = 0; j < k; ++j) o[j] = to_float(static_cast<const Half*>(w->weight)[row * k + j]);
        break;
      case FORMAT_BF16:
        for (int64_t j = 0; j < k; ++j) o[j] = to_float(static_cast<const BFloat16*>(w->weight)[row * k + j]);
        break;
      default: {
        const TypeLayout t = layout_of(w->format);
        const float row_scale = w->scales != nullptr ? static_cast<const float*>(w->scales)[row] : 1.0f;
        auto* tiles = const_cast<uint8_t*>(static_cast<const uint8_t*>(w->weight));
        for (int64_t s = 0; s < k / t.super; ++s) {
          const uint8_t* tile = tile_of(w->format, tiles, k, row, s);
          for (int64_t gi = 0; gi < t.groups(); ++gi)
            for (int64_t j = 0; j < GROUP; ++j)
              o[s * t.super + gi * GROUP + j] = value_at(t, tile, gi, row % TILE_ROWS, j, row_scale);
        }
      }
    }
  }
}

// ---- products ---------------------------------------------------------------------------------
// out = x @ W.T (+ bias) for rows x (rows, in_features) -> out (rows, out_features): the product
// every step runs (one arithmetic per row whatever the row count).
void hl_linear(const HLLinear* w, const float* x, float* out, int64_t rows, int32_t n_threads) {
  InputRows& shared = shared_workspace().inputs;  // one team runs at a time (the pool's lock)
  run_team(n_threads, [&](const Team& team) { linear_team(team, *w, x, out, rows, &shared); });
}

// The same through the portable reference kernel, one thread (tests compare every kernel with it).
void hl_reference_linear(const HLLinear* w, const float* x, float* out, int64_t rows) {
  if (!is_tiled(w->format)) return hl_linear(w, x, out, rows, 1);
  InputRows acts;
  acts.prepare(x, rows, w->in_features, DigitLayout::ROWS, w->activation_digits);
  const TypeLayout t = layout_of(w->format);
  const int64_t n_tiles = w->in_features / t.super;
  const auto* row_scales = static_cast<const float*>(w->scales);
  for (int64_t n = 0; n < w->out_features; n += TILE_ROWS)
    tiled_rows_reference(t, static_cast<const uint8_t*>(w->weight) + (n / TILE_ROWS) * n_tiles * t.tile_bytes(),
                         n_tiles, acts, 0, rows, out + n, w->out_features,
                         static_cast<int>(std::min(TILE_ROWS, w->out_features - n)),
                         row_scales == nullptr ? nullptr : row_scales + n);
  if (w->has_bias)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = 0; n < w->out_features; ++n) out[m * w->out_features + n] += w->bias[n];
}

// Whether products of many rows run on AMX tiles: built for them, granted by the OS, and on.
int32_t hl_amx() { return amx_usable(); }

// Turn the AMX tiles on (1) or off (0; the vector kernels give the same results); returns hl_amx().
int32_t hl_set_amx(int32_t on) {
#if HL_AMX
  amx::enabled.store(on != 0);
#else
  (void)on;
#endif
  return hl_amx();
}

// Turn the panels of the AVX-512 VNNI builds on (1) or off (0; the row kernels give the same
// results); returns whether products of many rows take them (built for them and on).
int32_t hl_set_panels(int32_t on) {
  panels_enabled.store(on != 0);
  return panels_usable();
}

// ---- attention ------------------------------------------------------------------------------
// A dense (Hkv, capacity, D) cache of float32 or float16 (KVFormat) as one segment.
static HLLayerCache dense_cache(const void* k_cache, const void* v_cache, int32_t kv_format, int64_t capacity,
                                int64_t tokens, int64_t start, int32_t window) {
  HLLayerCache cache{};
  cache.segments[0] = HLKVSegment{kv_format, 0, 0, 0, 0, tokens, 0, capacity, const_cast<void*>(k_cache),
                                  const_cast<void*>(v_cache), nullptr, nullptr, nullptr, nullptr};
  cache.n_segments = 1;
  cache.write_row = start;
  cache.start = start;
  cache.window = window;
  return cache;
}

// Attention of q (H, D) over a (Hkv, capacity, D) cache's first `total` tokens (float32 or
// float16: KVFormat), scores q . k / sqrt(D) -> out (H, D).
void hl_attention(const float* q, const void* k_cache, const void* v_cache, int32_t kv_format, int64_t capacity,
                  int64_t total, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float* out, int32_t n_threads) {
  const HLLayerCache cache = dense_cache(k_cache, v_cache, kv_format, capacity, total, total - 1, 0);
  const ScoreOptions options{1.0f / std::sqrt(static_cast<float>(head_dim)), 0.0f};
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    thread_local BlockScratch scratch;
    attention_team(team, q, 0, &cache, 1, n_heads, n_kv_heads, head_dim, options, out, ws.parts, scratch);
  });
}

// Causal attention of a prefill chunk: q (rows, H, D) at positions start .. start + rows - 1
// over a (Hkv, capacity, D) cache whose rows 0 .. start + rows - 1 are written (float32 or
// float16: KVFormat), with a sliding window (0: none) -> out (rows, H, D).
void hl_prefill_attention(const float* q, const void* k_cache, const void* v_cache, int32_t kv_format, int64_t capacity,
                          int64_t start, int64_t rows, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                          int32_t window, float* out, int32_t n_threads) {
  const HLLayerCache cache = dense_cache(k_cache, v_cache, kv_format, capacity, start + rows, start, window);
  const int64_t offsets[2] = {0, rows};
  const ScoreOptions options{1.0f / std::sqrt(static_cast<float>(head_dim)), 0.0f};
  run_team(n_threads, [&](const Team& team) {
    thread_local BlockScratch scratch;
    prefill_attention_team(team, q, int64_t{n_heads} * head_dim, &cache, offsets, 1, n_heads, n_kv_heads, head_dim,
                           options, out, scratch);
  });
}

// Partial attention of `rows` query rows q (rows, H, D) over every key of one KV segment (a tiered
// cache's cold pages in host RAM, read in place in their format, positions relabelled 0 ..
// tokens - 1: every query sees them all) with scores scale * q . k, soft-capped where softcap > 0
// -> out (rows, H, D) normalized, lse (rows, H) the log-sum-exp of each row's scores (the caller
// merges it with the device's part). segment->tokens must be > 0.
void hl_partial_attention(const float* q, int64_t rows, const HLKVSegment* segment, int32_t n_heads,
                          int32_t n_kv_heads, int32_t head_dim, float scale, float softcap, float* out, float* lse,
                          int32_t n_threads) {
  HLLayerCache cache{};
  cache.segments[0] = *segment;
  cache.segments[0].position = 0;
  cache.n_segments = 1;
  cache.start = segment->tokens - 1;  // a query after every key
  cache.write_row = 0;
  cache.window = 0;
  const std::vector<HLLayerCache> caches(rows, cache);
  const ScoreOptions options{scale, softcap};
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    thread_local BlockScratch scratch;
    attention_team(team, q, int64_t{n_heads} * head_dim, caches.data(), rows, n_heads, n_kv_heads, head_dim, options,
                   out, ws.parts, scratch, lse);
  });
}

// ---- layers and whole steps -------------------------------------------------------------------
// One decoder layer for one token of each of `rows` sequences (layer.h); caches: (rows,), the
// layer's cache of each row; cos/sin (rows, n_rope_tables * rotary_dim).
void hl_decode_layer(const HLDecoderLayer* layer, const float* x_in, float* x_out, const HLLayerCache* caches,
                     int64_t rows, const float* cos, const float* sin, int32_t n_threads) {
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_tokens(*layer, rows);
    team.barrier();
    thread_local BlockScratch scratch;
    decoder_layer_team(team, *layer, x_in, x_out, caches, rows, cos, sin, ws, scratch);
  });
}

// A whole decode step after the embedding for `rows` sequences, in one team: every layer in
// order, the final norm and the head (logits soft-capped where final_softcap > 0). caches:
// (n_layers, rows), layer-major; x (rows, hidden) is overwritten; cos/sin (rows, tables x R);
// logits (rows, N).
void hl_decode_model(const HLDecoderLayer* layers, const HLLayerCache* caches, int64_t n_layers, int64_t rows,
                     float* x, const float* cos, const float* sin, const float* final_norm, float eps,
                     const HLLinear* head, float final_softcap, float* logits, int32_t n_threads) {
  Workspace& ws = shared_workspace();
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_tokens(layers[0], rows);  // every layer of a model has the same shapes
    team.barrier();
    thread_local BlockScratch scratch;
    for (int64_t i = 0; i < n_layers; ++i)
      decoder_layer_team(team, layers[i], x, x, caches + i * rows, rows, cos, sin, ws, scratch);
    head_team(team, x, layers[0].hidden, nullptr, rows, final_norm, eps, *head, final_softcap, logits, ws);
  });
}

// Prefill chunks of one or more sequences after the embedding, in one team: segment s is rows
// offsets[s] .. offsets[s + 1] - 1 of x, consecutive positions of one sequence; every layer in
// order, then the final norm and the head for every row (all_logits) or for each segment's last
// row. caches: (n_layers, segments), layer-major, each the layer's cache of the segment's sequence
// with start = the segment's first position (its rows are written); x (rows, hidden) is
// overwritten; cos/sin (rows, tables x R) of each row's position; logits (rows or segments, N).
void hl_prefill_model(const HLDecoderLayer* layers, const HLLayerCache* caches, int64_t n_layers, int64_t segments,
                      const int64_t* offsets, float* x, const float* cos, const float* sin, const float* final_norm,
                      float eps, const HLLinear* head, float final_softcap, float* logits, int32_t all_logits,
                      int32_t n_threads) {
  Workspace& ws = shared_workspace();
  const int64_t rows = offsets[segments];
  run_team(n_threads, [&](const Team& team) {
    if (team.thread == 0) ws.for_segments(layers[0], segments, offsets);
    team.barrier();
    thread_local BlockScratch scratch;
    for (int64_t i = 0; i < n_layers; ++i)
      decoder_layer_team(team, layers[i], x, x, caches + i * segments, rows, cos, sin, ws, scratch);
    std::vector<int64_t> last(segments);  // each segment's last row
    for (int64_t s = 0; s < segments; ++s) last[s] = offsets[s + 1] - 1;
    head_team(team, x, layers[0].hidden, all_logits ? nullptr : last.data(), all_logits ? rows : segments, final_norm,
              eps, *head, final_softcap, logits, ws);
  });
}

// ---- threads ----------------------------------------------------------------------------------
// How long a waiting thread spins (in pause instructions) before it sleeps; 0: sleep at once.
void hl_set_spin_wait(int32_t spins) { pool().set_spins(spins); }

int32_t hl_spin_wait() { return pool().spins(); }

#ifdef HL_PROFILE
// Seconds per phase (the Phase order) accumulated since the library was loaded or reset.
double* hl_phase_seconds() { return phase_seconds; }
#endif

}  // extern "C"
#pragma GCC visibility pop
