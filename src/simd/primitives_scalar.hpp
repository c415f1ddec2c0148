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

  // Batched blocks are lane-major: queries are lanes, qt is d x lanes, s is rows x lanes.

  // s[r * lanes + b] = sum_i k[r * d + i] * qt[i * lanes + b].
  static void scores_block(const float* qt, std::size_t lanes, const float* k, std::size_t rows, std::size_t d,
                           float* s) {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < lanes; ++b) {
        float dot = 0.0f;
        for (std::size_t i = 0; i < d; ++i) dot += k[r * d + i] * qt[i * lanes + b];
        s[r * lanes + b] = dot;
      }
  }

  // s[r * lanes + b] *= factor[b].
  static void scale_columns(float* s, std::size_t rows, std::size_t lanes, const float* factor) {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < lanes; ++b) s[r * lanes + b] *= factor[b];
  }

  // out[b] = max over the rows of s[r * lanes + b].
  static void column_max(const float* s, std::size_t rows, std::size_t lanes, float* out) {
    for (std::size_t b = 0; b < lanes; ++b) out[b] = -std::numeric_limits<float>::infinity();
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < lanes; ++b) out[b] = s[r * lanes + b] > out[b] ? s[r * lanes + b] : out[b];
  }

  // top[b] = max and total[b] = sum over the rows of s[r * lanes + b]. A finite total proves the
  // column finite (an inf or NaN element makes the sum inf or NaN); an inf total may also come from
  // finite elements whose sum overflowed.
  static void column_max_sum(const float* s, std::size_t rows, std::size_t lanes, float* top, float* total) {
    for (std::size_t b = 0; b < lanes; ++b) top[b] = -std::numeric_limits<float>::infinity(), total[b] = 0.0f;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < lanes; ++b) {
        top[b] = s[r * lanes + b] > top[b] ? s[r * lanes + b] : top[b];
        total[b] += s[r * lanes + b];
      }
  }

  // s[r * lanes + b] = exp(s[r * lanes + b] - shift[b]) in place; sums[b] = the column's sum.
  static void exp_columns(float* s, std::size_t rows, std::size_t lanes, const float* shift, float* sums) {
    for (std::size_t b = 0; b < lanes; ++b) sums[b] = 0.0f;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < lanes; ++b) {
        float& x = s[r * lanes + b];
        x = std::exp(x - shift[b]);
        sums[b] += x;
      }
  }

  // acc[b * dv + c] += sum_r w[r * lanes + b] * v[r * dv + c] for the first nq lanes.
  static void blend_block(const float* w, std::size_t lanes, std::size_t nq, const float* v, std::size_t rows,
                          std::size_t dv, float* acc) {
    for (std::size_t b = 0; b < nq; ++b)
      for (std::size_t r = 0; r < rows; ++r) axpy(acc + b * dv, w[r * lanes + b], v + r * dv, dv);
  }
};

}  // namespace softkv::detail
