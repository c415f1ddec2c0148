// What the benchmarks share: timing (median of repeated runs) and fast deterministic data.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace softkv::bench {

/// Median wall time of reps runs of fn, in milliseconds (one warm-up run first).
template <class F>
double median_ms(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < std::max(1, reps); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Uniform floats in [-1, 1) from xorshift64: fast enough to fill gigabytes, the same on every run.
struct Xorshift {
  std::uint64_t x;
  float next() {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
};

/// n such floats from a seed.
inline std::vector<float> uniform_floats(std::size_t n, std::uint64_t seed) {
  Xorshift rng{seed * 0x9E3779B97F4A7C15ull + 1};
  std::vector<float> v(n);
  for (float& f : v) f = rng.next();
  return v;
}

/// n standard normal floats from a seed (Box-Muller over the Xorshift stream).
inline std::vector<float> gaussian_floats(std::size_t n, std::uint64_t seed) {
  Xorshift rng{seed * 0x9E3779B97F4A7C15ull + 3};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(rng.next()) + 1.0000001) / 2.0000002, u2 = (static_cast<double>(rng.next()) + 1.0) / 2.0;
    const double r = std::sqrt(-2.0 * std::log(u1)), t = 6.283185307179586 * u2;
    v[i] = static_cast<float>(r * std::cos(t));
    if (i + 1 < n) v[i + 1] = static_cast<float>(r * std::sin(t));
  }
  return v;
}

}  // namespace softkv::bench
