// Test helpers for running a test on every SIMD kernel path the machine has.
#pragma once

#include <catch2/catch.hpp>

#include <string>
#include <string_view>

#include "softkv/simd.hpp"

namespace softkv::test {

/// Forces a kernel path for the life of the object, then restores the one before.
struct ForcedPath {
  std::string previous{simd_path()};
  explicit ForcedPath(std::string_view name) { force_simd_path(name); }
  ~ForcedPath() { force_simd_path(previous); }
};

/// A Catch2 generator over every path this machine has (scalar, sse2, avx2, avx512): the test runs once per path.
inline std::string any_path() {
  const auto paths = available_simd_paths();
  return std::string(GENERATE_COPY(from_range(paths.begin(), paths.end())));
}

}  // namespace softkv::test
