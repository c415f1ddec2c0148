// The integer dot products (int_dots.hpp), per instruction set, chosen at run time: AVX2 here through a
// function attribute (the file builds without ISA flags), AVX-512 in its own translation units
// (int_dots_avx512.hpp); a CPU only ever runs what it has.
#include "int_dots.hpp"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <limits>

#include "int_dots_avx512.hpp"
#include "kernel_table.hpp"

namespace softkv::detail {
namespace {

void dots_generic(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out) {
  for (std::size_t r = 0; r < n; ++r) {
    const std::int8_t* k = rows + r * d;
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < d; ++j) sum += static_cast<std::int32_t>(q[j]) * k[j];
    out[r] = sum;
  }
}

// The horizontal sum of eight int32 lanes.
__attribute__((target("avx2"))) inline std::int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 16 elements a step (pmaddwd pairs products into int32 lanes), two rows at a time sharing the query's
// loads; the last d % 16 elements in scalar code.
__attribute__((target("avx2"))) void dots_avx2(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d,
                                                std::int32_t* out) {
  const std::size_t whole = d - d % 16;
  std::size_t r = 0;
  for (; r + 2 <= n; r += 2) {
    const std::int8_t* k0 = rows + r * d;
    const std::int8_t* k1 = k0 + d;
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (std::size_t j = 0; j < whole; j += 16) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j));
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(qv, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + j)))));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(qv, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + j)))));
    }
    std::int32_t s0 = sum_lanes(a0), s1 = sum_lanes(a1);
    for (std::size_t j = whole; j < d; ++j) s0 += static_cast<std::int32_t>(q[j]) * k0[j], s1 += static_cast<std::int32_t>(q[j]) * k1[j];
    out[r] = s0;
    out[r + 1] = s1;
  }
  if (r < n) dots_generic(q, rows + r * d, n - r, d, out + r);
}

// The paths, widest first, with what this CPU runs read at first use (not during static
// initialisation, which may run before the compiler's CPU detection).
std::span<const IntDotPath> paths() {
  static const auto table = [] {
    __builtin_cpu_init();
    const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return std::array<IntDotPath, 4>{IntDotPath{"avx512vnni", &int_dots_avx512vnni, bw && __builtin_cpu_supports("avx512vnni")},
                                     IntDotPath{"avx512bw", &int_dots_avx512bw, bw},
                                     IntDotPath{"avx2", &dots_avx2, __builtin_cpu_supports("avx2") != 0},
                                     IntDotPath{"generic", &dots_generic, true}};
  }();
  return table;
}

IntDots widest_within(std::string_view kernel_path) {
  // The integer paths each kernel path may take (its own instruction sets and narrower).
  const bool avx512 = kernel_path == "avx512", avx2 = avx512 || kernel_path == "avx2";
  for (const IntDotPath& p : paths()) {
    if (!p.supported) continue;
    if (p.name.starts_with("avx512") && !avx512) continue;
    if (p.name == "avx2" && !avx2) continue;
    return p.dots;
  }
  return &dots_generic;
}

}  // namespace

std::span<const IntDotPath> int_dot_paths() { return paths(); }

IntDots int_dots() { return widest_within(kernels().name); }

std::int32_t int_query_limit(std::size_t d) noexcept {
  // |sum| <= d * max|q| * 128 (int8 down to -128) must stay below 2^31.
  if (d == 0) return std::numeric_limits<std::int16_t>::max();
  const std::uint64_t limit = ((std::uint64_t{1} << 31) - 1) / (static_cast<std::uint64_t>(d) * 128);
  return static_cast<std::int32_t>(std::min<std::uint64_t>(limit, std::numeric_limits<std::int16_t>::max()));
}

}  // namespace softkv::detail
