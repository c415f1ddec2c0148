// SIMD primitives written once with xsimd; each kernels_<arch>.cpp instantiates them for its Arch.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include <immintrin.h>
#include <xsimd/xsimd.hpp>

#include "kernel_table.hpp"
#include "precision.hpp"
#include "primitives_xsimd_batch.hpp"

namespace softkv::detail {

/// The primitives policy of scan_algorithms.hpp for one xsimd Arch: the single-query kernels here, the
/// batched (lane-major) tiles inherited from XsimdBatchTiles.
template <class Arch>
struct XsimdPrimitives : XsimdBatchTiles<Arch> {
  using V = xsimd::batch<float, Arch>;
  static constexpr std::size_t W = V::size;
  static_assert(kBatchLanes % W == 0, "batched kernels step through the lanes a whole vector at a time");

  static V load(const float* p) { return V::load_unaligned(p); }
  static V fma(V a, V b, V c) { return xsimd::fma(a, b, c); }

  // Compact rows to float32, exactly, in registers: each TU compiles the widest form its flags allow
  // (AVX-512F vcvtph2ps / vpmovzxwd / vpmovsxbd; F16C and AVX2 on the avx2 path; SSE2 unpacks, with
  // the portable f16 decoder, on the sse2 path). The tails use the portable conversions.
  static void widen_f16(const std::uint16_t* h, std::size_t n, float* out) {
    std::size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
    for (; i < n; ++i) out[i] = from_f16(h[i]);
  }

  static void widen_bf16(const std::uint16_t* h, std::size_t n, float* out) {
    std::size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i)));
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
    }
#elif defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
      _mm_storeu_ps(out + i, _mm_castsi128_ps(_mm_unpacklo_epi16(zero, x)));
      _mm_storeu_ps(out + i + 4, _mm_castsi128_ps(_mm_unpackhi_epi16(zero, x)));
    }
#endif
    for (; i < n; ++i) out[i] = from_bf16(h[i]);
  }

  static void widen_i8(const std::int8_t* q, std::size_t n, float scale, float* out) {
    std::size_t i = 0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(x), s));
    }
#elif defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(x), s));
    }
#elif defined(__SSE2__)
    const __m128 s = _mm_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      const __m128i lo = _mm_unpacklo_epi8(x, x), hi = _mm_unpackhi_epi8(x, x);  // each byte in a 16-bit lane's top
      const __m128i parts[4] = {_mm_unpacklo_epi16(lo, lo), _mm_unpackhi_epi16(lo, lo), _mm_unpacklo_epi16(hi, hi),
                                _mm_unpackhi_epi16(hi, hi)};  // each byte in a 32-bit lane's top
      for (int j = 0; j < 4; ++j) _mm_storeu_ps(out + i + 4 * j, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(parts[j], 24)), s));
    }
#endif
    for (; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }

  // W elements of a stored array from index i, widened to float32 in registers (exactly; i8 times
  // scale): AVX-512F vcvtph2ps / vpmovzxwd / vpmovsxbd on the avx512 path, F16C and AVX2 on the avx2
  // path, SSE2 unpacks on the sse2 path (f16 there through the portable decoder).
  // kScaled = false: i8 elements as their stored integers (scale unused), for sums scaled once (chains_as).
  template <Precision Pr, bool kScaled = true>
  static V load_as(const void* base, std::size_t i, float scale) {
    if constexpr (Pr == Precision::f32) {
      return load(static_cast<const float*>(base) + i);
    } else if constexpr (Pr == Precision::f16) {
      [[maybe_unused]] const auto* h = static_cast<const std::uint16_t*>(base) + i;
#if defined(__AVX512F__)
      if constexpr (W == 16) return V(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
#endif
#if defined(__F16C__)
      if constexpr (W == 8) return V(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
#endif
      alignas(64) float t[W];
      for (std::size_t j = 0; j < W; ++j) t[j] = from_f16(h[j]);
      return V::load_aligned(t);
    } else if constexpr (Pr == Precision::bf16) {
      const auto* h = static_cast<const std::uint16_t*>(base) + i;
      if constexpr (W == 16) {
#if defined(__AVX512F__)
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
        return V(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
#endif
      } else if constexpr (W == 8) {
#if defined(__AVX2__)
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
        return V(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
#endif
      } else {
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h));
        return V(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), x)));
      }
    } else {
      const auto* q = static_cast<const std::int8_t*>(base) + i;
      if constexpr (W == 16) {
#if defined(__AVX512F__)
        const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        return kScaled ? V(_mm512_cvtepi32_ps(x)) * V(scale) : V(_mm512_cvtepi32_ps(x));
#endif
      } else if constexpr (W == 8) {
#if defined(__AVX2__)
        const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
        return kScaled ? V(_mm256_cvtepi32_ps(x)) * V(scale) : V(_mm256_cvtepi32_ps(x));
#endif
      } else {
        int bits;
        std::memcpy(&bits, q, 4);
        __m128i x = _mm_cvtsi32_si128(bits);
        x = _mm_unpacklo_epi8(x, x);   // each byte in a 16-bit lane's top
        x = _mm_unpacklo_epi16(x, x);  // ... in a 32-bit lane's top
        const V f(_mm_cvtepi32_ps(_mm_srai_epi32(x, 24)));
        return kScaled ? f * V(scale) : f;
      }
    }
  }

  // a * b + c for the scalar tails: one rounding where the instruction set has FMA, so a tail rounds
  // the same whether the compiler would have vectorised its products (f32 rows) or not (compact rows).
  static float madd(float a, float b, float c) {
#if defined(__FMA__)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
  }

  // The sum of a vector's lanes by halving (upper half onto lower half, then again): one shuffle and
  // one add a step, fewer instructions than xsimd::hadd's horizontal adds; every single-query score
  // goes through it, so they all round alike.
  static float reduce(V v) {
    __m128 x;
    if constexpr (W == 16) {
#if defined(__AVX512F__)
      const __m512 z = v;
      const __m256 lo = _mm512_castps512_ps256(z);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
      const __m256 y = _mm256_add_ps(lo, hi);
      x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
#endif
    } else if constexpr (W == 8) {
#if defined(__AVX__)
      const __m256 y = v;
      x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
#endif
    } else {
      x = v;
    }
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }

  // The vector part of a . row over its first n - n % W elements (four chains hide the FMA latency),
  // the chains added in a fixed order; dot_as reduces it and adds the tail. For i8 rows with defer
  // (the row's scale inside the query's i8_deferral window), the chains sum the products with the
  // stored integers and the sum is scaled once: the same bits as scaling every element (a power of two
  // commutes with each rounding while every value stays in the normal range, which the window ensures),
  // one multiply a row instead of one a vector.
  template <Precision Pr>
  [[gnu::always_inline]] static V chains_as(const float* a, const void* row, std::size_t n, float row_scale, bool defer = false) {
    if constexpr (Pr == Precision::i8)
      if (defer) return chains_of<Pr, false>(a, row, n, row_scale) * V(row_scale);
    return chains_of<Pr, true>(a, row, n, row_scale);
  }

  // chains_as for two rows at once, each with its own chains in the same order (so the same bits as
  // two calls), sharing each load of a: a row costs 1.5 loads a vector instead of 2. defer: both rows'.
  template <Precision Pr>
  [[gnu::always_inline]] static void chains2_as(const float* a, const void* row0, const void* row1, std::size_t n,
                                                float scale0, float scale1, V& out0, V& out1, bool defer = false) {
    if constexpr (Pr == Precision::i8) {
      if (defer) {
        chains2_of<Pr, false>(a, row0, row1, n, scale0, scale1, out0, out1);
        out0 = out0 * V(scale0);
        out1 = out1 * V(scale1);
        return;
      }
    }
    chains2_of<Pr, true>(a, row0, row1, n, scale0, scale1, out0, out1);
  }

  // Where an i8 row's products may be summed unscaled (chains_as' defer) for the query a of n floats.
  // With g the spacing of the floats as small as a's smallest nonzero |a_i|, every sum of products with
  // integers is a multiple of g (scaled: of g * s), so no value is rounded among the subnormals when
  // g * min(1, s) >= 2^-149; and nothing overflows while the sums' bound 127 * n * max|a_i| * max(1, s)
  // stays below 2^126 (a factor 4 below FLT_MAX for the roundings).
  static I8Deferral i8_deferral(const float* a, std::size_t n) {
    const V inf(std::numeric_limits<float>::infinity());
    V big(0.0f), small = inf;
    std::size_t i = 0;
    for (; i + W <= n; i += W) {
      const V x = xsimd::abs(load(a + i));
      big = xsimd::max(big, x);
      small = xsimd::min(small, xsimd::select(x == V(0.0f), inf, x));
    }
    alignas(64) float bl[W], sl[W];
    big.store_aligned(bl);
    small.store_aligned(sl);
    float mx = 0.0f, mn = std::numeric_limits<float>::infinity();
    for (std::size_t j = 0; j < W; ++j) {
      mx = std::max(mx, bl[j]);
      mn = std::min(mn, sl[j]);
    }
    for (; i < n; ++i) {
      const float x = std::fabs(a[i]);
      mx = std::max(mx, x);
      if (x != 0.0f) mn = std::min(mn, x);
    }
    I8Deferral w;
    if (mx == 0.0f) return {0.0f, std::numeric_limits<float>::infinity()};  // every product is a zero
    const double bound = 127.0 * static_cast<double>(n) * mx;
    if (!(bound <= 0x1p126)) return w;  // (a NaN or infinite query too: empty)
    w.hi = static_cast<float>(std::min(0x1p126 / bound, static_cast<double>(std::numeric_limits<float>::max())));
    if (mn < std::numeric_limits<float>::min()) {
      w.lo = 1.0f;  // g = 2^-149 already: only scales >= 1
    } else {
      int e;
      std::frexp(mn, &e);  // mn in [2^(e-1), 2^e): g = 2^(e - 24), g * s >= 2^-149 for s >= 2^(-125 - e)
      w.lo = std::ldexp(1.0f, std::max(-125 - e, -149));
    }
    return w;
  }

  // chains_as' loop: kScaled false sums the products with i8 rows' stored integers (the caller scales).
  template <Precision Pr, bool kScaled>
  [[gnu::always_inline]] static V chains_of(const float* a, const void* row, std::size_t n, float row_scale) {
    V s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);
    std::size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      s0 = xsimd::fma(load(a + i), load_as<Pr, kScaled>(row, i, row_scale), s0);
      s1 = xsimd::fma(load(a + i + W), load_as<Pr, kScaled>(row, i + W, row_scale), s1);
      s2 = xsimd::fma(load(a + i + 2 * W), load_as<Pr, kScaled>(row, i + 2 * W, row_scale), s2);
      s3 = xsimd::fma(load(a + i + 3 * W), load_as<Pr, kScaled>(row, i + 3 * W, row_scale), s3);
    }
    for (; i + W <= n; i += W) s0 = xsimd::fma(load(a + i), load_as<Pr, kScaled>(row, i, row_scale), s0);
    return (s0 + s1) + (s2 + s3);
  }

  // chains2_as' loop, kScaled as in chains_of.
  template <Precision Pr, bool kScaled>
  [[gnu::always_inline]] static void chains2_of(const float* a, const void* row0, const void* row1, std::size_t n,
                                                float scale0, float scale1, V& out0, V& out1) {
    V s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f), t0(0.0f), t1(0.0f), t2(0.0f), t3(0.0f);
    std::size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      const V a0 = load(a + i), a1 = load(a + i + W), a2 = load(a + i + 2 * W), a3 = load(a + i + 3 * W);
      s0 = xsimd::fma(a0, load_as<Pr, kScaled>(row0, i, scale0), s0);
      t0 = xsimd::fma(a0, load_as<Pr, kScaled>(row1, i, scale1), t0);
      s1 = xsimd::fma(a1, load_as<Pr, kScaled>(row0, i + W, scale0), s1);
      t1 = xsimd::fma(a1, load_as<Pr, kScaled>(row1, i + W, scale1), t1);
      s2 = xsimd::fma(a2, load_as<Pr, kScaled>(row0, i + 2 * W, scale0), s2);
      t2 = xsimd::fma(a2, load_as<Pr, kScaled>(row1, i + 2 * W, scale1), t2);
      s3 = xsimd::fma(a3, load_as<Pr, kScaled>(row0, i + 3 * W, scale0), s3);
      t3 = xsimd::fma(a3, load_as<Pr, kScaled>(row1, i + 3 * W, scale1), t3);
    }
    for (; i + W <= n; i += W) {
      const V a0 = load(a + i);
      s0 = xsimd::fma(a0, load_as<Pr, kScaled>(row0, i, scale0), s0);
      t0 = xsimd::fma(a0, load_as<Pr, kScaled>(row1, i, scale1), t0);
    }
    out0 = (s0 + s1) + (s2 + s3);
    out1 = (t0 + t1) + (t2 + t3);
  }

  // a . row, the row stored at precision Pr and widened in registers; the same chains and reduction
  // for every precision, so a compact row scores what its float32 widening scores.
  template <Precision Pr>
  static float dot_as(const float* a, const void* row, std::size_t n, float row_scale, bool defer = false) {
    float s = reduce(chains_as<Pr>(a, row, n, row_scale, defer));
    for (std::size_t i = n - n % W; i < n; ++i) s = madd(a[i], element_as_float<Pr>(row, i, row_scale), s);
    return s;
  }

  static float dot(const float* a, const float* b, std::size_t n) { return dot_as<Precision::f32>(a, b, n, 1.0f); }

  // Whether this instruction set has reduce8 and transpose_heads (avx2 and avx512); the scans score
  // heads one horizontal sum at a time where it has not.
  static constexpr bool kJointHeads = W == 16 || W == 8;

  // Eight vectors summed lane by lane together, times eight scales: out[j] = scales[j] * reduce(v[j])
  // bit for bit. The same pairs of lanes are added in the same order as reduce adds them (upper half
  // onto lower half, then again), but each shuffle and add serves two to eight vectors at once, and
  // the eight sums leave as one 8-float store.
  static void reduce8(const V* v, const float* scales, float* out) {
    __m256 sums;
    if constexpr (W == 16) {
#if defined(__AVX512F__)
      __m512 y[4], x[2];
      for (int k = 0; k < 4; ++k) {  // lane i + 8 onto lane i: two vectors' 256-bit halves side by side
        const __m512 a = v[2 * k], b = v[2 * k + 1];
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
      }
      for (int k = 0; k < 2; ++k)  // lane i + 4 onto lane i: 128-bit chunk c now holds vector 4k + c
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
      // lane 2 onto 0 and 3 onto 1, then lane 1 onto 0: chunk c ends as [v[c], v[c + 4], ...]
      const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
      const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z, z, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
      sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), f));
#endif
    } else if constexpr (W == 8) {
#if defined(__AVX2__)
      __m256 x[4], z[2];
      for (int k = 0; k < 4; ++k) {  // lane i + 4 onto lane i: 128-bit chunk c now holds vector 2k + c
        const __m256 a = v[2 * k], b = v[2 * k + 1];
        x[k] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
      }
      for (int k = 0; k < 2; ++k)  // lane 2 onto 0, 3 onto 1
        z[k] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      // lane 1 onto 0: chunk 0 ends as vectors 0, 2, 4, 6 and chunk 1 as 1, 3, 5, 7
      const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
      sums = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_loadu_ps(scales), sums));
  }

  // Rows x heads scores stored row by row (heads a multiple of 8, row r at in + r * heads) to head by
  // head (head j's at out + j * stride), 8 x 8 floats at a time.
  static void transpose_heads(const float* in, std::size_t rows, std::size_t heads, float* out, std::size_t stride) {
    std::size_t r = 0;
#if defined(__AVX__)
    for (; r + 8 <= rows; r += 8)
      for (std::size_t g = 0; g < heads; g += 8) {
        __m256 t[8], u[8];
        for (int i = 0; i < 8; ++i) t[i] = _mm256_loadu_ps(in + (r + i) * heads + g);
        for (int i = 0; i < 8; i += 2) {
          u[i] = _mm256_unpacklo_ps(t[i], t[i + 1]);
          u[i + 1] = _mm256_unpackhi_ps(t[i], t[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
          t[i] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
          t[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
          t[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
          t[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int j = 0; j < 4; ++j) {  // t[j] holds head g + j (lanes 0-3) and g + 4 + j (lanes 4-7) of rows r..r+3
          _mm256_storeu_ps(out + (g + j) * stride + r, _mm256_permute2f128_ps(t[j], t[j + 4], 0x20));
          _mm256_storeu_ps(out + (g + j + 4) * stride + r, _mm256_permute2f128_ps(t[j], t[j + 4], 0x31));
        }
      }
#endif
    for (; r < rows; ++r)
      for (std::size_t j = 0; j < heads; ++j) out[j * stride + r] = in[r * heads + j];
  }

  // Accumulators kept in registers across the rows of a blend: 8 vectors (128 floats on avx512).
  static constexpr std::size_t kBlendVecs = 8;

  // CV vectors of columns from c, over rows [0, rows): acc[c..] += w[r] * v[r][c..], the accumulators
  // in registers (loaded and stored once per call, not once per row).
  template <Precision Pr, std::size_t CV>
  static void blend_cols(float* acc, const float* w, const void* v, std::size_t rows, std::size_t dv, std::size_t c) {
    V a[CV];
    for (std::size_t j = 0; j < CV; ++j) a[j] = load(acc + c + j * W);
    for (std::size_t r = 0; r < rows; ++r) {
      const V wv(w[r]);
      for (std::size_t j = 0; j < CV; ++j) a[j] = xsimd::fma(wv, load_as<Pr>(v, r * dv + c + j * W, 1.0f), a[j]);
    }
    for (std::size_t j = 0; j < CV; ++j) a[j].store_unaligned(acc + c + j * W);
  }

  // The same over several heads' columns at once: vector j of the tile (columns c + jW ..) belongs to
  // head (c + jW) / dvh and takes its weights from w + head * stride. A tile spans heads, so short head
  // slices (dvh = 64 is 4 vectors on avx512) still keep kBlendVecs independent accumulators busy.
  template <Precision Pr, std::size_t CV>
  static void blend_cols_heads(float* acc, const float* w, std::size_t stride, std::size_t dvh, const void* v,
                               std::size_t rows, std::size_t dv, std::size_t c) {
    const float* wj[CV];
    V a[CV];
    for (std::size_t j = 0; j < CV; ++j) {
      wj[j] = w + (c + j * W) / dvh * stride;
      a[j] = load(acc + c + j * W);
    }
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < CV; ++j) a[j] = xsimd::fma(V(wj[j][r]), load_as<Pr>(v, r * dv + c + j * W, 1.0f), a[j]);
    for (std::size_t j = 0; j < CV; ++j) a[j].store_unaligned(acc + c + j * W);
  }

  // The same when a head slice is VPH vectors (VPH divides CV): one broadcast per head in the tile
  // and row instead of one per vector.
  template <Precision Pr, std::size_t CV, std::size_t VPH>
  static void blend_cols_heads_even(float* acc, const float* w, std::size_t stride, std::size_t dvh, const void* v,
                                    std::size_t rows, std::size_t dv, std::size_t c) {
    static_assert(CV % VPH == 0, "a tile holds whole head slices");
    constexpr std::size_t H = CV / VPH;
    const float* wh[H];
    V a[CV];
    for (std::size_t h = 0; h < H; ++h) wh[h] = w + (c + h * VPH * W) / dvh * stride;
    for (std::size_t j = 0; j < CV; ++j) a[j] = load(acc + c + j * W);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t h = 0; h < H; ++h) {
        const V wv(wh[h][r]);
        for (std::size_t k = 0; k < VPH; ++k)
          a[h * VPH + k] = xsimd::fma(wv, load_as<Pr>(v, r * dv + c + (h * VPH + k) * W, 1.0f), a[h * VPH + k]);
      }
    for (std::size_t j = 0; j < CV; ++j) a[j].store_unaligned(acc + c + j * W);
  }

  // Every head's blend over rows [0, rows): head j's columns [j * dvh, (j + 1) * dvh) with weights
  // w + j * stride. When a head slice is whole vectors, tiles span heads; otherwise head by head.
  template <Precision Pr>
  static void blend_heads(float* acc, const float* w, std::size_t stride, std::size_t heads, const void* v,
                          std::size_t rows, std::size_t dv) {
    const std::size_t dvh = dv / heads;
    if (heads == 1 || dvh % W != 0) {
      for (std::size_t j = 0; j < heads; ++j) blend_rows<Pr>(acc, w + j * stride, v, rows, dv, j * dvh, (j + 1) * dvh);
      return;
    }
    std::size_t c = 0;
    const std::size_t vph = dvh / W;
    for (; c + kBlendVecs * W <= dv; c += kBlendVecs * W) {
      if (vph == 1) blend_cols_heads_even<Pr, kBlendVecs, 1>(acc, w, stride, dvh, v, rows, dv, c);
      else if (vph == 2) blend_cols_heads_even<Pr, kBlendVecs, 2>(acc, w, stride, dvh, v, rows, dv, c);
      else if (vph == 4) blend_cols_heads_even<Pr, kBlendVecs, 4>(acc, w, stride, dvh, v, rows, dv, c);
      else blend_cols_heads<Pr, kBlendVecs>(acc, w, stride, dvh, v, rows, dv, c);
    }
    for (; c < dv; c += W) blend_cols_heads<Pr, 1>(acc, w, stride, dvh, v, rows, dv, c);
  }

  // u[c] += v[r * dv + c], sv[c] += s[r] * v[r * dv + c], a[c] += |v[r * dv + c]| and sq[c] += (v[r * dv + c] -
  // centre[c])^2 for rows [0, rows) in order and every column, v stored at Pr: one read of each value for
  // the four sums (the block sample's control variates, the bound on their rounding, its unseen spread).
  // Columns in groups of CV vectors, five live per vector (four sums and the centre) besides the row's
  // value, its offset and the score: CV = 4 on avx512 (32 vector registers: 23 live), 2 elsewhere.
  template <Precision Pr>
  static void value_sums(const float* s, const void* v, std::size_t rows, std::size_t dv, float* u, float* sv, float* a,
                         const float* centre, float* sq) {
    constexpr std::size_t CV = W >= 16 ? kBlendVecs / 2 : kBlendVecs / 4;
    std::size_t c = 0;
    for (; c + CV * W <= dv; c += CV * W) value_sums_cols<Pr, CV>(s, v, rows, dv, c, u, sv, a, centre, sq);
    if constexpr (CV > 2)  // (dv = 32, 96 on avx512: two vectors at a time before one)
      for (; c + 2 * W <= dv; c += 2 * W) value_sums_cols<Pr, 2>(s, v, rows, dv, c, u, sv, a, centre, sq);
    for (; c + W <= dv; c += W) value_sums_cols<Pr, 1>(s, v, rows, dv, c, u, sv, a, centre, sq);
    for (; c < dv; ++c)
      for (std::size_t r = 0; r < rows; ++r) {
        const float x = element_as_float<Pr>(v, r * dv + c, 1.0f), e = x - centre[c];
        u[c] += x;
        sv[c] = madd(s[r], x, sv[c]);
        a[c] += std::fabs(x);
        sq[c] = madd(e, e, sq[c]);
      }
  }
  template <Precision Pr, std::size_t CV>
  static void value_sums_cols(const float* s, const void* v, std::size_t rows, std::size_t dv, std::size_t c, float* u,
                              float* sv, float* a, const float* centre, float* sq) {
    V su[CV], ssv[CV], sa[CV], ssq[CV], mid[CV];
    for (std::size_t j = 0; j < CV; ++j) {
      su[j] = load(u + c + j * W), ssv[j] = load(sv + c + j * W), sa[j] = load(a + c + j * W);
      ssq[j] = load(sq + c + j * W), mid[j] = load(centre + c + j * W);
    }
    for (std::size_t r = 0; r < rows; ++r) {
      const V sr(s[r]);
      for (std::size_t j = 0; j < CV; ++j) {
        const V x = load_as<Pr>(v, r * dv + c + j * W, 1.0f), e = x - mid[j];
        su[j] += x;
        ssv[j] = xsimd::fma(sr, x, ssv[j]);
        sa[j] += xsimd::abs(x);
        ssq[j] = xsimd::fma(e, e, ssq[j]);
      }
    }
    for (std::size_t j = 0; j < CV; ++j) {
      su[j].store_unaligned(u + c + j * W), ssv[j].store_unaligned(sv + c + j * W), sa[j].store_unaligned(a + c + j * W);
      ssq[j].store_unaligned(sq + c + j * W);
    }
  }

  // acc[c] += w[r] * v[r * dv + c] for rows [0, rows) in order and columns [c0, c1), v stored at Pr:
  // per element the same fused multiply-adds in the same order as a row-by-row acc += w[r] * v[r].
  template <Precision Pr>
  static void blend_rows(float* acc, const float* w, const void* v, std::size_t rows, std::size_t dv, std::size_t c0,
                         std::size_t c1) {
    std::size_t c = c0;
    for (; c + kBlendVecs * W <= c1; c += kBlendVecs * W) blend_cols<Pr, kBlendVecs>(acc, w, v, rows, dv, c);
    for (; c + W <= c1; c += W) blend_cols<Pr, 1>(acc, w, v, rows, dv, c);
    for (; c < c1; ++c)
      for (std::size_t r = 0; r < rows; ++r) acc[c] = madd(w[r], element_as_float<Pr>(v, r * dv + c, 1.0f), acc[c]);
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

  // Whether every x[i] is finite: x * 0 is 0 for a finite x and NaN for an infinite or NaN one, so
  // fused into two sums they stay 0 exactly when every element is finite (no compare per vector).
  static bool all_finite(const float* x, std::size_t n) {
    const V zero(0.0f);
    V a = zero, b = zero;
    std::size_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
      a = xsimd::fma(load(x + i), zero, a);
      b = xsimd::fma(load(x + i + W), zero, b);
    }
    if (i + W <= n) a = xsimd::fma(load(x + i), zero, a), i += W;
    float t = xsimd::hadd(a + b);
    for (; i < n; ++i) t += x[i] * 0.0f;
    return t == 0.0f;
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
};

}  // namespace softkv::detail
