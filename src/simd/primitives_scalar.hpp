// Scalar primitives: the portable reference path (compiled without auto-vectorisation).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "precision.hpp"

namespace softkv::detail {

struct ScalarPrimitives {
  // Compact rows to float32 (exact): the portable conversions of precision.cpp.
  static void widen_f16(const std::uint16_t* h, std::size_t n, float* out) {
    for (std::size_t i = 0; i < n; ++i) out[i] = from_f16(h[i]);
  }
  static void widen_bf16(const std::uint16_t* h, std::size_t n, float* out) {
    for (std::size_t i = 0; i < n; ++i) out[i] = from_bf16(h[i]);
  }
  static void widen_i8(const std::int8_t* q, std::size_t n, float scale, float* out) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }

  // a . row, the row stored at precision Pr (for i8, times row_scale) and converted element by element.
  template <Precision Pr>
  static float dot_as(const float* a, const void* row, std::size_t n, float row_scale, bool /*defer*/ = false) {
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i) s += a[i] * element_as_float<Pr>(row, i, row_scale);
    return s;
  }

  static float dot(const float* a, const float* b, std::size_t n) { return dot_as<Precision::f32>(a, b, n, 1.0f); }

  // This path scales every i8 element (dot_as ignores defer): no row is deferred.
  static I8Deferral i8_deferral(const float* /*a*/, std::size_t /*n*/) { return {}; }

  // The scans score heads one dot_as at a time on this path (no joint reduction).
  static constexpr bool kJointHeads = false;

  // Every head's blend: head j's columns [j * dvh, (j + 1) * dvh) with weights w + j * stride.
  template <Precision Pr>
  static void blend_heads(float* acc, const float* w, std::size_t stride, std::size_t heads, const void* v,
                          std::size_t rows, std::size_t dv) {
    const std::size_t dvh = dv / heads;
    for (std::size_t j = 0; j < heads; ++j) blend_rows<Pr>(acc, w + j * stride, v, rows, dv, j * dvh, (j + 1) * dvh);
  }

  // u[c] += v[r * dv + c], sv[c] += s[r] * v[r * dv + c], a[c] += |v[r * dv + c]| and sq[c] += (v[r * dv + c] -
  // centre[c])^2 for rows [0, rows) in order, v stored at Pr.
  template <Precision Pr>
  static void value_sums(const float* s, const void* v, std::size_t rows, std::size_t dv, float* u, float* sv, float* a,
                         const float* centre, float* sq) {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < dv; ++c) {
        const float x = element_as_float<Pr>(v, r * dv + c, 1.0f), e = x - centre[c];
        u[c] += x;
        sv[c] += s[r] * x;
        a[c] += std::fabs(x);
        sq[c] += e * e;
      }
  }

  // acc[c] += w[r] * v[r * dv + c] for rows [0, rows) in order and columns [c0, c1), v stored at Pr.
  template <Precision Pr>
  static void blend_rows(float* acc, const float* w, const void* v, std::size_t rows, std::size_t dv, std::size_t c0,
                         std::size_t c1) {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = c0; c < c1; ++c) acc[c] += w[r] * element_as_float<Pr>(v, r * dv + c, 1.0f);
  }

  static float max(const float* x, std::size_t n) {
    float m = -std::numeric_limits<float>::infinity();
    for (std::size_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }

  // Whether every x[i] is finite.
  static bool all_finite(const float* x, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isfinite(x[i])) return false;
    return true;
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
