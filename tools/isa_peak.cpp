// The vector units' peak instruction rates, the ceiling the product and attention kernels work
// under: independent chains of one instruction on registers (twelve on 512-bit registers, eight on
// 256-bit ones, whose 16 registers would spill twelve; no memory), on 1..N threads. Built and run by tools/isa_peak.py with the kernels'
// compiler and -march; prints one line per kernel: "<name> <threads> <instructions per second>".
//
//   isa_peak <threads> <iterations>
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

#define EIGHT(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define TWELVE(OP) EIGHT(OP) OP(8) OP(9) OP(10) OP(11)

#if defined(__AVX512VNNI__)
// vpdpbusd zmm: 64 u8 x s8 products into 16 int32 lanes.
long dpbusd512(long iterations) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
#define INIT(i) __m512i c##i = _mm512_set1_epi32(i);
  TWELVE(INIT)
#undef INIT
  for (long it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
    TWELVE(STEP)
#undef STEP
  }
  __m512i sum = _mm512_setzero_si512();
#define FOLD(i) sum = _mm512_add_epi32(sum, c##i);
  TWELVE(FOLD)
#undef FOLD
  return _mm512_reduce_add_epi32(sum);
}
#endif

#if defined(__AVX512F__)
// vfmadd zmm: 16 float multiply-adds.
long fma512(long iterations) {
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.0f);
#define INIT(i) __m512 c##i = _mm512_set1_ps(i);
  TWELVE(INIT)
#undef INIT
  for (long it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, a, b);
    TWELVE(STEP)
#undef STEP
  }
  __m512 sum = _mm512_setzero_ps();
#define FOLD(i) sum = _mm512_add_ps(sum, c##i);
  TWELVE(FOLD)
#undef FOLD
  return static_cast<long>(_mm512_reduce_add_ps(sum));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// vfmadd ymm: 8 float multiply-adds.
long fma256(long iterations) {
  const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.0f);
#define INIT(i) __m256 c##i = _mm256_set1_ps(i);
  EIGHT(INIT)
#undef INIT
  for (long it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm256_fmadd_ps(c##i, a, b);
    EIGHT(STEP)
#undef STEP
  }
  __m256 sum = _mm256_setzero_ps();
#define FOLD(i) sum = _mm256_add_ps(sum, c##i);
  EIGHT(FOLD)
#undef FOLD
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return static_cast<long>(lanes[0]);
}

// vpmaddubsw ymm + vpaddw: 32 u8 x s8 products summed into 16-bit lanes, the AVX2 kernels' step
// without VNNI: eight chains of adds, their products independent of them (as the kernels' are).
// In inline assembly: the compiler would hoist the loop-invariant products, and spill eight chains
// with their temporaries on 16 registers.
long maddubs256(long iterations) {
  const __m256i b = _mm256_set1_epi8(1), x0 = _mm256_set1_epi8(2), x1 = _mm256_set1_epi8(3);
#define INIT(i) __m256i c##i = _mm256_set1_epi16(i);
  EIGHT(INIT)
#undef INIT
  __m256i t0, t1, t2, t3;
  for (long it = 0; it < iterations; ++it) {
    asm("vpmaddubsw %[b], %[x0], %[t0]\n\tvpmaddubsw %[b], %[x1], %[t1]\n\t"
        "vpmaddubsw %[b], %[x0], %[t2]\n\tvpmaddubsw %[b], %[x1], %[t3]\n\t"
        "vpaddw %[t0], %[c0], %[c0]\n\tvpaddw %[t1], %[c1], %[c1]\n\t"
        "vpaddw %[t2], %[c2], %[c2]\n\tvpaddw %[t3], %[c3], %[c3]\n\t"
        "vpmaddubsw %[b], %[x0], %[t0]\n\tvpmaddubsw %[b], %[x1], %[t1]\n\t"
        "vpmaddubsw %[b], %[x0], %[t2]\n\tvpmaddubsw %[b], %[x1], %[t3]\n\t"
        "vpaddw %[t0], %[c4], %[c4]\n\tvpaddw %[t1], %[c5], %[c5]\n\t"
        "vpaddw %[t2], %[c6], %[c6]\n\tvpaddw %[t3], %[c7], %[c7]"
        : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5),
          [c6] "+x"(c6), [c7] "+x"(c7), [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2), [t3] "=&x"(t3)
        : [b] "x"(b), [x0] "x"(x0), [x1] "x"(x1));
  }
  __m256i sum = _mm256_setzero_si256();
#define FOLD(i) sum = _mm256_add_epi16(sum, c##i);
  EIGHT(FOLD)
#undef FOLD
  return _mm256_extract_epi16(sum, 0);
}
#endif

struct Kernel {
  const char* name;
  long (*run)(long);
  int chains;  // instructions per iteration
};

const Kernel KERNELS[] = {
#if defined(__AVX512VNNI__)
    {"vpdpbusd_zmm", dpbusd512, 12},
#endif
#if defined(__AVX512F__)
    {"vfmadd_zmm", fma512, 12},
#endif
#if defined(__AVX2__) && defined(__FMA__)
    {"vfmadd_ymm", fma256, 8},
    {"vpmaddubsw_vpaddw_ymm", maddubs256, 8},
#endif
    {nullptr, nullptr, 0},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: isa_peak <threads> <iterations>\n");
    return 2;
  }
  const int threads = std::atoi(argv[1]);
  const long iterations = std::atol(argv[2]);
  for (const Kernel* k = KERNELS; k->name != nullptr; ++k) {
    std::vector<long> sink(threads);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> team;
    for (int t = 0; t < threads; ++t) team.emplace_back([&, t] { sink[t] = k->run(iterations); });
    for (auto& member : team) member.join();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    long checksum = 0;
    for (long s : sink) checksum += s;
    std::printf("%s %d %.6e %ld\n", k->name, threads, static_cast<double>(threads) * k->chains * iterations / seconds,
                checksum & 1);
  }
  return 0;
}
