// The input rows of a product as the quantized-weight kernels read them.
//
// Self-contained. Each row x (K,) becomes, per group g of 32 values:
//   x ~= dot_scales[g] * (128 q + q_low),   dot_scales[g] = scale / 128,
// q = round(x / scale) with scale = max|x_g| / 127, and q_low the rounded remainder in 1/128
// steps (|q_low| <= 64): two int8 digits carry ~15 bits of each activation (one int8 digit alone,
// as llama.cpp uses, moves a model's logits ~20x more than bfloat16). Also per group: the float
// sum of x (the min terms of asymmetric weights) and the integer sums of the digits over each
// half of the group, 128 sum(q) + sum(q_low) (the offsets of weights stored as unsigned codes).
// Every kernel computes the same exact integer dots from these (qtypes.h), on any CPU.
//
// With one digit (`--activations int8`) q_low is 0 and x ~= scale q per group, as llama.cpp's
// Q8_0 activations (finer than its Q8_K's scale per 256); the group's sum is then the sum of those
// values, scale sum(q), so the min terms of asymmetric weights see the same rounded inputs as the
// dots (with the exact sum the rounding meets the codes' offset, not the weights: ~4x the KL).
// The kernels skip the zero low digits' dots: half the integer work.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace hl {

// Input rows are stored in blocks of TILE_M (the rows of one AMX tile); rows past M are zeros
// (their dots are 0, their scales and sums 0).
constexpr int64_t TILE_M = 16;

// int8 digits per input value: two (~15 bits, the default) or one (abi.h HLLinear.activation_digits).
constexpr int32_t EXACT_DIGITS = 2;

// One prepared input row.
struct InputRow {
  const float* x;           // (K,)
  const float* sums;        // (K/32,): float sum of each group
  const float* dot_scales;  // (K/32,): what a group's integer dots are multiplied by
  const int8_t* digits;     // group 0's q then q_low (2 x 32), the next group group_stride bytes on
  const int32_t* digit_sums;  // (K/32, 2): per half group (inputs 0-15, 16-31), 128 sum(q) + sum(q_low)
  int64_t group_stride;     // 2 x 32 (rows one after another), or 16 x 2 x 32 (tile blocks)
  const int8_t* high(int64_t g) const { return digits + g * group_stride; }
  const int8_t* low(int64_t g) const { return digits + g * group_stride + GROUP; }
};

// Bytes of one group's two digits of one row.
constexpr int64_t DIGIT_BYTES = 2 * GROUP;

// How the digits lie. ROWS: a row's groups one after another (q then q_low per group). TILES
// (the AMX kernels): per block of TILE_M rows and group, the 16 rows' 64 bytes one after another
// (an A operand each digit). QUADS (the panel kernels, dots_panels.h): per block and group,
// [digit][quad][row] of 4 bytes each, so that a quad's 4 inputs of the block's 16 rows are one
// 64-byte vector (the rows in a register's lanes); its rows are read only that way, never through
// row(). TILES and QUADS also keep each block's per-group figures side by side (tile_params).
enum class DigitLayout { ROWS, TILES, QUADS };

// The prepared rows of one product's input (M, K). A thread prepares its own copy (decode: a
// few rows, no barrier), or a team shares one (many rows): `reset` once, then `fill` by row
// ranges of whole TILE_M blocks, then a barrier. The layout (DigitLayout) says how the digits lie
// for the kernels that read them; with TILES or QUADS each block of TILE_M rows also gets its
// per-group figures side by side (tile_params).
class InputRows {
 public:
  // Size the buffers for x (rows, k) and zero the padding rows.
  void reset(const float* x, int64_t rows, int64_t k, DigitLayout layout = DigitLayout::ROWS,
             int32_t digits = EXACT_DIGITS) {
    x_ = x;
    one_digit_ = digits == 1;
    rows_ = rows;
    padded_ = (rows + TILE_M - 1) / TILE_M * TILE_M;
    k_ = k;
    groups_ = k / GROUP;
    layout_ = layout;
    sums_.resize(padded_ * groups_);
    dot_scales_.resize(padded_ * groups_);
    digit_sums_.resize(padded_ * groups_ * 2);
    digits_.resize(padded_ * 2 * groups_ * GROUP);
    std::fill(sums_.begin() + rows * groups_, sums_.end(), 0.0f);
    std::fill(dot_scales_.begin() + rows * groups_, dot_scales_.end(), 0.0f);
    std::fill(digit_sums_.begin() + rows * groups_ * 2, digit_sums_.end(), 0);
    if (layout == DigitLayout::QUADS) {  // a padding row's bytes are spread: zero its block's groups whole
      if (rows < padded_)
        for (int64_t g = 0; g < groups_; ++g)
          std::memset(digits_.data() + digit_offset(rows, g), 0, TILE_M * DIGIT_BYTES);
    } else {
      for (int64_t r = rows; r < padded_; ++r)
        for (int64_t g = 0; g < groups_; ++g) std::memset(digits_.data() + digit_offset(r, g), 0, DIGIT_BYTES);
    }
    tile_params_.resize(layout != DigitLayout::ROWS ? padded_ * groups_ * TILE_PARAMS : 0);
  }

  // Prepare rows [r0, r1) (r0 a multiple of TILE_M; r1 one too, or the last row), and the tile
  // figures of the blocks they cover.
  void fill(int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups_; ++g) prepare_group(r, g);
    if (layout_ != DigitLayout::ROWS)
      for (int64_t block = r0 / TILE_M; block < (r1 + TILE_M - 1) / TILE_M; ++block) fill_tile_params(block);
  }

  void prepare(const float* x, int64_t rows, int64_t k, DigitLayout layout = DigitLayout::ROWS,
               int32_t digits = EXACT_DIGITS) {
    reset(x, rows, k, layout, digits);
    fill(0, rows);
  }

  int64_t rows() const { return rows_; }
  bool one_digit() const { return one_digit_; }  // the low digits are all 0
  int64_t padded_rows() const { return padded_; }
  int64_t groups() const { return groups_; }
  DigitLayout layout() const { return layout_; }
  // Row i as the row kernels read it (ROWS or TILES layouts).
  InputRow row(int64_t i) const {
    return {x_ + i * k_, sums_.data() + i * groups_, dot_scales_.data() + i * groups_,
            digits_.data() + digit_offset(i, 0), digit_sums_.data() + i * groups_ * 2,
            layout_ == DigitLayout::TILES ? TILE_M * DIGIT_BYTES : DIGIT_BYTES};
  }
  // With TILES, the digits of rows [16 block, 16 block + 16) as (K/32, 16, 2, 32): a group's
  // high (or low) digits of the 16 rows are one AMX A operand, 16 rows x 32 bytes, a row every
  // 64 bytes (one kilobyte read in order, where rows 2K bytes apart made each load touch 16 far lines).
  const int8_t* tile_digits(int64_t block) const { return digits_.data() + block * groups_ * TILE_M * DIGIT_BYTES; }

  // With QUADS, the digits of rows [16 block, 16 block + 16), group g: (2, 8, 16, 4) bytes, digit
  // (q, q_low) by quad (inputs 4i .. 4i + 3) by row.
  const int8_t* quad_digits(int64_t block, int64_t g) const {
    return digits_.data() + block_group(block, g) * TILE_M * DIGIT_BYTES;
  }

  // Rows [16 block, 16 block + 16), group g: 16 dot scales, 16 float sums, then 16 + 16 digit
  // sums (halves a and b) as int32 bits (TILE_PARAMS values of 4 bytes).
  static constexpr int64_t TILE_PARAMS = 4 * TILE_M;
  const float* tile_params(int64_t block, int64_t g) const {
    return tile_params_.data() + block_group(block, g) * TILE_PARAMS;
  }

 private:
  void prepare_group(int64_t r, int64_t g) {
    const float* xg = x_ + r * k_ + g * GROUP;
    const int64_t at = r * groups_ + g;
    f32xL lanes = {};  // the sum in common.h's sum_in_order order: the same bits on every build
    for (int j = 0; j < GROUP; j += LANES) lanes += load<f32xL>(xg + j);
    float amax = 0.0f;  // (a maximum is exact in any order)
#pragma omp simd reduction(max : amax)
    for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xg[j]));
    sums_[at] = sum_in_order(lanes);
    const float scale = amax / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    dot_scales_[at] = scale / 128.0f;
    alignas(64) int8_t quads[DIGIT_BYTES];  // QUADS: the row's digits here first, then in place
    int8_t* q = layout_ == DigitLayout::QUADS ? quads : digits_.data() + digit_offset(r, g);
    int8_t* q_low = q + GROUP;
    // (two plain loops through int32: GCC vectorizes them, where one loop with the digit count's
    // test and float -> int8 casts ran one value at a time, ~4% of a Qwen3 prefill)
    if (one_digit()) {
#pragma omp simd
      for (int j = 0; j < GROUP; ++j) {
        q[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(xg[j] * inverse)));
        q_low[j] = 0;
      }
    } else {
#pragma omp simd
      for (int j = 0; j < GROUP; ++j) {
        const float scaled = xg[j] * inverse;
        const float high = std::nearbyint(scaled);
        q[j] = static_cast<int8_t>(static_cast<int32_t>(high));
        q_low[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint((scaled - high) * 128.0f)));
      }
    }
    for (int half = 0; half < 2; ++half) {
      int32_t high_sum = 0, low_sum = 0;
      for (int j = 16 * half; j < 16 * half + 16; ++j) {
        high_sum += q[j];
        low_sum += q_low[j];
      }
      digit_sums_[at * 2 + half] = 128 * high_sum + low_sum;
    }
    if (one_digit())  // the sum of the rounded values (see the top of this file)
      sums_[at] = dot_scales_[at] * static_cast<float>(digit_sums_[at * 2] + digit_sums_[at * 2 + 1]);
    if (layout_ == DigitLayout::QUADS) {
      int8_t* block = digits_.data() + digit_offset(r, g);  // (2, 8, 16, 4): row r's 4 bytes of each (digit, quad)
      for (int quad = 0; quad < 2 * GROUP / 4; ++quad)
        std::memcpy(block + (quad * TILE_M + r % TILE_M) * 4, quads + 4 * quad, 4);
    }
  }

  // Which (block, group) of TILE_M rows' digits and figures: block-major (TILES: a block's groups in
  // order, as a pass of the AMX kernels reads them), or group-major (QUADS: the blocks a panel step
  // reads together lie side by side, not a whole row's span apart, which set them on the same
  // first-level cache sets).
  int64_t block_group(int64_t block, int64_t g) const {
    return layout_ == DigitLayout::QUADS ? g * (padded_ / TILE_M) + block : block * groups_ + g;
  }

  // Where row r's group g digits lie: rows one after another; TILES: its 64 bytes in its block's
  // group; QUADS: its block's group (the row's bytes spread within it).
  int64_t digit_offset(int64_t r, int64_t g) const {
    if (layout_ == DigitLayout::TILES) return ((r / TILE_M * groups_ + g) * TILE_M + r % TILE_M) * DIGIT_BYTES;
    if (layout_ == DigitLayout::QUADS) return block_group(r / TILE_M, g) * TILE_M * DIGIT_BYTES;
    return (r * groups_ + g) * DIGIT_BYTES;
  }

  void fill_tile_params(int64_t block) {
    for (int64_t g = 0; g < groups_; ++g) {
      float* out = tile_params_.data() + block_group(block, g) * TILE_PARAMS;
      for (int64_t m = 0; m < TILE_M; ++m) {
        const int64_t at = (block * TILE_M + m) * groups_ + g;
        out[m] = dot_scales_[at];
        out[TILE_M + m] = sums_[at];
        std::memcpy(out + 2 * TILE_M + m, &digit_sums_[at * 2], 4);
        std::memcpy(out + 3 * TILE_M + m, &digit_sums_[at * 2 + 1], 4);
      }
    }
  }

  const float* x_ = nullptr;
  int64_t rows_ = 0, padded_ = 0, k_ = 0, groups_ = 0;
  DigitLayout layout_ = DigitLayout::ROWS;
  std::vector<float> sums_, dot_scales_, tile_params_;
  bool one_digit_ = false;  // HLLinear.activation_digits 1: q_low all 0
  std::vector<int32_t> digit_sums_;
  std::vector<int8_t> digits_;
};

}  // namespace hl
