// Compact element conversions: round-to-nearest-even encoders and exact decoders (the reference for the kernels).
#include "precision.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

std::uint32_t bits_of(float x) noexcept {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

}  // namespace

std::string_view precision_name(Precision p) noexcept {
  switch (p) {
    case Precision::f32: return "f32";
    case Precision::f16: return "f16";
    case Precision::bf16: return "bf16";
    case Precision::i8: return "i8";
  }
  return "unknown";
}

float max_magnitude(Precision p) noexcept {
  if (p == Precision::f16) return 65504.0f;
  if (p == Precision::bf16) return from_bf16(0x7F7F);  // 0x1.FEp127: anything above rounds to infinity or to it
  if (p == Precision::i8) return std::ldexp(127.0f, 121);  // above, the scale would be 2^122 and 64 * 2^122 is infinity
  return std::numeric_limits<float>::max();
}

std::uint16_t to_f16(float x) noexcept {
  const std::uint32_t b = bits_of(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);  // NaN (never stored: inputs are checked)
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to infinity (>= 65520)
  if (a < 0x38800000u) {  // below 2^-14: a binary16 subnormal, a multiple of 2^-24
    // Adding 0.5 puts the value's 2^-24 multiples in the low mantissa bits, rounded to nearest even by the FPU.
    float f;
    std::memcpy(&f, &a, 4);
    f += 0.5f;
    return static_cast<std::uint16_t>(sign | (bits_of(f) - 0x3F000000u));
  }
  const std::uint32_t odd = (a >> 13) & 1u;  // round to nearest even on the 13 dropped bits
  return static_cast<std::uint16_t>(sign | ((a + 0xC8000FFFu + odd) >> 13));  // rebias 127 -> 15: -(112 << 23)
}

float from_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t man = h & 0x3FFu;
  float f;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const std::uint32_t b = exp == 0x1F ? sign | 0x7F800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
  std::memcpy(&f, &b, 4);
  return f;
}

std::uint16_t to_bf16(float x) noexcept {
  const std::uint32_t b = bits_of(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((b >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

float i8_scale(const float* row, std::size_t n) noexcept {
  float m = 0.0f;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(row[i]));
  if (!(m > 0.0f)) return 1.0f;
  int e = 0;
  std::frexp(m, &e);  // m < 2^e, so m / 2^(e-7) < 128
  int k = std::max(e - 7, -149);
  if (m > 127.0f * std::ldexp(1.0f, k)) ++k;
  return std::ldexp(1.0f, k);
}

void encode_row(Precision p, const float* src, std::size_t n, float scale, std::byte* dst) noexcept {
  switch (p) {
    case Precision::f32:
      std::memcpy(dst, src, n * 4);
      return;
    case Precision::f16:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = to_f16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case Precision::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case Precision::i8:
      for (std::size_t i = 0; i < n; ++i) {
        const float q = std::nearbyint(src[i] / scale);  // exact division by a power of two; |q| <= 127
        dst[i] = static_cast<std::byte>(static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f)));
      }
      return;
  }
}

void decode_row(Precision p, const std::byte* src, std::size_t n, float scale, float* dst) noexcept {
  std::uint16_t h;
  switch (p) {
    case Precision::f32:
      std::memcpy(dst, src, n * 4);
      return;
    case Precision::f16:
      for (std::size_t i = 0; i < n; ++i) {
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = from_f16(h);
      }
      return;
    case Precision::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = from_bf16(h);
      }
      return;
    case Precision::i8:
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<std::int8_t>(src[i])) * scale;
      return;
  }
}

void check_range(Precision p, const float* data, std::size_t rows, std::size_t n, std::string_view what) {
  const float limit = max_magnitude(p);
  if (limit == std::numeric_limits<float>::max()) return;
  for (std::size_t i = 0; i < rows * n; ++i)
    if (std::fabs(data[i]) > limit)
      throw Error(ErrorCode::invalid_argument,
                  std::string(what) + "[" + std::to_string(i / n) + "][" + std::to_string(i % n) + "] = " + std::to_string(data[i]) +
                      " is outside the range of " + std::string(precision_name(p)) + " storage (|x| <= " + std::to_string(limit) + ")");
}

}  // namespace softkv::detail
