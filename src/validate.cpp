// Boundary checks with messages that name the offending vector and element.
#include "validate.hpp"

#include <cmath>
#include <string>

#include "softkv/error.hpp"

namespace softkv::detail {

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

}  // namespace softkv::detail
