// The batched (lane-major) tile kernels of the xsimd primitives: the two products of a batch pass as
// outer products on register tiles, and the column-wise softmax steps between them. XsimdPrimitives
// (primitives_xsimd.hpp) inherits them; primitives_scalar.hpp states the semantics.
#pragma once

#include <cstddef>
#include <limits>

#include <xsimd/xsimd.hpp>

namespace softkv::detail {

/// Lane-major batch tiles for one xsimd Arch (queries are lanes).
template <class Arch>
struct XsimdBatchTiles {
  using V = xsimd::batch<float, Arch>;
  static constexpr std::size_t W = V::size;

  static V load(const float* p) { return V::load_unaligned(p); }

  // Batched blocks are lane-major (queries are lanes; see primitives_scalar.hpp for the semantics).
  // Both products are outer products on register tiles: no horizontal sums. A tile is kTileRows
  // (key rows, or queries in the blend) x kTileVecs vectors of accumulators, sized to the register
  // file: 32 vector registers (avx512) hold 4 x 4; with 16, avx2 uses 4 x 2, while sse2, whose
  // broadcast takes two instructions and which has no FMA, does better with fewer rows: 2 x 4.
  static constexpr std::size_t kTileRows = W == 4 ? 2 : 4;
  static constexpr std::size_t kTileVecs = W == 8 ? 2 : 4;

  // R rows x NV vectors of lanes: s[r][lanes] = sum_i k[r][i] * qt[i][lanes].
  template <std::size_t R, std::size_t NV>
  static void scores_tile(const float* qt, std::size_t lanes, const float* k, std::size_t d, float* s) {
    V c[R][NV];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < NV; ++j) c[r][j] = V(0.0f);
    for (std::size_t i = 0; i < d; ++i) {
      V y[NV];
      for (std::size_t j = 0; j < NV; ++j) y[j] = load(qt + i * lanes + j * W);
      for (std::size_t r = 0; r < R; ++r) {
        const V x(k[r * d + i]);
        for (std::size_t j = 0; j < NV; ++j) c[r][j] = xsimd::fma(x, y[j], c[r][j]);
      }
    }
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < NV; ++j) c[r][j].store_unaligned(s + r * lanes + j * W);
  }

  // R rows across all lanes: whole tiles, then the remaining 1..kTileVecs-1 vectors.
  template <std::size_t R>
  static void scores_rows(const float* qt, std::size_t lanes, const float* k, std::size_t d, float* s) {
    const std::size_t vecs = lanes / W;
    std::size_t v = 0;
    for (; v + kTileVecs <= vecs; v += kTileVecs) scores_tile<R, kTileVecs>(qt + v * W, lanes, k, d, s + v * W);
    const std::size_t left = vecs - v;
    if (left == 1) scores_tile<R, 1>(qt + v * W, lanes, k, d, s + v * W);
    if constexpr (kTileVecs > 2)
      if (left == 2) scores_tile<R, 2>(qt + v * W, lanes, k, d, s + v * W);
    if constexpr (kTileVecs > 3)
      if (left == 3) scores_tile<R, 3>(qt + v * W, lanes, k, d, s + v * W);
  }

  static void scores_block(const float* qt, std::size_t lanes, const float* k, std::size_t rows, std::size_t d,
                           float* s) {
    std::size_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) scores_rows<kTileRows>(qt, lanes, k + r * d, d, s + r * lanes);
    for (; r < rows; ++r) scores_rows<1>(qt, lanes, k + r * d, d, s + r * lanes);
  }

  static void scale_columns(float* s, std::size_t rows, std::size_t lanes, const float* factor) {
    for (std::size_t b = 0; b < lanes; b += W) {
      const V f = load(factor + b);
      for (std::size_t r = 0; r < rows; ++r) (load(s + r * lanes + b) * f).store_unaligned(s + r * lanes + b);
    }
  }

  static void column_max(const float* s, std::size_t rows, std::size_t lanes, float* out) {
    for (std::size_t b = 0; b < lanes; b += W) {
      V m(-std::numeric_limits<float>::infinity());
      for (std::size_t r = 0; r < rows; ++r) m = xsimd::max(m, load(s + r * lanes + b));
      m.store_unaligned(out + b);
    }
  }

  static void column_max_sum(const float* s, std::size_t rows, std::size_t lanes, float* top, float* total) {
    for (std::size_t b = 0; b < lanes; b += W) {
      V m(-std::numeric_limits<float>::infinity());
      V t(0.0f);
      for (std::size_t r = 0; r < rows; ++r) {
        const V x = load(s + r * lanes + b);
        m = xsimd::max(m, x);
        t += x;
      }
      m.store_unaligned(top + b);
      t.store_unaligned(total + b);
    }
  }

  static void exp_columns(float* s, std::size_t rows, std::size_t lanes, const float* shift, float* sums) {
    for (std::size_t b = 0; b < lanes; b += W) {
      const V sh = load(shift + b);
      V total(0.0f);
      for (std::size_t r = 0; r < rows; ++r) {
        const V e = xsimd::exp(load(s + r * lanes + b) - sh);
        e.store_unaligned(s + r * lanes + b);
        total += e;
      }
      total.store_unaligned(sums + b);
    }
  }

  // Q accumulators x CV vectors of columns, over all rows: acc[q][c..] += w[r][q] * v[r][c..].
  template <std::size_t Q, std::size_t CV>
  static void blend_tile(const float* w, std::size_t lanes, const float* v, std::size_t rows, std::size_t dv,
                         float* acc) {
    V a[Q][CV];
    for (std::size_t q = 0; q < Q; ++q)
      for (std::size_t j = 0; j < CV; ++j) a[q][j] = load(acc + q * dv + j * W);
    for (std::size_t r = 0; r < rows; ++r) {
      V x[CV];
      for (std::size_t j = 0; j < CV; ++j) x[j] = load(v + r * dv + j * W);
      for (std::size_t q = 0; q < Q; ++q) {
        const V y(w[r * lanes + q]);
        for (std::size_t j = 0; j < CV; ++j) a[q][j] = xsimd::fma(y, x[j], a[q][j]);
      }
    }
    for (std::size_t q = 0; q < Q; ++q)
      for (std::size_t j = 0; j < CV; ++j) a[q][j].store_unaligned(acc + q * dv + j * W);
  }

  // Q accumulators across all dv columns: whole tiles, single vectors, then a scalar tail.
  template <std::size_t Q>
  static void blend_queries(const float* w, std::size_t lanes, const float* v, std::size_t rows, std::size_t dv,
                            float* acc) {
    std::size_t c = 0;
    for (; c + kTileVecs * W <= dv; c += kTileVecs * W) blend_tile<Q, kTileVecs>(w, lanes, v + c, rows, dv, acc + c);
    for (; c + W <= dv; c += W) blend_tile<Q, 1>(w, lanes, v + c, rows, dv, acc + c);
    for (; c < dv; ++c)
      for (std::size_t q = 0; q < Q; ++q) {
        float t = acc[q * dv + c];
        for (std::size_t r = 0; r < rows; ++r) t += w[r * lanes + q] * v[r * dv + c];
        acc[q * dv + c] = t;
      }
  }

  static void blend_block(const float* w, std::size_t lanes, std::size_t nq, const float* v, std::size_t rows,
                          std::size_t dv, float* acc) {
    constexpr std::size_t Q = kTileRows;
    std::size_t b = 0;
    for (; b + Q <= nq; b += Q) blend_queries<Q>(w + b, lanes, v, rows, dv, acc + b * dv);
    for (; b < nq; ++b) blend_queries<1>(w + b, lanes, v, rows, dv, acc + b * dv);
  }
};

}  // namespace softkv::detail
