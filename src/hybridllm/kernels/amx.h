// AMX (Intel Sapphire Rapids and later): the integer dots of many input rows on tile registers.
//
// Included by decode.cpp (one translation unit) inside its namespace: uses GROUP, ActivationRows
// (activations.h) and the Q4 blocks (q4_blocks.h).
//
// A tile multiply (TDPBSUD / TDPBSSD) gives the exact int32 dots of 16 input rows against 16
// weight rows over one group of 32 inputs: the same integers the vector kernels compute one
// input row at a time. The float steps after them are the vector kernels' own, element by
// element, so a row's result is the same bits whether its batch ran on tiles or on vectors: the
// tiles only decide how fast a batch (or a prefill chunk) goes. Built only where -march gives
// AMX-INT8 (and AVX-512 VNNI for the float steps); used only once Linux has granted this process
// the tile state (arch_prctl), and hl_set_amx(0) turns them off (the tests compare both ways).

// The fewest input rows worth the tiles (fewer: the vector kernels), the measured crossovers: a
// Q4 pass unpacks the codes and runs whole 16-row tiles however few rows are valid; the vector
// Q8 head kernel is slow per row.
constexpr int64_t AMX_MIN_ROWS_Q4 = 10;
constexpr int64_t AMX_MIN_ROWS_Q8 = 4;

#if HL_AMX
// Whether Linux lets this process use the tile registers (asked once; granted for the process).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

std::atomic<bool> amx_enabled{true};

inline bool amx_usable() { return amx_enabled.load(std::memory_order_relaxed) && amx_granted(); }

// The tiles (macros: the intrinsics paste the number into the instruction) and their shapes.
#define DOTS_HIGH 0      // 16 x 16 int32 dots of the high digits
#define DOTS_LOW 1       // ... of the low digits
#define INPUT_HIGH 2     // Q4: 16 input rows x 32 high digits (the A operand)
#define INPUT_LOW 3      // ... low digits
#define QUADS 4          // 8 quads x 16 rows x 4 bytes (the B operand: Q4 codes, or the head's high input digits)
#define QUADS_LOW 5      // head: the low input digits
#define CODES 6          // head: 16 weight rows x 32 int8 codes (the A operand)
#define DOTS_HIGH_ODD 5  // Q4: the dots of odd groups (two pairs: a group's multiplies overlap the previous one's float steps)
#define DOTS_LOW_ODD 6
#define Q8_DOTS_HIGH_ODD 2  // head: the dots of odd groups
#define Q8_DOTS_LOW_ODD 3

// A group's two result tiles into the kernel's `dots[parity]` (high digits, then low digits).
#define STORE_DOTS(HIGH, LOW, parity)        \
  do {                                      \
    _tile_stored(HIGH, dots[parity][0], 64); \
    _tile_stored(LOW, dots[parity][1], 64);  \
  } while (0)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig& shape(std::initializer_list<int> tiles, int rows_, int bytes) {
    for (int t : tiles) rows[t] = static_cast<uint8_t>(rows_), bytes_per_row[t] = static_cast<uint16_t>(bytes);
    return *this;
  }
};

// Load a kernel's tile shapes (every call: other code on this thread, such as oneDNN's, may
// have loaded its own).
inline void configure_q4_tiles() {
  static const TileConfig config = TileConfig()
      .shape({DOTS_HIGH, DOTS_LOW, DOTS_HIGH_ODD, DOTS_LOW_ODD}, TILE_M, 64)  // 16 x 16 int32
      .shape({INPUT_HIGH, INPUT_LOW}, TILE_M, GROUP)                          // 16 rows x 32 bytes
      .shape({QUADS}, GROUP / 4, 64);                                         // 8 quads x 16 x 4 bytes
  _tile_loadconfig(&config);
}

inline void configure_q8_tiles() {
  static const TileConfig config = TileConfig()
      .shape({DOTS_HIGH, DOTS_LOW, Q8_DOTS_HIGH_ODD, Q8_DOTS_LOW_ODD}, 16, 64)
      .shape({CODES}, 16, GROUP)
      .shape({QUADS, QUADS_LOW}, GROUP / 4, 64);
  _tile_loadconfig(&config);
}

// 64-byte aligned scratch that only grows (one per thread).
struct AlignedScratch {
  std::vector<uint8_t> storage;
  uint8_t* get(size_t bytes) {
    if (storage.size() < bytes + 64) storage.resize(bytes + 64);
    return storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  }
};

// One group's float steps (q4_rows') for the 16 input rows of a tile: `dots` its high and low
// digits' tiles, `params` the block's 16 scales and zero terms, `rows` the rows' dot scales and sums.
__attribute__((always_inline)) inline void q4_tile_float_steps(__m512 (&acc)[TILE_M], const int32_t (*dots)[TILE_M * 16],
                                                               const float* params, const float* rows) {
  const __m512 scale = _mm512_load_ps(params), zero_term = _mm512_load_ps(params + 16);
#pragma GCC unroll 16
  for (int r = 0; r < TILE_M; ++r) {
    const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[0] + 16 * r), 7),
                                       _mm512_load_si512(dots[1] + 16 * r));
    acc[r] = accumulate_group(acc[r], d, scale, zero_term, rows + r, rows + TILE_M + r);
  }
}

// One block row of Q4 weights (16 output rows, `blocks`: its first group) for every input row:
// the block row's quads, scales and zero terms are unpacked once (L1/L2), then per 16 input rows
// and group two tile multiplies (the two digits) and q4_rows' float steps on each input row's 16 dots.
void q4_rows_amx(const uint8_t* blocks, const ActivationRows& acts, int64_t groups, float* out, int64_t n_out,
                 int n_valid) {
  thread_local AlignedScratch scratch;
  uint8_t* quads = scratch.get(groups * (8 * Q4_QUAD_BYTES + 2 * 64));
  float* params = reinterpret_cast<float*>(quads + groups * 8 * Q4_QUAD_BYTES);  // (groups, 2, 16): scale, zero term
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = blocks + g * Q4_BLOCK_BYTES;
    __m512i unpacked[8];
    unpack_quads(block, unpacked);
    for (int i = 0; i < 8; ++i) _mm512_store_si512(quads + (g * 8 + i) * Q4_QUAD_BYTES, unpacked[i]);
    const __m512 scale = bf16x16(block);
    _mm512_store_ps(params + g * 32, scale);
    _mm512_store_ps(params + g * 32 + 16, zero_terms(scale, bf16x16(block + 32)));
  }
  configure_q4_tiles();
  const int64_t k = groups * GROUP;
  alignas(64) int32_t dots[2][2][TILE_M * 16];  // [group parity][digit]
  const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
  for (int64_t m0 = 0; m0 < acts.rows(); m0 += TILE_M) {
    const int8_t* high = acts.digits() + m0 * 2 * k;  // group g's digits at 2 GROUP g, rows 2 k apart
    const int8_t* low = high + GROUP;
    __m512 acc[TILE_M];
    for (int r = 0; r < TILE_M; ++r) acc[r] = _mm512_setzero_ps();
// Group g's tile multiplies into a pair of dot tiles, then (separately: the float steps of the
// previous group run while the multiplies do, and a tile store ahead of them would hold their
// loads back) the pair's store.
#define Q4_GROUP_MULTIPLY(HIGH, LOW, g)                                 \
  do {                                                                 \
    _tile_loadd(INPUT_HIGH, high + (g) * 2 * GROUP, 2 * k);            \
    _tile_loadd(INPUT_LOW, low + (g) * 2 * GROUP, 2 * k);              \
    _tile_loadd(QUADS, quads + (g) * 8 * Q4_QUAD_BYTES, Q4_QUAD_BYTES); \
    _tile_zero(HIGH);                                                  \
    _tile_zero(LOW);                                                   \
    _tile_dpbsud(HIGH, INPUT_HIGH, QUADS);                             \
    _tile_dpbsud(LOW, INPUT_LOW, QUADS);                               \
  } while (0)
    Q4_GROUP_MULTIPLY(DOTS_HIGH, DOTS_LOW, 0);
    STORE_DOTS(DOTS_HIGH, DOTS_LOW, 0);
    const float* rows = acts.tile_scales(m0 / TILE_M, 0);
    for (int64_t g = 0; g < groups; g += 2) {  // even groups in the first pair of tiles, odd ones in the second
      if (g + 1 < groups) Q4_GROUP_MULTIPLY(DOTS_HIGH_ODD, DOTS_LOW_ODD, g + 1);
      q4_tile_float_steps(acc, dots[0], params + g * 32, rows + g * 2 * TILE_M);
      if (g + 1 < groups) STORE_DOTS(DOTS_HIGH_ODD, DOTS_LOW_ODD, 1);
      if (g + 2 < groups) Q4_GROUP_MULTIPLY(DOTS_HIGH, DOTS_LOW, g + 2);
      if (g + 1 < groups) q4_tile_float_steps(acc, dots[1], params + (g + 1) * 32, rows + (g + 1) * 2 * TILE_M);
      if (g + 2 < groups) STORE_DOTS(DOTS_HIGH, DOTS_LOW, 0);
    }
#undef Q4_GROUP_MULTIPLY
    for (int64_t r = 0; r < TILE_M && m0 + r < acts.rows(); ++r)
      _mm512_mask_storeu_ps(out + (m0 + r) * n_out, valid, acc[r]);
  }
}

// Rows n0..n1-1 (n1 - n0 a multiple of 16) of a (G, N, 32) Q8 table with (G, N) scales (the Q8_0
// head) for every input row, as q8_groups_range computes them: per group, the integer dots of 16
// weight rows (the table's rows as they are) against 16 input rows (acts.columns()), then
// acc = fma(float(D), scale[g, n] * dot_scales[m][g], acc) over the groups in order.
// One group's float steps (q8_groups_range's) for 16 weight rows: `dots` the high and low digits'
// tiles (rows: weight rows, lanes: the tile's input rows), `row_scales` the rows' scales.
__attribute__((always_inline)) inline void q8_tile_float_steps(__m512 (&acc)[16], const int32_t (*dots)[16 * TILE_M],
                                                               const float* row_scales, const float* x_scales_p,
                                                               bool first) {
  const __m512 x_scales = _mm512_loadu_ps(x_scales_p);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[0] + TILE_M * r), 7),
                                       _mm512_load_si512(dots[1] + TILE_M * r));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(row_scales[r]), x_scales),
                             first ? _mm512_setzero_ps() : acc[r]);
  }
}

void q8_groups_range_amx(const int8_t* w, const float* scales, const ActivationRows& acts, int64_t n0, int64_t n1,
                         int64_t n_rows, int64_t groups, float* out, int64_t n_out) {
  configure_q8_tiles();
  alignas(64) int32_t dots[2][2][16 * TILE_M];  // [group parity][digit]
  alignas(64) float results[16][TILE_M];
  for (int64_t n = n0; n < n1; n += 16) {
    for (int64_t block = 0; block * TILE_M < acts.rows(); ++block) {
      __m512 acc[16];  // acc[r]: weight row n + r, one lane per input row of the block
#define Q8_GROUP_MULTIPLY(HIGH, LOW, g)                                    \
  do {                                                                    \
    _tile_loadd(CODES, w + ((g) * n_rows + n) * GROUP, GROUP);            \
    _tile_loadd(QUADS, acts.columns(block, g, 0), 64);                    \
    _tile_loadd(QUADS_LOW, acts.columns(block, g, 1), 64);                \
    _tile_zero(HIGH);                                                     \
    _tile_zero(LOW);                                                      \
    _tile_dpbssd(HIGH, CODES, QUADS);                                     \
    _tile_dpbssd(LOW, CODES, QUADS_LOW);                                  \
  } while (0)
      Q8_GROUP_MULTIPLY(DOTS_HIGH, DOTS_LOW, 0);
      STORE_DOTS(DOTS_HIGH, DOTS_LOW, 0);
      for (int64_t g = 0; g < groups; g += 2) {  // even groups in the first pair of tiles, odd ones in the second
        if (g + 1 < groups) Q8_GROUP_MULTIPLY(Q8_DOTS_HIGH_ODD, Q8_DOTS_LOW_ODD, g + 1);
        q8_tile_float_steps(acc, dots[0], scales + g * n_rows + n, acts.tile_scales(block, g), g == 0);
        if (g + 1 < groups) STORE_DOTS(Q8_DOTS_HIGH_ODD, Q8_DOTS_LOW_ODD, 1);
        if (g + 2 < groups) Q8_GROUP_MULTIPLY(DOTS_HIGH, DOTS_LOW, g + 2);
        if (g + 1 < groups)
          q8_tile_float_steps(acc, dots[1], scales + (g + 1) * n_rows + n, acts.tile_scales(block, g + 1), false);
        if (g + 2 < groups) STORE_DOTS(DOTS_HIGH, DOTS_LOW, 0);
      }
#undef Q8_GROUP_MULTIPLY
      for (int r = 0; r < 16; ++r) _mm512_store_ps(results[r], acc[r]);
      for (int64_t m = 0; m < TILE_M && block * TILE_M + m < acts.rows(); ++m)
        for (int r = 0; r < 16; ++r) out[(block * TILE_M + m) * n_out + n + r] = results[r][m];
    }
  }
}
#undef DOTS_HIGH
#undef DOTS_LOW
#undef INPUT_HIGH
#undef INPUT_LOW
#undef QUADS
#undef QUADS_LOW
#undef CODES
#undef DOTS_HIGH_ODD
#undef DOTS_LOW_ODD
#undef Q8_DOTS_HIGH_ODD
#undef Q8_DOTS_LOW_ODD
#undef STORE_DOTS
#else
inline bool amx_usable() { return false; }
#endif
