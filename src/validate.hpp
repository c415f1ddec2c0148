// Input checks at the library boundary: dimensions, finiteness, parameters; each throws a typed Error.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace softkv::detail {

/// A float as text for an error message, with the digits to tell it apart (e.g. "-1e-09", not
/// std::to_string's "-0.000000").
std::string float_text(double x);

/// Throws Error(dimension_mismatch) unless got == want; what names the vector ("query", "key", ...).
void check_dimension(std::size_t got, std::size_t want, std::string_view what);

/// Throws Error(non_finite) naming the first NaN/Inf element; row_width > 0 reports "row r, element e".
void check_finite(std::span<const float> values, std::string_view what, std::size_t row_width = 0);

/// Number of rows in a row-major matrix of width; throws Error(dimension_mismatch) if size % width != 0.
std::size_t row_count(std::size_t size, std::size_t width, std::string_view what);

/// Scales each of the rows (row-major, width d) to unit length in place; with heads > 1, each row's
/// h slices of d / h elements on their own (a multi-head cosine collection). Works for every finite
/// row, however tiny or huge its elements (it divides by the largest |x| first, in double), so a
/// normalised row is always finite. Throws Error(invalid_argument) naming `what`, the row and (with
/// heads > 1) the head and its elements for a zero row or slice: it has no direction.
void normalise_rows(std::span<float> rows, std::size_t d, std::string_view what, std::size_t heads = 1);

/// normalise_rows as releases before 0.2 computed it (k * float(1 / sqrt(sum k^2 in double))), for
/// replaying their log records bit for bit; rows where that overflows (norms below ~1e-38) take
/// normalise_rows' way instead, since the old way stored a non-finite key there.
void normalise_rows_v1(std::span<float> rows, std::size_t d, std::string_view what);

}  // namespace softkv::detail
