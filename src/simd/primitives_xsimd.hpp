// SIMD primitives written once with xsimd; each kernels_<arch>.cpp instantiates them for its Arch.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>

#include <xsimd/xsimd.hpp>

namespace softkv::detail {

template <class Arch>
struct XsimdPrimitives {
  using V = xsimd::batch<float, Arch>;
  static constexpr std::size_t W = V::size;

  static V load(const float* p) { return V::load_unaligned(p); }

  static float dot(const float* a, const float* b, std::size_t n) {
    V s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);  // four chains hide the FMA latency
    std::size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      s0 = xsimd::fma(load(a + i), load(b + i), s0);
      s1 = xsimd::fma(load(a + i + W), load(b + i + W), s1);
      s2 = xsimd::fma(load(a + i + 2 * W), load(b + i + 2 * W), s2);
      s3 = xsimd::fma(load(a + i + 3 * W), load(b + i + 3 * W), s3);
    }
    for (; i + W <= n; i += W) s0 = xsimd::fma(load(a + i), load(b + i), s0);
    float s = xsimd::hadd((s0 + s1) + (s2 + s3));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  static float max(const float* x, std::size_t n) {
    float m = -std::numeric_limits<float>::infinity();
    std::size_t i = 0;
    if (n >= W) {
      V mv = load(x);
      for (i = W; i + W <= n; i += W) mv = xsimd::max(mv, load(x + i));
      alignas(64) float lanes[W];
      mv.store_aligned(lanes);
      for (std::size_t j = 0; j < W; ++j) m = lanes[j] > m ? lanes[j] : m;
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }

  // w[i] = exp(s[i] - shift); returns the sum of w.
  static float exp_shifted(const float* s, std::size_t n, float shift, float* w) {
    const V sh(shift);
    V acc(0.0f);
    std::size_t i = 0;
    for (; i + W <= n; i += W) {
      const V e = xsimd::exp(load(s + i) - sh);
      e.store_unaligned(w + i);
      acc += e;
    }
    float sum = xsimd::hadd(acc);
    for (; i < n; ++i) {
      w[i] = std::exp(s[i] - shift);
      sum += w[i];
    }
    return sum;
  }

  static void scale(float* x, float factor, std::size_t n) {
    const V f(factor);
    std::size_t i = 0;
    for (; i + W <= n; i += W) (load(x + i) * f).store_unaligned(x + i);
    for (; i < n; ++i) x[i] *= factor;
  }

  // acc += w * v
  static void axpy(float* acc, float w, const float* v, std::size_t n) {
    const V wv(w);
    std::size_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      xsimd::fma(wv, load(v + i), load(acc + i)).store_unaligned(acc + i);
      xsimd::fma(wv, load(v + i + W), load(acc + i + W)).store_unaligned(acc + i + W);
    }
    for (; i + W <= n; i += W) xsimd::fma(wv, load(v + i), load(acc + i)).store_unaligned(acc + i);
    for (; i < n; ++i) acc[i] += w * v[i];
  }

  // s[b * ld + r] = q_b . k_r. Register blocking: 4 queries x 2 keys share each load.
  static void scores_block(const float* q, std::size_t nq, const float* k, std::size_t rows, std::size_t d,
                           float* s, std::size_t ld) {
    std::size_t b = 0;
    for (; b + 4 <= nq; b += 4) {
      const float* q0 = q + b * d;
      std::size_t r = 0;
      for (; r + 2 <= rows; r += 2) {
        const float* k0 = k + r * d;
        const float* k1 = k0 + d;
        V c00(0.0f), c01(0.0f), c10(0.0f), c11(0.0f), c20(0.0f), c21(0.0f), c30(0.0f), c31(0.0f);
        std::size_t i = 0;
        for (; i + W <= d; i += W) {
          const V x0 = load(k0 + i), x1 = load(k1 + i);
          const V y0 = load(q0 + i), y1 = load(q0 + d + i), y2 = load(q0 + 2 * d + i), y3 = load(q0 + 3 * d + i);
          c00 = xsimd::fma(y0, x0, c00), c01 = xsimd::fma(y0, x1, c01);
          c10 = xsimd::fma(y1, x0, c10), c11 = xsimd::fma(y1, x1, c11);
          c20 = xsimd::fma(y2, x0, c20), c21 = xsimd::fma(y2, x1, c21);
          c30 = xsimd::fma(y3, x0, c30), c31 = xsimd::fma(y3, x1, c31);
        }
        float t[8] = {xsimd::hadd(c00), xsimd::hadd(c01), xsimd::hadd(c10), xsimd::hadd(c11),
                      xsimd::hadd(c20), xsimd::hadd(c21), xsimd::hadd(c30), xsimd::hadd(c31)};
        for (; i < d; ++i) {
          for (std::size_t j = 0; j < 4; ++j) {
            t[2 * j] += q0[j * d + i] * k0[i];
            t[2 * j + 1] += q0[j * d + i] * k1[i];
          }
        }
        for (std::size_t j = 0; j < 4; ++j) {
          s[(b + j) * ld + r] = t[2 * j];
          s[(b + j) * ld + r + 1] = t[2 * j + 1];
        }
      }
      for (; r < rows; ++r)
        for (std::size_t j = 0; j < 4; ++j) s[(b + j) * ld + r] = dot(q0 + j * d, k + r * d, d);
    }
    for (; b < nq; ++b)
      for (std::size_t r = 0; r < rows; ++r) s[b * ld + r] = dot(q + b * d, k + r * d, d);
  }

  // acc_b += sum_r w[b * ld + r] v_r. Register blocking: 4 accumulators x 2 vectors per value load.
  static void blend_block(const float* w, std::size_t ld, std::size_t nq, const float* v, std::size_t rows,
                          std::size_t dv, float* acc) {
    std::size_t b = 0;
    for (; b + 4 <= nq; b += 4) {
      float* a = acc + b * dv;
      const float* w0 = w + b * ld;
      std::size_t c = 0;
      for (; c + 2 * W <= dv; c += 2 * W) {
        V a00 = load(a + c), a01 = load(a + c + W);
        V a10 = load(a + dv + c), a11 = load(a + dv + c + W);
        V a20 = load(a + 2 * dv + c), a21 = load(a + 2 * dv + c + W);
        V a30 = load(a + 3 * dv + c), a31 = load(a + 3 * dv + c + W);
        for (std::size_t r = 0; r < rows; ++r) {
          const V x0 = load(v + r * dv + c), x1 = load(v + r * dv + c + W);
          const V y0(w0[r]), y1(w0[ld + r]), y2(w0[2 * ld + r]), y3(w0[3 * ld + r]);
          a00 = xsimd::fma(y0, x0, a00), a01 = xsimd::fma(y0, x1, a01);
          a10 = xsimd::fma(y1, x0, a10), a11 = xsimd::fma(y1, x1, a11);
          a20 = xsimd::fma(y2, x0, a20), a21 = xsimd::fma(y2, x1, a21);
          a30 = xsimd::fma(y3, x0, a30), a31 = xsimd::fma(y3, x1, a31);
        }
        a00.store_unaligned(a + c), a01.store_unaligned(a + c + W);
        a10.store_unaligned(a + dv + c), a11.store_unaligned(a + dv + c + W);
        a20.store_unaligned(a + 2 * dv + c), a21.store_unaligned(a + 2 * dv + c + W);
        a30.store_unaligned(a + 3 * dv + c), a31.store_unaligned(a + 3 * dv + c + W);
      }
      if (c < dv) {  // the last dv % (2W) columns, one row at a time
        for (std::size_t j = 0; j < 4; ++j)
          for (std::size_t r = 0; r < rows; ++r) {
            const float wr = w0[j * ld + r];
            for (std::size_t cc = c; cc < dv; ++cc) a[j * dv + cc] += wr * v[r * dv + cc];
          }
      }
    }
    for (; b < nq; ++b)
      for (std::size_t r = 0; r < rows; ++r) axpy(acc + b * dv, w[b * ld + r], v + r * dv, dv);
  }
};

}  // namespace softkv::detail
