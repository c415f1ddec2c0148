// Test helpers: deterministic random data and double-precision reference implementations.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace softkv::test {

/// n standard-normal floats from a fixed seed.
inline std::vector<float> normal_floats(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

/// n small integer-valued floats in [-r, r]: dot products of these are exact in any order.
inline std::vector<float> integer_floats(std::size_t n, std::uint64_t seed, int r = 3) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-r, r);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

/// The exact soft answer in double: softmax(scale * q . k_i) . V, with lse and max score.
struct SoftReference {
  std::vector<double> value;
  double lse = 0;
  double max_score = 0;
  std::vector<double> weights;
  std::vector<double> scores;
};

inline SoftReference soft_reference(const float* q, const float* keys, const float* values, std::size_t n,
                                    std::size_t d, std::size_t dv, double scale) {
  SoftReference ref;
  ref.scores.resize(n);
  ref.max_score = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < d; ++j) s += static_cast<double>(q[j]) * keys[i * d + j];
    ref.scores[i] = scale * s;
    ref.max_score = std::max(ref.max_score, ref.scores[i]);
  }
  double z = 0;
  ref.weights.resize(n);
  for (std::size_t i = 0; i < n; ++i) z += ref.weights[i] = std::exp(ref.scores[i] - ref.max_score);
  ref.value.assign(dv, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    ref.weights[i] /= z;
    for (std::size_t j = 0; j < dv; ++j) ref.value[j] += ref.weights[i] * values[i * dv + j];
  }
  ref.lse = ref.max_score + std::log(z);
  return ref;
}

/// Largest |x| in a vector (the error scale of a blended value).
inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

/// Largest |a_i - b_i|.
template <class A, class B>
double max_abs_diff(const A& a, const B& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

}  // namespace softkv::test
