// Exact integer dot products of a query quantised to int16 with int8 rows (the i8 centroids of the
// certified lists): the bound pass of a walk scores every centroid for every query, and integer
// multiply-adds (pmaddwd, vpdpwssd) do it in a third of the float path's instructions, with no
// rounding to account for (the query's quantisation error is added to the bounds instead).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace softkv::detail {

/// out[r] = sum over j < d of q[j] * rows[r * d + j], exactly, for r < n. Requires every partial sum to
/// fit an int32: d * max|q[j]| * 128 < 2^31 (int_query_limit).
using IntDots = void (*)(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out);

/// One implementation of IntDots and whether this CPU runs it.
struct IntDotPath {
  std::string_view name;  ///< "avx512vnni", "avx512bw", "avx2", "generic"
  IntDots dots;           ///< the function
  bool supported;         ///< whether this CPU has its instructions
};

/// Every implementation, widest first (tests compare each supported one with "generic").
std::span<const IntDotPath> int_dot_paths();

/// The implementation for the active kernel path (kernels().name): the widest the CPU runs within that
/// path's instruction sets (avx512: VNNI, else BW, else avx2; avx2: avx2; sse2 and scalar: generic).
IntDots int_dots();

/// The largest |q[j]| for which d-element dot products with int8 rows cannot overflow an int32
/// (0 when d is too large for any).
std::int32_t int_query_limit(std::size_t d) noexcept;

}  // namespace softkv::detail
