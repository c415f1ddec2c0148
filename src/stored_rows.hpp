// StoredRows: one column of a collection's storage (its keys or its values), row-major at one precision.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "aligned_buffer.hpp"
#include "precision.hpp"

namespace softkv::detail {

/// Rows of `width` elements stored at one Precision, with one scale per row for i8. Inputs are float32
/// within the precision's range (the caller checks with check_range); set() rounds them to nearest.
class StoredRows {
 public:
  StoredRows(Precision precision, std::size_t width) : precision_(precision), width_(width), row_bytes_(width * element_bytes(precision)) {}

  [[nodiscard]] Precision precision() const noexcept { return precision_; }
  [[nodiscard]] std::size_t row_bytes() const noexcept { return row_bytes_; }
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// The first row's bytes; row r starts row_bytes() * r further.
  [[nodiscard]] const std::byte* data() const noexcept { return bytes_.data(); }
  /// One scale per row for i8, else null.
  [[nodiscard]] const float* scales() const noexcept { return precision_ == Precision::i8 ? scales_.data() : nullptr; }

  void reserve(std::size_t rows) {
    bytes_.reserve(rows * row_bytes_);
    if (precision_ == Precision::i8) scales_.reserve(rows);
  }
  void resize(std::size_t rows) {
    bytes_.resize(rows * row_bytes_);
    if (precision_ == Precision::i8) scales_.resize(rows);
    rows_ = rows;
  }
  /// Stores x (width floats) as row r, rounded to the precision.
  void set(std::size_t r, const float* x) {
    const float scale = precision_ == Precision::i8 ? i8_scale(x, width_) : 1.0f;
    if (precision_ == Precision::i8) scales_[r] = scale;
    encode_row(precision_, x, width_, scale, bytes_.data() + r * row_bytes_);
  }
  /// Copies row from over row to (removal moves the last row into a hole).
  void copy_row(std::size_t from, std::size_t to) {
    std::copy_n(bytes_.data() + from * row_bytes_, row_bytes_, bytes_.data() + to * row_bytes_);
    if (precision_ == Precision::i8) scales_[to] = scales_[from];
  }
  /// Row r as float32 (exactly what the kernels compute with).
  void get(std::size_t r, float* out) const {
    decode_row(precision_, bytes_.data() + r * row_bytes_, width_, precision_ == Precision::i8 ? scales_[r] : 1.0f, out);
  }

 private:
  Precision precision_;
  std::size_t width_;
  std::size_t row_bytes_;
  std::size_t rows_ = 0;
  std::vector<std::byte, CacheAlignedAllocator<std::byte>> bytes_;
  std::vector<float> scales_;
};

}  // namespace softkv::detail
