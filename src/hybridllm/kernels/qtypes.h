// The quantized weight formats as the kernels hold them: tiles of 16 rows, each type's own scales
// kept as the file stores them, and the arithmetic every kernel of every ISA applies to them.
//
// Self-contained. This header is the portable reference: the layouts, plain-C++ accessors of
// each code and scale, the packers (GGUF blocks or the engine's int4/int8 -> tiles) and the
// dequantizer; dots_reference.h computes products with these accessors, and the vector and tile
// kernels (dots_avx2.h, dots_avx512.h, dots_amx.h) must give the same bits.
//
// Layout. A matrix (N, K) is ceil(N/16) row blocks of K/SUPER tiles each (row block by row block:
// a thread reads its output rows as one sequential stream); rows past N are zeros. A tile holds
// 16 rows x SUPER inputs (32, or a 256-input super-block), its params first, then its groups of
// 32 inputs. A group's codes are unsigned, u = w + OFFSET (w the stored signed value), in 8 quads:
// quad q holds inputs 4q .. 4q+3 of the 16 rows, byte 4n + t = row n's code for input 4q + t:
// the operand of an integer dot against 4 broadcast inputs (vpdpbusd: 16 rows at once) and, the
// 8 quads together, an AMX B tile. Codes are stored as
//   4-bit nibbles: 4 chunks of 64 bytes; chunk j byte 4n + t: quad j in its low nibble, quad
//     j + 4 in its high nibble (256 bytes);
//   + 1 or 2 bit planes (5- and 6-bit codes): 64 bytes each, byte 4n + t bit q = bit 4 (plane 0)
//     or bit 5 (plane 1) of quad q's byte 4n + t;
//   8-bit codes: the 8 quads as they are (512 bytes);
//   IQ4: nibbles that index the type's table of 16 values (the code is the value + 128).
//
// The arithmetic. Per input row and group g (activations.h: digits q, q_low, dot scale ds, float
// sum s, digit sums S_a, S_b of the group's halves), per weight row:
//   D = 128 (u . q) + u . q_low - OFFSET (S_a + S_b)        exact int32: sum w . (128 q + q_low)
//   acc = fma(float(D), scale * ds, acc)
//   acc = fma(min, s, acc)                                   (types with a min)
// Q6_K's sub-blocks of 16 have a scale each: D_a and D_b (inputs 0-15, 16-31; the offset times
// S_a and S_b), acc = fma(float(D_a), scale_a * ds, acc), then the same for b. Groups in input
// order from acc = 0; FORMAT_I8_ROWS multiplies acc by the row's scale at the end; then the bias.
// The integer dots are exact, so any instruction may compute them (vpdpbusd on 512/256 bits,
// vpmaddubsw on signed magnitudes, AMX tiles); the float steps are the same operations in every
// kernel, so a row's result is the same bits on every build, alone or in any batch.

#pragma once

#include <cstdint>
#include <cstring>

#include "abi.h"
#include "common.h"

namespace hl {

// The values IQ4_NL and IQ4_XS codes index (llama.cpp's kvalues_iq4nl).
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// How a group's codes are stored.
enum class Codes { NIBBLES, NIBBLES_1PLANE, NIBBLES_2PLANES, BYTES, IQ4 };
// How a group's scale (and min) are stored.
enum class Scales {
  Q4_ENGINE,   // bf16 scale [0,32), bf16 zero [32,64): min = zero - 8 scale
  F16,         // f16 d [0,32)
  F16_MIN,     // f16 d, f16 m [32,64)
  F32,         // f32 scale [0,64)
  ROW,         // none in the tile: the row's float32 scale at the end (FORMAT_I8_ROWS)
  K_SCALE_MIN, // f16 d, f16 dmin, then u8 sc[8][16], u8 m[8][16]: scale = d sc, min = -(dmin m)
  K_HALVES,    // f16 d, then int8 sc[16][16] per 16 inputs: scale_a = d sc[2g], scale_b = d sc[2g + 1]
  K_IQ4XS,     // f16 d, then int8 (ls - 32)[8][16]: scale = d (ls - 32)
};

struct TypeLayout {
  int64_t super;        // inputs per tile
  int64_t param_bytes;  // bytes of params at the start of a tile
  int64_t group_bytes;  // bytes of codes per group of 32
  int32_t offset;       // u - w
  Codes codes;
  Scales scales;
  constexpr int64_t groups() const { return super / GROUP; }
  constexpr int64_t tile_bytes() const { return param_bytes + groups() * group_bytes; }
  constexpr bool has_min() const { return scales == Scales::Q4_ENGINE || scales == Scales::F16_MIN || scales == Scales::K_SCALE_MIN; }
  constexpr bool halves() const { return scales == Scales::K_HALVES; }
  constexpr bool wide() const { return codes == Codes::BYTES || codes == Codes::IQ4; }  // codes use all 8 bits
};

constexpr int64_t NIBBLE_BYTES = 256, PLANE_BYTES = 64, BYTE_CODES = 512;

// The layouts, indexed by WeightFormat (float formats: super 0).
constexpr TypeLayout layout_of(int32_t format) {
  switch (format) {
    case FORMAT_Q4: return {32, 64, NIBBLE_BYTES, 0, Codes::NIBBLES, Scales::Q4_ENGINE};
    case FORMAT_I8_ROWS: return {32, 0, BYTE_CODES, 128, Codes::BYTES, Scales::ROW};
    case FORMAT_I8_GROUPS: return {32, 64, BYTE_CODES, 128, Codes::BYTES, Scales::F32};
    case FORMAT_Q4_0: return {32, 32, NIBBLE_BYTES, 8, Codes::NIBBLES, Scales::F16};
    case FORMAT_Q4_1: return {32, 64, NIBBLE_BYTES, 0, Codes::NIBBLES, Scales::F16_MIN};
    case FORMAT_Q5_0: return {32, 32, PLANE_BYTES + NIBBLE_BYTES, 16, Codes::NIBBLES_1PLANE, Scales::F16};
    case FORMAT_Q5_1: return {32, 64, PLANE_BYTES + NIBBLE_BYTES, 0, Codes::NIBBLES_1PLANE, Scales::F16_MIN};
    case FORMAT_Q8_0: return {32, 32, BYTE_CODES, 128, Codes::BYTES, Scales::F16};
    case FORMAT_Q4_K: return {256, 64 + 256, NIBBLE_BYTES, 0, Codes::NIBBLES, Scales::K_SCALE_MIN};
    case FORMAT_Q5_K: return {256, 64 + 256, PLANE_BYTES + NIBBLE_BYTES, 0, Codes::NIBBLES_1PLANE, Scales::K_SCALE_MIN};
    case FORMAT_Q6_K: return {256, 32 + 256, 2 * PLANE_BYTES + NIBBLE_BYTES, 32, Codes::NIBBLES_2PLANES, Scales::K_HALVES};
    case FORMAT_IQ4_NL: return {32, 32, NIBBLE_BYTES, 128, Codes::IQ4, Scales::F16};
    case FORMAT_IQ4_XS: return {256, 32 + 128, NIBBLE_BYTES, 128, Codes::IQ4, Scales::K_IQ4XS};
    default: return {0, 0, 0, 0, Codes::NIBBLES, Scales::F16};
  }
}

constexpr bool is_tiled(int32_t format) { return layout_of(format).super != 0; }

// Where group gi's codes start in a tile.
inline const uint8_t* group_codes(const TypeLayout& t, const uint8_t* tile, int64_t gi) {
  return tile + t.param_bytes + gi * t.group_bytes;
}

// ---- scalar accessors (the reference) -------------------------------------------------------
// Row n's unsigned code u for input i (0..31) of a group's codes.
inline int32_t code_at(const TypeLayout& t, const uint8_t* codes, int64_t n, int64_t i) {
  const int64_t quad = i / 4, byte = 4 * n + i % 4;
  if (t.codes == Codes::BYTES) return codes[quad * 64 + byte];
  const uint8_t* nibbles = codes + (t.codes == Codes::NIBBLES_1PLANE ? 1 : t.codes == Codes::NIBBLES_2PLANES ? 2 : 0) *
                                       PLANE_BYTES;
  int32_t u = (nibbles[(quad % 4) * 64 + byte] >> (quad < 4 ? 0 : 4)) & 15;
  if (t.codes == Codes::IQ4) return IQ4_VALUES[u] + 128;
  if (t.codes != Codes::NIBBLES) u |= ((codes[byte] >> quad) & 1) << 4;
  if (t.codes == Codes::NIBBLES_2PLANES) u |= ((codes[PLANE_BYTES + byte] >> quad) & 1) << 5;
  return u;
}

inline float f16_at(const uint8_t* p, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * n, 2);
  return half_to_float(bits);
}

inline float bf16_at(const uint8_t* p, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * n, 2);
  return bf16_to_float(bits);
}

inline float f32_at(const uint8_t* p, int64_t n) {
  float v;
  std::memcpy(&v, p + 4 * n, 4);
  return v;
}

// Row n's scale(s) and min of group gi of a tile (scale_b: the second half's scale, halves only).
struct GroupScales {
  float scale, scale_b, min;
};

inline GroupScales scales_at(const TypeLayout& t, const uint8_t* tile, int64_t gi, int64_t n) {
  switch (t.scales) {
    case Scales::Q4_ENGINE: {
      const float scale = bf16_at(tile, n);
      return {scale, 0.0f, std::fma(-8.0f, scale, bf16_at(tile + 32, n))};
    }
    case Scales::F16: return {f16_at(tile, n), 0.0f, 0.0f};
    case Scales::F16_MIN: return {f16_at(tile, n), 0.0f, f16_at(tile + 32, n)};
    case Scales::F32: return {f32_at(tile, n), 0.0f, 0.0f};
    case Scales::ROW: return {1.0f, 0.0f, 0.0f};
    case Scales::K_SCALE_MIN: {
      const float sc = tile[64 + gi * 16 + n], m = tile[64 + 128 + gi * 16 + n];
      return {f16_at(tile, n) * sc, 0.0f, -(f16_at(tile + 32, n) * m)};
    }
    case Scales::K_HALVES: {
      const float d = f16_at(tile, n);
      const auto sc = reinterpret_cast<const int8_t*>(tile + 32);
      return {d * static_cast<float>(sc[2 * gi * 16 + n]), d * static_cast<float>(sc[(2 * gi + 1) * 16 + n]), 0.0f};
    }
    case Scales::K_IQ4XS: {
      const auto ls = reinterpret_cast<const int8_t*>(tile + 32);
      return {f16_at(tile, n) * static_cast<float>(ls[gi * 16 + n]), 0.0f, 0.0f};
    }
  }
  return {0.0f, 0.0f, 0.0f};
}

// Weight row n's value for input i (0..31) of group gi of a tile (row_scale: FORMAT_I8_ROWS).
inline float value_at(const TypeLayout& t, const uint8_t* tile, int64_t gi, int64_t n, int64_t i, float row_scale) {
  const GroupScales s = scales_at(t, tile, gi, n);
  const float w = static_cast<float>(code_at(t, group_codes(t, tile, gi), n, i) - t.offset);
  if (t.scales == Scales::ROW) return row_scale * w;
  if (t.halves()) return (i < 16 ? s.scale : s.scale_b) * w;
  return t.has_min() ? s.scale * w + s.min : s.scale * w;
}

// ---- packing --------------------------------------------------------------------------------
// Set row n's code u for input i of a group's codes (the tile zeroed beforehand; IQ4: u is the
// table index, which the nibble holds).
inline void put_code(const TypeLayout& t, uint8_t* codes, int64_t n, int64_t i, int32_t u) {
  const int64_t quad = i / 4, byte = 4 * n + i % 4;
  if (t.codes == Codes::BYTES) {
    codes[quad * 64 + byte] = static_cast<uint8_t>(u);
    return;
  }
  uint8_t* nibbles = codes + (t.codes == Codes::NIBBLES_1PLANE ? 1 : t.codes == Codes::NIBBLES_2PLANES ? 2 : 0) *
                                 PLANE_BYTES;
  nibbles[(quad % 4) * 64 + byte] |= static_cast<uint8_t>((u & 15) << (quad < 4 ? 0 : 4));
  if (t.codes == Codes::NIBBLES_1PLANE || t.codes == Codes::NIBBLES_2PLANES)
    codes[byte] |= static_cast<uint8_t>(((u >> 4) & 1) << quad);
  if (t.codes == Codes::NIBBLES_2PLANES) codes[PLANE_BYTES + byte] |= static_cast<uint8_t>(((u >> 5) & 1) << quad);
}

inline void put16(uint8_t* p, int64_t n, uint16_t bits) { std::memcpy(p + 2 * n, &bits, 2); }

inline uint16_t read16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// GGUF block sizes (bytes per block, values per block) of the types the kernels read.
struct GGUFBlock {
  int64_t bytes, values;
};

constexpr GGUFBlock gguf_block(int32_t format) {
  switch (format) {
    case FORMAT_Q4_0: return {18, 32};
    case FORMAT_Q4_1: return {20, 32};
    case FORMAT_Q5_0: return {22, 32};
    case FORMAT_Q5_1: return {24, 32};
    case FORMAT_Q8_0: return {34, 32};
    case FORMAT_Q4_K: return {144, 256};
    case FORMAT_Q5_K: return {176, 256};
    case FORMAT_Q6_K: return {210, 256};
    case FORMAT_IQ4_NL: return {18, 32};
    case FORMAT_IQ4_XS: return {136, 256};
    default: return {0, 0};
  }
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes.
inline void k_scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// One GGUF block (SUPER values of one row) into row n of a tile (zeroed beforehand).
inline void pack_gguf_block(int32_t format, const uint8_t* b, uint8_t* tile, int64_t n) {
  const TypeLayout t = layout_of(format);
  auto code = [&](int64_t value_index, int32_t u) {
    put_code(t, tile + t.param_bytes + (value_index / GROUP) * t.group_bytes, n, value_index % GROUP, u);
  };
  switch (format) {
    case FORMAT_Q4_0:
    case FORMAT_IQ4_NL:
      put16(tile, n, read16(b));
      for (int j = 0; j < 16; ++j) {  // IQ4_NL: the nibbles are the indices its codes are stored as
        code(j, b[2 + j] & 15);
        code(j + 16, b[2 + j] >> 4);
      }
      return;
    case FORMAT_Q4_1:
      put16(tile, n, read16(b));
      put16(tile + 32, n, read16(b + 2));
      for (int j = 0; j < 16; ++j) {
        code(j, b[4 + j] & 15);
        code(j + 16, b[4 + j] >> 4);
      }
      return;
    case FORMAT_Q5_0:
    case FORMAT_Q5_1: {
      const bool with_min = format == FORMAT_Q5_1;
      put16(tile, n, read16(b));
      if (with_min) put16(tile + 32, n, read16(b + 2));
      const uint8_t* qh_bytes = b + (with_min ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, qh_bytes, 4);
      const uint8_t* qs = qh_bytes + 4;
      for (int j = 0; j < 16; ++j) {
        code(j, (qs[j] & 15) | (((qh >> j) & 1) << 4));
        code(j + 16, (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
      }
      return;
    }
    case FORMAT_Q8_0:
      put16(tile, n, read16(b));
      for (int j = 0; j < 32; ++j) code(j, static_cast<uint8_t>(b[2 + j] ^ 0x80));  // q + 128
      return;
    case FORMAT_Q4_K:
    case FORMAT_Q5_K: {
      const bool five = format == FORMAT_Q5_K;
      put16(tile, n, read16(b));
      put16(tile + 32, n, read16(b + 2));
      const uint8_t* scales = b + 4;
      for (int j = 0; j < 8; ++j) k_scale_min(j, scales, tile[64 + j * 16 + n], tile[64 + 128 + j * 16 + n]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int chunk = 0; chunk < 4; ++chunk)  // 64 values: 32 low nibbles, then 32 high nibbles
        for (int l = 0; l < 32; ++l) {
          int32_t lo = qs[32 * chunk + l] & 15, hi = qs[32 * chunk + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * chunk)) & 1) << 4;
            hi |= ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
          }
          code(64 * chunk + l, lo);
          code(64 * chunk + 32 + l, hi);
        }
      return;
    }
    case FORMAT_Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto sc = reinterpret_cast<const int8_t*>(b + 192);
      put16(tile, n, read16(b + 208));
      for (int s = 0; s < 16; ++s) tile[32 + s * 16 + n] = static_cast<uint8_t>(sc[s]);
      for (int half = 0; half < 2; ++half)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* lq = ql + 64 * half;
          const uint8_t h = qh[32 * half + l];
          const int64_t base = 128 * half;
          code(base + l, (lq[l] & 15) | (((h >> 0) & 3) << 4));
          code(base + 32 + l, (lq[l + 32] & 15) | (((h >> 2) & 3) << 4));
          code(base + 64 + l, (lq[l] >> 4) | (((h >> 4) & 3) << 4));
          code(base + 96 + l, (lq[l + 32] >> 4) | (((h >> 6) & 3) << 4));
        }
      return;
    }
    case FORMAT_IQ4_XS: {
      put16(tile, n, read16(b));
      const uint16_t scales_h = read16(b + 2);
      const uint8_t* scales_l = b + 4;
      const uint8_t* qs = b + 8;
      for (int ib = 0; ib < 8; ++ib) {
        const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4);
        tile[32 + ib * 16 + n] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
        for (int j = 0; j < 16; ++j) {
          code(32 * ib + j, qs[16 * ib + j] & 15);  // table indices
          code(32 * ib + 16 + j, qs[16 * ib + j] >> 4);
        }
      }
      return;
    }
    default:
      return;
  }
}

// The bytes of the tiles of an (n, k) matrix of a tiled format.
inline int64_t tiled_bytes(int32_t format, int64_t n, int64_t k) {
  const TypeLayout t = layout_of(format);
  return (n + TILE_ROWS - 1) / TILE_ROWS * (k / t.super) * t.tile_bytes();
}

// The tile holding row `row`, super-block `s` of an (n, k) matrix.
inline uint8_t* tile_of(int32_t format, uint8_t* tiles, int64_t k, int64_t row, int64_t s) {
  const TypeLayout t = layout_of(format);
  return tiles + ((row / TILE_ROWS) * (k / t.super) + s) * t.tile_bytes();
}

}  // namespace hl
