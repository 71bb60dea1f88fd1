// Which 512-bit operations of the CPU MoE kernel's inner loop compete for the same execution pipes on this CPU.
//
// Why: the kernel (vllm_expert_offload/csrc/exl3_matmul.inc) and exllamav3's CPU MoE are bound by how many
// operations of each kind the core can start per cycle, not by memory; which operations share pipes decides what a
// rewrite can gain (docs/benchmarks.md, docs/kernels.md). Each row runs two operations interleaved on independent
// dependency chains (six of each, enough to hide latency) and prints cycles per pair: about 1 means they run side by
// side, about 2 (on Zen 4, where a 512-bit operation takes a 256-bit pipe for two cycles) that they share pipes.
// Cycles come from a chain of dependent scalar adds timed the same way (one per cycle on every x86 core).
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512vbmi -mfma -mf16c \
//       benchmarks/simd_port_pairs.cpp -o /tmp/simd_port_pairs && taskset -c 1 /tmp/simd_port_pairs
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr long kPairs = 60000000;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Core cycles per second: 4 dependent adds per iteration, one per cycle.
double cycles_per_second() {
  unsigned long x = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < 250000000; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 1e9 / seconds_since(start);
}

__m512i k1, k2;

// Cycles per (a, b) pair: each operation on six chains of its own, interleaved. Templates, so both inline.
template <typename A, typename B>
double pair_cycles(A a, B b, double hz) {
  __m512i x0 = k2, x1 = k2, x2 = k2, x3 = k2, x4 = k2, x5 = k2, y0 = k2, y1 = k2, y2 = k2, y3 = k2, y4 = k2, y5 = k2;
  const auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < kPairs / 6; ++n) {
    x0 = a(x0), y0 = b(y0), x1 = a(x1), y1 = b(y1), x2 = a(x2), y2 = b(y2);
    x3 = a(x3), y3 = b(y3), x4 = a(x4), y4 = b(y4), x5 = a(x5), y5 = b(y5);
    asm volatile("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3), "+v"(x4), "+v"(x5));
    asm volatile("" : "+v"(y0), "+v"(y1), "+v"(y2), "+v"(y3), "+v"(y4), "+v"(y5));
  }
  return seconds_since(start) * hz / kPairs;
}

// Every operation as int -> int, the fp32 ones through casts (free), so one kind of chain serves all.
inline __m512 f(__m512i v) { return _mm512_castsi512_ps(v); }
inline __m512i i(__m512 v) { return _mm512_castps_si512(v); }
const auto kFma = [](__m512i v) { return i(_mm512_fmadd_ps(f(v), _mm512_set1_ps(1.0f), f(k2))); };
const auto kFadd = [](__m512i v) { return i(_mm512_add_ps(f(v), _mm512_set1_ps(1e-30f))); };
const auto kMulld = [](__m512i v) { return _mm512_mullo_epi32(v, k1); };
const auto kDpbusd = [](__m512i v) { return _mm512_dpbusd_epi32(v, k1, k2); };
const auto kMultishift = [](__m512i v) { return _mm512_maskz_multishift_epi64_epi8(0x3333333333333333ull, k1, v); };
const auto kSrlv = [](__m512i v) { return _mm512_srlv_epi32(v, k1); };
const auto kPermb = [](__m512i v) { return _mm512_permutexvar_epi8(k1, v); };
const auto kAnd = [](__m512i v) { return _mm512_and_si512(v, k1); };
const auto kCvtph = [](__m512i v) { return i(_mm512_cvtph_ps(_mm512_castsi512_si256(v))); };

template <typename A>
void row(const char* name, A a, double hz) {
  std::printf("%16s%10.2f%10.2f%10.2f\n", name, pair_cycles(a, a, hz), pair_cycles(a, kFma, hz),
              pair_cycles(a, kFadd, hz));
}

}  // namespace

int main(int argc, char**) {
  k1 = _mm512_set1_epi32(argc);  // not known at compile time, so nothing folds
  k2 = _mm512_set1_epi32(0x3F800000);  // 1.0f: the fp32 chains stay normal (no denormal assists)
  const double hz = cycles_per_second();
  std::printf("%.2f GHz; cycles per interleaved pair (about 1: side by side, about 2: shared pipes)\n", hz / 1e9);
  std::printf("%16s%10s%10s%10s\n", "operation", "itself", "vfmadd", "vaddps");
  row("vfmadd231ps", kFma, hz);
  row("vaddps", kFadd, hz);
  row("vpmulld", kMulld, hz);
  row("vpdpbusd", kDpbusd, hz);
  row("vpmultishiftqb", kMultishift, hz);
  row("vpsrlvd", kSrlv, hz);
  row("vpermb", kPermb, hz);
  row("vpandd", kAnd, hz);
  row("vcvtph2ps", kCvtph, hz);
  return 0;
}
