// Compact element formats (f16, bf16, i8 keys): the portable float32 <-> stored conversions every kernel path must match.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "softkv/precision.hpp"

namespace softkv::detail {

/// Bytes one element takes at precision p (4, 2, 2, 1).
constexpr std::size_t element_bytes(Precision p) noexcept { return p == Precision::f32 ? 4 : p == Precision::i8 ? 1 : 2; }

/// The name used in configs, the CLI and errors: "f32", "f16", "bf16", "i8".
std::string_view precision_name(Precision p) noexcept;

/// The largest magnitude a write may have at precision p (f16: 65504; bf16: the largest finite bf16;
/// i8: 127 * 2^121, about 3.376e38; f32: FLT_MAX). Larger inputs are refused rather than stored as infinity.
float max_magnitude(Precision p) noexcept;

/// IEEE binary16 bits of x, rounded to nearest even (x must be within max_magnitude(f16)).
std::uint16_t to_f16(float x) noexcept;
/// The float32 that the binary16 bits h stand for (exact).
float from_f16(std::uint16_t h) noexcept;
/// bfloat16 bits of x, rounded to nearest even (x must be within max_magnitude(bf16)).
std::uint16_t to_bf16(float x) noexcept;
/// The float32 that the bfloat16 bits h stand for (exact: h << 16).
inline float from_bf16(std::uint16_t h) noexcept {
  const std::uint32_t bits = std::uint32_t{h} << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

/// Element i of a stored array at precision Pr as float32 (exact; for i8, times scale): the scalar
/// form of what every kernel path converts in registers.
template <Precision Pr>
inline float element_as_float(const void* base, std::size_t i, float scale) noexcept {
  if constexpr (Pr == Precision::f32) return static_cast<const float*>(base)[i];
  else if constexpr (Pr == Precision::f16) return from_f16(static_cast<const std::uint16_t*>(base)[i]);
  else if constexpr (Pr == Precision::bf16) return from_bf16(static_cast<const std::uint16_t*>(base)[i]);
  else return static_cast<float>(static_cast<const std::int8_t*>(base)[i]) * scale;
}

/// The i8 row scales for which a kernel may sum a query's products with a row's stored integers and
/// scale the sum once (the same bits as scaling every element): s in [lo, hi]; empty by default.
struct I8Deferral {
  float lo = 1.0f;  ///< smallest scale covered
  float hi = 0.0f;  ///< largest scale covered
  /// Whether a row of scale s is covered.
  [[nodiscard]] bool covers(float s) const noexcept { return s >= lo && s <= hi; }
};

/// The i8 scale of a row: the smallest power of two s with max|x| / s <= 127 (1 for an all-zero row).
/// A power of two makes q * s exact in float32, so dequantising and quantising again returns the same
/// row: snapshots, replay and the FAISS copies all see the same numbers.
float i8_scale(const float* row, std::size_t n) noexcept;

/// Stores n floats (already within range) at precision p into dst (n * element_bytes(p) bytes);
/// for i8, scale is the row's i8_scale.
void encode_row(Precision p, const float* src, std::size_t n, float scale, std::byte* dst) noexcept;
/// Reads n stored elements back as float32 (exact; for i8, q * scale).
void decode_row(Precision p, const std::byte* src, std::size_t n, float scale, float* dst) noexcept;

/// Throws Error(invalid_argument) naming the first element of rows x n floats whose magnitude exceeds
/// max_magnitude(p); what names the field ("keys", "values").
void check_range(Precision p, const float* data, std::size_t rows, std::size_t n, std::string_view what);

}  // namespace softkv::detail
