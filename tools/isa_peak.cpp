// The vector units' peak instruction rates, the ceiling the product and attention kernels work
// under: independent chains of one instruction on registers (no memory), on 1..N threads. Built
// and run by tools/isa_peak.py with the kernels' compiler and -march; prints one line per kernel:
// "<name> <threads> <instructions per second> <a bit of the result>".
//
//   isa_peak <threads> <iterations>
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

// N independent chains c = step(c) on registers from c = first(i), iterations times; their bits
// folded into one long (so none is dead; the chains start apart, or the compiler would merge
// them). The chains are an array the unrolled loops index with constants only, so the compiler
// keeps them in registers; the empty asm hides each step's result from it (it would fold a chain
// of constant steps into one closed-form step).
template <int N, typename First, typename Step, typename Bits>
long chains(long iterations, First first, Step step, Bits bits) {
  decltype(first(0)) c[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) c[i] = first(i);
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) {
      c[i] = step(c[i]);
      asm("" : "+v"(c[i]));
    }
  }
  long folded = 0;
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) folded ^= bits(c[i]);
  return folded;
}

// Twelve chains on 512-bit registers (32 of them), eight on 256-bit ones (16: twelve would spill).
constexpr int WIDE_CHAINS = 12, NARROW_CHAINS = 8;

#if defined(__AVX512VNNI__)
// vpdpbusd zmm: 64 u8 x s8 products into 16 int32 lanes.
long dpbusd512(long iterations) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
  return chains<WIDE_CHAINS>(iterations, [](int i) { return _mm512_set1_epi32(i); },
                             [&](__m512i c) { return _mm512_dpbusd_epi32(c, a, b); },
                             [](__m512i c) { return static_cast<long>(_mm512_reduce_add_epi32(c)); });
}
#endif

#if defined(__AVX512F__)
// vfmadd zmm: 16 float multiply-adds.
long fma512(long iterations) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  return chains<WIDE_CHAINS>(iterations, [](int i) { return _mm512_set1_ps(i + 1.0f); },
                             [&](__m512 c) { return _mm512_fmadd_ps(c, one, zero); },
                             [](__m512 c) { return static_cast<long>(_mm512_reduce_add_ps(c)); });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// vfmadd ymm: 8 float multiply-adds.
long fma256(long iterations) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  return chains<NARROW_CHAINS>(iterations, [](int i) { return _mm256_set1_ps(i + 1.0f); },
                               [&](__m256 c) { return _mm256_fmadd_ps(c, one, zero); },
                               [](__m256 c) { return static_cast<long>(_mm256_cvtss_f32(c)); });
}

// vpmaddubsw ymm + vpaddw: 32 u8 x s8 products summed into 16-bit lanes, the AVX2 kernels' step
// without VNNI: eight chains of adds, their products independent of them (as the kernels' are).
// In inline assembly: the compiler would hoist the loop-invariant products, and spill eight chains
// with their temporaries on 16 registers.
long maddubs256(long iterations) {
  const __m256i b = _mm256_set1_epi8(1), x0 = _mm256_set1_epi8(2), x1 = _mm256_set1_epi8(3);
  __m256i c0 = b, c1 = b, c2 = b, c3 = b, c4 = b, c5 = b, c6 = b, c7 = b, t0, t1, t2, t3;
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
  const __m256i sum = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                       _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
  return _mm256_extract_epi16(sum, 0);
}
#endif

struct Kernel {
  const char* name;
  long (*run)(long);
  int per_iteration;  // instructions per loop iteration (its chains)
};

const Kernel KERNELS[] = {
#if defined(__AVX512VNNI__)
    {"vpdpbusd_zmm", dpbusd512, WIDE_CHAINS},
#endif
#if defined(__AVX512F__)
    {"vfmadd_zmm", fma512, WIDE_CHAINS},
#endif
#if defined(__AVX2__) && defined(__FMA__)
    {"vfmadd_ymm", fma256, NARROW_CHAINS},
    {"vpmaddubsw_vpaddw_ymm", maddubs256, NARROW_CHAINS},
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
    std::printf("%s %d %.6e %ld\n", k->name, threads, static_cast<double>(threads) * k->per_iteration * iterations / seconds,
                checksum & 1);
  }
  return 0;
}
