// The AVX-512 integer dot products (int_dots.hpp): one body, compiled twice, each in a translation unit
// with its own instruction sets (int_dots_avx512bw.cpp; int_dots_avx512vnni.cpp adds VNNI), so that the
// BW path never holds an instruction a CPU without VNNI lacks.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace softkv::detail {

/// int_dots.hpp's IntDots with AVX512-BW (pmaddwd) and with AVX512-VNNI (vpdpwssd).
void int_dots_avx512bw(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out);
void int_dots_avx512vnni(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out);

#if defined(__AVX512BW__) && defined(__AVX512VL__)
namespace avx512_int {

// acc + the pairwise products of q and k summed into int32 lanes.
inline __m512i madd_into(__m512i acc, __m512i q, __m512i k) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, q, k);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(q, k));
#endif
}

// 32 int8 elements from p, widened to int16 (mask: the elements to read, the others 0).
inline __m512i widen(const std::int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i widen(const std::int8_t* p, __mmask32 mask) { return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p)); }

// The four accumulators' lane sums, together: halves added, then pairwise sums across the rows.
inline __m128i sum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const auto half = [](__m512i a) { return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)); };
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(half(a0), half(a1)), _mm256_hadd_epi32(half(a2), half(a3)));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// 32 elements a step, four rows at a time sharing the query's loads; the last d % 32 through masked loads.
inline void dots(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out) {
  const std::size_t whole = d - d % 32;
  const auto tail = static_cast<__mmask32>((std::uint64_t{1} << (d % 32)) - 1);
  std::size_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const std::int8_t* k = rows + r * d;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (std::size_t j = 0; j < whole; j += 32) {
      const __m512i qv = _mm512_loadu_si512(q + j);
      a0 = madd_into(a0, qv, widen(k + j));
      a1 = madd_into(a1, qv, widen(k + d + j));
      a2 = madd_into(a2, qv, widen(k + 2 * d + j));
      a3 = madd_into(a3, qv, widen(k + 3 * d + j));
    }
    if (tail != 0) {
      const __m512i qv = _mm512_maskz_loadu_epi16(tail, q + whole);
      a0 = madd_into(a0, qv, widen(k + whole, tail));
      a1 = madd_into(a1, qv, widen(k + d + whole, tail));
      a2 = madd_into(a2, qv, widen(k + 2 * d + whole, tail));
      a3 = madd_into(a3, qv, widen(k + 3 * d + whole, tail));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r), sum4(a0, a1, a2, a3));
  }
  for (; r < n; ++r) {
    const std::int8_t* k = rows + r * d;
    __m512i a = _mm512_setzero_si512();
    for (std::size_t j = 0; j < whole; j += 32) a = madd_into(a, _mm512_loadu_si512(q + j), widen(k + j));
    if (tail != 0) a = madd_into(a, _mm512_maskz_loadu_epi16(tail, q + whole), widen(k + whole, tail));
    out[r] = _mm512_reduce_add_epi32(a);
  }
}

}  // namespace avx512_int
#endif

}  // namespace softkv::detail
