// softkv::Precision: the element types a collection may store its keys and values in (compact storage).
#pragma once

#include <cstdint>

namespace softkv {

/// How a collection stores keys or values (inputs and queries are float32 either way; scores
/// accumulate in float32). docs/PRECISION.md, "Compact storage", gives each one's error bound.
enum class Precision : std::uint8_t {
  f32 = 0,   ///< IEEE binary32, as given (the default)
  f16 = 1,   ///< IEEE binary16: 11-bit significand, |x| <= 65504 (larger is an error at the write)
  bf16 = 2,  ///< bfloat16: 8-bit significand, float32's exponent range
  i8 = 3,    ///< keys only: int8 times one power-of-two scale per row (cosine keys are normalised first)
};

}  // namespace softkv
