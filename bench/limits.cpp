// Read bandwidth (STREAM-like sum) and OpenBLAS sgemm GFLOP/s, for expressing results as % of the limit.
#include "limits.hpp"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace softkv::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Sums n floats with 8 independent vector chains: the loads, not the adds, are the limit.
float sum_stream(const float* p, std::size_t n) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 a0{}, a1{}, a2{}, a3{};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    v8 x0, x1, x2, x3;
    __builtin_memcpy(&x0, p + i, 32);
    __builtin_memcpy(&x1, p + i + 8, 32);
    __builtin_memcpy(&x2, p + i + 16, 32);
    __builtin_memcpy(&x3, p + i + 24, 32);
    a0 += x0, a1 += x1, a2 += x2, a3 += x3;
  }
  v8 a = (a0 + a1) + (a2 + a3);
  float s = 0;
  for (int j = 0; j < 8; ++j) s += a[j];
  for (; i < n; ++i) s += p[i];
  return s;
}

// Floats of one vector register, per instruction set, and the loops that keep 12 independent FMA chains
// busy (more chains than FMA latency x units on the CPUs measured: 4 cycles x 2 units). Each iteration
// is 12 FMAs of W lanes: 24 W flops. The results feed a volatile sink so nothing is optimised away.
constexpr std::size_t kChains = 12;

// Sums the chains' lanes into one float (so that no chain is dead code).
template <class V>
float drain(const V* acc, std::size_t lanes) {
  float s = 0;
  for (std::size_t c = 0; c < kChains; ++c) {
    float part[16];
    __builtin_memcpy(part, &acc[c], lanes * sizeof(float));
    for (std::size_t i = 0; i < lanes; ++i) s += part[i];
  }
  return s;
}

__attribute__((target("avx512f"))) float fma_loop_avx512(std::size_t iterations) {
  __m512 acc[kChains];
  for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (std::size_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12  // every chain in a register, at any optimisation level
    for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], x, y);
  return drain(acc, 16);
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(std::size_t iterations) {
  __m256 acc[kChains];
  for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (std::size_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
    for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], x, y);
  return drain(acc, 8);
}

float fma_loop_sse2(std::size_t iterations) {  // no FMA: a multiply and an add, counted as the two flops they are
  __m128 acc[kChains];
  for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm_set1_ps(static_cast<float>(c));
  const __m128 x = _mm_set1_ps(0.999999f), y = _mm_set1_ps(1e-7f);
  for (std::size_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
    for (std::size_t c = 0; c < kChains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], x), y);
  return drain(acc, 4);
}

}  // namespace

double fma_peak_gflops(unsigned threads, int reps, std::string* isa) {
  __builtin_cpu_init();
  float (*loop)(std::size_t) = fma_loop_sse2;
  std::size_t lanes = 4;
  const char* name = "sse2 (multiply + add)";
  if (__builtin_cpu_supports("avx512f")) {
    loop = fma_loop_avx512, lanes = 16, name = "avx512 fma";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fma_loop_avx2, lanes = 8, name = "avx2 fma";
  }
  if (isa != nullptr) *isa = name;
  constexpr std::size_t kIterations = 20'000'000;  // ~0.1 s a thread at a few GHz
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    std::vector<float> out(threads);
    std::vector<std::thread> pool;
    const auto t0 = Clock::now();
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back([&, t] { out[t] = loop(kIterations); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    volatile float sink = 0;
    for (float o : out) sink = sink + o;
    best = std::max(best, 2.0 * static_cast<double>(kChains * lanes * kIterations) * threads / s / 1e9);
  }
  return best;
}

BandwidthProbe::BandwidthProbe(std::size_t bytes, unsigned threads)
    : buf_(new float[bytes / sizeof(float)]), n_(bytes / sizeof(float)), threads_(threads) {
  // First touch from the threads that will read, so pages are mapped before timing.
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads_; ++t)
    pool.emplace_back([&, t] { std::fill(buf_ + n_ * t / threads_, buf_ + n_ * (t + 1) / threads_, 1.0f); });
  for (auto& th : pool) th.join();
}

BandwidthProbe::~BandwidthProbe() { delete[] buf_; }

double BandwidthProbe::measure() {
  std::vector<float> partial(threads_);
  std::vector<std::thread> pool;
  const auto t0 = Clock::now();
  for (unsigned t = 0; t < threads_; ++t)
    pool.emplace_back([&, t] { partial[t] = sum_stream(buf_ + n_ * t / threads_, n_ / threads_); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  volatile float sink = 0;
  for (float p : partial) sink = sink + p;
  return static_cast<double>(n_ * sizeof(float)) / s / 1e9;
}

double read_bandwidth_gbs(std::size_t bytes, unsigned threads, int reps) {
  BandwidthProbe probe(bytes, threads);
  double best = 0;
  for (int r = 0; r < reps; ++r) best = std::max(best, probe.measure());
  return best;
}

double sgemm_gflops(std::size_t n, int threads, int reps) {
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  openblas_set_num_threads(threads);
  const int ni = static_cast<int>(n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a.data(), ni, b.data(), ni, 0.0f, c.data(), ni);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a.data(), ni, b.data(), ni, 0.0f, c.data(), ni);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(n) * n * n / s / 1e9);
  }
  return best;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

}  // namespace softkv::bench
