// Writing a step's keys and values into a sequence's KV where its cache says (abi.h's
// HLLayerCache: segment `write`), and settling a quantized cache's full-precision residual.
//
// Self-contained. Quantization is group-wise asymmetric as hybridllm.kvcache.quantize computes it
// (so a token quantized here has the codes PyTorch's path gives it): per group lo = min, hi = max,
// scale = float16((hi - lo) / qmax clamped to [smallest normal, largest] float16), zero =
// float16(lo), code = round-half-even((x - zero) / scale) clamped to [0, qmax]; 4-bit codes two
// per byte, element 2i in the low nibble.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "abi.h"
#include "common.h"

namespace hl {

constexpr float FP16_TINY = 6.103515625e-05f, FP16_MAX = 65504.0f;

inline bool four_bits(int32_t format) { return format == KV_Q4 || format == KV_Q4_CHANNEL_KEYS; }

// Quantize n values x (stride `step` between them) as one group: codes (one per value, unpacked)
// and the group's float16 scale and zero.
inline void quantize_group(const float* x, int64_t n, int64_t step, int qmax, uint8_t* codes, uint16_t& scale,
                           uint16_t& zero) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) lo = std::min(lo, x[i * step]), hi = std::max(hi, x[i * step]);
  scale = float_to_half(std::min(std::max((hi - lo) / static_cast<float>(qmax), FP16_TINY), FP16_MAX));
  zero = float_to_half(std::min(std::max(lo, -FP16_MAX), FP16_MAX));
  const float s = half_to_float(scale), z = half_to_float(zero);
  for (int64_t i = 0; i < n; ++i) {
    const float code = std::nearbyint((x[i * step] - z) / s);
    codes[i] = static_cast<uint8_t>(std::min(std::max(code, 0.0f), static_cast<float>(qmax)));
  }
}

// Store d codes (unpacked) as a row of a quantized segment.
inline void put_codes(uint8_t* row, const uint8_t* codes, int64_t d, bool four) {
  if (!four) {
    std::memcpy(row, codes, d);
    return;
  }
  for (int64_t i = 0; i < d; i += 2) row[i / 2] = static_cast<uint8_t>(codes[i] | (codes[i + 1] << 4));
}

// One head's row x (d,) of keys or values into row `row` of a per-token quantized segment.
inline void quantize_token(const HLKVSegment& seg, bool keys, int64_t head, int64_t row, const float* x, int64_t d) {
  const bool four = four_bits(seg.format);
  const int qmax = four ? 15 : 255;
  const int64_t group = seg.group, groups = d / group, row_bytes = four ? d / 2 : d;
  uint8_t codes[512];
  auto* scales = static_cast<uint16_t*>(keys ? seg.k_scale : seg.v_scale) + (head * seg.capacity + row) * groups;
  auto* zeros = static_cast<uint16_t*>(keys ? seg.k_zero : seg.v_zero) + (head * seg.capacity + row) * groups;
  for (int64_t g = 0; g < groups; ++g) quantize_group(x + g * group, group, 1, qmax, codes + g * group, scales[g], zeros[g]);
  put_codes(static_cast<uint8_t*>(keys ? seg.k : seg.v) + (head * seg.capacity + row) * row_bytes, codes, d, four);
}

// One head's row (d,) into row `row` of a dense segment (float16: rounded to nearest even).
inline void store_dense(const HLKVSegment& seg, bool keys, int64_t head, int64_t row, const float* x, int64_t d) {
  const int64_t at = (head * seg.capacity + row) * d;
  void* buffer = keys ? seg.k : seg.v;
  if (seg.format == KV_F16) {
    uint16_t* out = static_cast<uint16_t*>(buffer) + at;
    for (int64_t i = 0; i < d; ++i) out[i] = float_to_half(x[i]);
  } else {
    std::memcpy(static_cast<float*>(buffer) + at, x, d * sizeof(float));
  }
}

// The step's keys and values of the token at `position`: k, v (n_kv_heads, d) each.
inline void write_token(const HLLayerCache& cache, int64_t position, const float* k, const float* v, int64_t n_kv_heads,
                        int64_t d) {
  const HLKVSegment& seg = cache.segments[cache.write];
  const int64_t row = cache.write_row + (position - cache.start);
  for (int64_t head = 0; head < n_kv_heads; ++head) {
    if (seg.format == KV_F32 || seg.format == KV_F16) {
      store_dense(seg, true, head, row, k + head * d, d);
      store_dense(seg, false, head, row, v + head * d, d);
    } else {
      quantize_token(seg, true, head, row, k + head * d, d);
      quantize_token(seg, false, head, row, v + head * d, d);
    }
  }
}

inline float dense_value(const HLKVSegment& seg, bool keys, int64_t at) {
  return seg.format == KV_F16 ? half_to_float(static_cast<const uint16_t*>(keys ? seg.k : seg.v)[at])
                              : static_cast<const float*>(keys ? seg.k : seg.v)[at];
}

// After the layer's attention: the first `settle` rows of the dense residual (segment `write`) are
// quantized onto the packed segment (write - 1) from row settle_row (per token, or per channel in
// whole groups of tokens), and the residual's other rows move down to its row0.
inline void settle_residual(const HLLayerCache& cache, int64_t n_kv_heads, int64_t d) {
  if (cache.settle <= 0) return;
  const HLKVSegment& dense = cache.segments[cache.write];
  const HLKVSegment& packed = cache.segments[cache.write - 1];
  const bool four = four_bits(packed.format);
  const bool channel_keys = packed.format == KV_Q8_CHANNEL_KEYS || packed.format == KV_Q4_CHANNEL_KEYS;
  const int qmax = four ? 15 : 255;
  const int64_t n = cache.settle, row_bytes = four ? d / 2 : d;
  float row[512];
  for (int64_t head = 0; head < n_kv_heads; ++head) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t src = (head * dense.capacity + dense.row0 + j) * d;
      for (int64_t i = 0; i < d; ++i) row[i] = dense_value(dense, false, src + i);
      quantize_token(packed, false, head, cache.settle_row + j, row, d);
      if (!channel_keys) {
        for (int64_t i = 0; i < d; ++i) row[i] = dense_value(dense, true, src + i);
        quantize_token(packed, true, head, cache.settle_row + j, row, d);
      }
    }
    if (channel_keys) {  // whole groups of tokens: per channel, a scale and zero per group
      const int64_t group = packed.key_group;
      std::vector<float> keys(group * d);
      std::vector<uint8_t> codes(group * d);
      for (int64_t g0 = 0; g0 < n; g0 += group) {
        for (int64_t j = 0; j < group; ++j)
          for (int64_t i = 0; i < d; ++i)
            keys[j * d + i] = dense_value(dense, true, (head * dense.capacity + dense.row0 + g0 + j) * d + i);
        const int64_t token_group = (cache.settle_row + g0) / group;
        auto* scales = static_cast<uint16_t*>(packed.k_scale) + (head * (packed.capacity / group) + token_group) * d;
        auto* zeros = static_cast<uint16_t*>(packed.k_zero) + (head * (packed.capacity / group) + token_group) * d;
        for (int64_t i = 0; i < d; ++i) {
          uint8_t channel[512];
          quantize_group(keys.data() + i, group, d, qmax, channel, scales[i], zeros[i]);
          for (int64_t j = 0; j < group; ++j) codes[j * d + i] = channel[j];
        }
        for (int64_t j = 0; j < group; ++j)
          put_codes(static_cast<uint8_t*>(packed.k) + (head * packed.capacity + cache.settle_row + g0 + j) * row_bytes,
                    codes.data() + j * d, d, four);
      }
    }
    const int64_t keep = dense.tokens - n, element = dense.format == KV_F16 ? 2 : 4;
    for (void* buffer : {dense.k, dense.v}) {
      auto* base = static_cast<uint8_t*>(buffer) + (head * dense.capacity + dense.row0) * d * element;
      std::memmove(base, base + n * d * element, keep * d * element);
    }
  }
}

}  // namespace hl
