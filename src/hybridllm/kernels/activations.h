// The input rows of a product as the quantized-weight kernels read them.
//
// Included by decode.cpp (one translation unit) inside its namespace: uses GROUP.
//
// Each row x (K,) becomes its float32 values, one float sum per group of 32 (the zero-point
// terms of Q4), and (x86) two int8 digits per value for integer dot products:
//   x ~= dot_scales[g] * (128 q + q_low),   dot_scales[g] = scale / 128,
// q = round(x / scale) with scale = max|x_g| / 127, and q_low the rounded remainder in 1/128
// steps (|q_low| <= 64). Two integer dots per group then carry ~15 bits of each activation (one
// int8 digit alone, as llama.cpp uses, moves this model's logits ~20x more than bfloat16). The
// dots are exact integers, so any instruction that computes them (vpdpbusd on 256 or 512 bits,
// AMX tiles) gives the same result, and every kernel applies the same float steps to it.

// Input rows are stored in blocks of TILE_M (the rows of one AMX tile); rows past M are zeros
// (their dots are 0, their scales and sums 0).
constexpr int64_t TILE_M = 16;

// One prepared input row.
struct Activation {
  const float* x;         // (K,)
  const float* sums;      // (K/32,)
  const float* dot_scales;  // (K/32,): what the integer dots of a group are multiplied by
  const int8_t* digits;     // (K/32, 2, 32): each group's q, then its q_low
  const int8_t* high(int64_t g) const { return digits + g * 2 * GROUP; }
  const int8_t* low(int64_t g) const { return digits + g * 2 * GROUP + GROUP; }
};

// What a product reads besides the rows themselves (AMX kernels read per-tile copies).
enum class TileLayout {
  NONE,     // the rows only (vector kernels)
  SCALES,   // + each tile's dot scales and sums, 16 per group, contiguous (the Q4 tile kernel)
  COLUMNS,  // + the digits as tile B operands (the Q8-group tile kernel)
};

// The prepared rows of one product's input (M, K). A thread prepares its own copy (decode: a
// few rows, no barrier), or a team shares one (many rows): `reset` once, then `fill` by row ranges
// of whole TILE_M blocks, then a barrier.
class ActivationRows {
 public:
  // Size the buffers for x (rows, k) and zero the padding rows.
  void reset(const float* x, int64_t rows, int64_t k, bool with_sums, bool quantize,
             TileLayout tiles = TileLayout::NONE) {
    x_ = x;
    rows_ = rows;
    padded_ = (rows + TILE_M - 1) / TILE_M * TILE_M;
    k_ = k;
    groups_ = with_sums ? k / GROUP : 0;
    quantized_ = quantize;
    tiles_ = quantize ? tiles : TileLayout::NONE;
    sums_.resize(padded_ * groups_);
    std::fill(sums_.begin() + rows * groups_, sums_.end(), 0.0f);
    dot_scales_.resize(quantize ? padded_ * groups_ : 0);
    digits_.resize(quantize ? padded_ * 2 * k : 0);
    if (quantize) {
      std::fill(dot_scales_.begin() + rows * groups_, dot_scales_.end(), 0.0f);
      std::fill(digits_.begin() + rows * 2 * k, digits_.end(), int8_t{0});
    }
    const bool tile_scales = tiles_ != TileLayout::NONE;
    tile_scales_.resize(tile_scales ? 2 * padded_ * groups_ : 0);
    column_digits_.resize(tiles_ == TileLayout::COLUMNS ? 2 * padded_ * k : 0);
  }

  // Prepare rows [r0, r1) (r0 a multiple of TILE_M; r1 one too, or the last row), and the tile
  // copies of the blocks they cover.
  void fill(int64_t r0, int64_t r1) {
    for (int64_t g = r0 * groups_; g < r1 * groups_; ++g) {
      const float* xg = x_ + g * GROUP;  // rows are contiguous, so group g of all rows in turn
      float sum = 0.0f, amax = 0.0f;
#pragma omp simd reduction(+ : sum) reduction(max : amax)
      for (int j = 0; j < GROUP; ++j) {
        sum += xg[j];
        amax = std::max(amax, std::fabs(xg[j]));
      }
      sums_[g] = sum;
      if (!quantized_) continue;
      const float scale = amax / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      dot_scales_[g] = scale / 128.0f;
      int8_t* q = digits_.data() + g * 2 * GROUP;
      int8_t* q_low = q + GROUP;
#pragma omp simd
      for (int j = 0; j < GROUP; ++j) {
        const float scaled = xg[j] * inverse;
        const float high = std::nearbyint(scaled);
        q[j] = static_cast<int8_t>(high);
        q_low[j] = static_cast<int8_t>(std::nearbyint((scaled - high) * 128.0f));
      }
    }
    if (tiles_ != TileLayout::NONE)
      for (int64_t block = r0 / TILE_M; block < (r1 + TILE_M - 1) / TILE_M; ++block) fill_tile_copies(block);
  }

  void prepare(const float* x, int64_t rows, int64_t k, bool with_sums, bool quantize,
               TileLayout tiles = TileLayout::NONE) {
    reset(x, rows, k, with_sums, quantize, tiles);
    fill(0, rows);
  }

  int64_t rows() const { return rows_; }
  int64_t padded_rows() const { return padded_; }
  Activation row(int64_t i) const {
    return {x_ + i * k_, sums_.data() + i * groups_, quantized_ ? dot_scales_.data() + i * groups_ : nullptr,
            quantized_ ? digits_.data() + i * 2 * k_ : nullptr};
  }
  // Whole padded blocks of rows (M_padded, K/32, 2, 32): each group's high and low digits of
  // 16 rows are AMX A operands (16 rows x 32 bytes, a row every 2K bytes).
  const int8_t* digits() const { return digits_.data(); }

  // The dot scales (then the sums) of rows [16 block, 16 block + 16), group g: 2 x 16 floats.
  const float* tile_scales(int64_t block, int64_t g) const {
    return tile_scales_.data() + (block * groups_ + g) * 2 * TILE_M;
  }
  // The digits of rows [16 block, 16 block + 16), group g, as an AMX B operand: 8 rows (input
  // quads) of 16 x 4 bytes, (row m, inputs 4i..4i+3) at [i][m]; digit 0 is q, 1 is q_low.
  const int8_t* columns(int64_t block, int64_t g, int digit) const {
    return column_digits_.data() + ((block * groups_ + g) * 2 + digit) * TILE_M * GROUP;
  }

 private:
  void fill_tile_copies(int64_t block) {
    for (int64_t g = 0; g < groups_; ++g) {
      float* scales = tile_scales_.data() + (block * groups_ + g) * 2 * TILE_M;
      for (int64_t m = 0; m < TILE_M; ++m) {
        scales[m] = dot_scales_[(block * TILE_M + m) * groups_ + g];
        scales[TILE_M + m] = sums_[(block * TILE_M + m) * groups_ + g];
      }
      if (tiles_ != TileLayout::COLUMNS) continue;
      for (int digit = 0; digit < 2; ++digit) {
        int8_t* out = column_digits_.data() + ((block * groups_ + g) * 2 + digit) * TILE_M * GROUP;
        for (int64_t m = 0; m < TILE_M; ++m) {
          const int8_t* row = digits_.data() + (block * TILE_M + m) * 2 * k_ + (2 * g + digit) * GROUP;
          for (int i = 0; i < GROUP / 4; ++i) std::memcpy(out + (i * TILE_M + m) * 4, row + 4 * i, 4);
        }
      }
    }
  }

  const float* x_ = nullptr;
  int64_t rows_ = 0, padded_ = 0, k_ = 0, groups_ = 0;
  bool quantized_ = false;
  TileLayout tiles_ = TileLayout::NONE;
  std::vector<float> sums_, dot_scales_, tile_scales_;
  std::vector<int8_t> digits_, column_digits_;
};
