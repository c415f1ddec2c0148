// A partial softmax (m, l, acc) and the log-sum-exp rule that merges two of them exactly.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace softkv::detail {

/// Softmax over a subset of rows: max score m, l = sum exp(s_i - m), acc = sum exp(s_i - m) v_i.
/// The empty state has m = -inf, l = 0, acc = 0 and merges as the identity (never NaN).
struct SoftmaxState {
  float max = -std::numeric_limits<float>::infinity();  ///< m
  float sum = 0.0f;                                     ///< l
  std::vector<float> acc;                               ///< dv floats

  explicit SoftmaxState(std::size_t value_dim) : acc(value_dim, 0.0f) {}

  /// Folds other into this state: the result equals one pass over both subsets. A NaN in either
  /// (a score that left the float range) stays NaN, so the merged answer fails as one pass would.
  void merge(const SoftmaxState& other) {
    if (other.sum == 0.0f) return;
    if (sum == 0.0f) {
      *this = other;
      return;
    }
    const float m = max > other.max ? max : other.max;
    const float a = std::exp(max - m);
    const float b = std::exp(other.max - m);
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = acc[i] * a + other.acc[i] * b;
    sum = sum * a + other.sum * b;
    max = m;
  }

  /// log sum_i exp(s_i) over the rows folded in.
  [[nodiscard]] double lse() const { return static_cast<double>(max) + std::log(static_cast<double>(sum)); }
};

}  // namespace softkv::detail
