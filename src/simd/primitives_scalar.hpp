// Scalar primitives: the portable reference path (compiled without auto-vectorisation).
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>

namespace softkv::detail {

struct ScalarPrimitives {
  static float dot(const float* a, const float* b, std::size_t n) {
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  static float max(const float* x, std::size_t n) {
    float m = -std::numeric_limits<float>::infinity();
    for (std::size_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }

  // w[i] = exp(s[i] - shift); returns the sum of w.
  static float exp_shifted(const float* s, std::size_t n, float shift, float* w) {
    float sum = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      w[i] = std::exp(s[i] - shift);
      sum += w[i];
    }
    return sum;
  }

  static void scale(float* x, float factor, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) x[i] *= factor;
  }

  // acc += w * v
  static void axpy(float* acc, float w, const float* v, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) acc[i] += w * v[i];
  }

  // s[b * ld + r] = q_b . k_r for nq queries and rows keys.
  static void scores_block(const float* q, std::size_t nq, const float* k, std::size_t rows, std::size_t d,
                           float* s, std::size_t ld) {
    for (std::size_t b = 0; b < nq; ++b)
      for (std::size_t r = 0; r < rows; ++r) s[b * ld + r] = dot(q + b * d, k + r * d, d);
  }

  // acc_b += sum_r w[b * ld + r] v_r for nq accumulators of dv floats.
  static void blend_block(const float* w, std::size_t ld, std::size_t nq, const float* v, std::size_t rows,
                          std::size_t dv, float* acc) {
    for (std::size_t b = 0; b < nq; ++b)
      for (std::size_t r = 0; r < rows; ++r) axpy(acc + b * dv, w[b * ld + r], v + r * dv, dv);
  }
};

}  // namespace softkv::detail
