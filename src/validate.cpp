// Boundary checks with messages that name the offending vector and element.
#include "validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "softkv/error.hpp"

namespace softkv::detail {

std::string float_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

void check_dimension(std::size_t got, std::size_t want, std::string_view what) {
  if (got != want)
    throw Error(ErrorCode::dimension_mismatch,
                std::string(what) + " has " + std::to_string(got) + " floats, expected " + std::to_string(want));
}

void check_finite(std::span<const float> values, std::string_view what, std::size_t row_width) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i])) continue;
    std::string where = row_width > 0 ? "row " + std::to_string(i / row_width) + ", element " + std::to_string(i % row_width)
                                      : "element " + std::to_string(i);
    throw Error(ErrorCode::non_finite, std::string(what) + " holds " + (std::isnan(values[i]) ? "NaN" : "an infinity") +
                                           " at " + where);
  }
}

std::size_t row_count(std::size_t size, std::size_t width, std::string_view what) {
  if (size % width != 0)
    throw Error(ErrorCode::dimension_mismatch, std::string(what) + " has " + std::to_string(size) +
                                                   " floats, not a multiple of the row width " + std::to_string(width));
  return size / width;
}

void normalise_rows(std::span<float> rows, std::size_t row_width, std::string_view what, std::size_t heads) {
  const std::size_t d = row_width / heads;  // one slice per head
  for (std::size_t r = 0; r * d < rows.size(); ++r) {
    float* x = rows.data() + r * d;
    // Dividing by the largest |x| first keeps the squares in range whatever the row's magnitude
    // (a float norm would underflow below ~1e-19 and overflow above ~1e19; 1 / norm of a key
    // below ~3e-39 overflows even in double-then-float).
    double largest = 0.0;
    for (std::size_t i = 0; i < d; ++i) largest = std::max(largest, std::fabs(static_cast<double>(x[i])));
    if (!(largest > 0.0) && heads == 1)
      throw Error(ErrorCode::invalid_argument,
                  std::string(what) + " row " + std::to_string(r) + " is a zero vector: it has no direction for cosine");
    if (!(largest > 0.0)) {
      const std::size_t row = r / heads, head = r % heads;
      throw Error(ErrorCode::invalid_argument,
                  std::string(what) + " row " + std::to_string(row) + ": head " + std::to_string(head) + "'s slice (elements " +
                      std::to_string(head * d) + " .. " + std::to_string((head + 1) * d - 1) +
                      ") is all zero: a multi-head cosine collection normalises each head's slice on its own, so every "
                      "slice needs a direction");
    }
    double norm2 = 0.0;
    for (std::size_t i = 0; i < d; ++i) {
      const double y = static_cast<double>(x[i]) / largest;
      norm2 += y * y;
    }
    const double norm = std::sqrt(norm2);  // in [1, sqrt(d)]
    for (std::size_t i = 0; i < d; ++i) x[i] = static_cast<float>(static_cast<double>(x[i]) / largest / norm);
  }
}

void normalise_rows_v1(std::span<float> rows, std::size_t d, std::string_view what) {
  for (std::size_t r = 0; r * d < rows.size(); ++r) {
    const std::span<float> row = rows.subspan(r * d, d);
    double norm2 = 0.0;
    for (float x : row) norm2 += static_cast<double>(x) * x;
    const auto inv = static_cast<float>(1.0 / std::sqrt(norm2));
    if (norm2 > 0.0 && std::isfinite(inv)) {
      for (float& x : row) x *= inv;
    } else {
      normalise_rows(row, d, what);
    }
  }
}

}  // namespace softkv::detail
