// Little-endian encoding into and out of byte buffers, every read bounds-checked (logs, snapshots, index files, frames).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "softkv/error.hpp"

namespace softkv::detail {

static_assert(std::endian::native == std::endian::little, "softkv's file formats are little-endian");

/// Appends trivially copyable values and arrays to a byte vector.
class ByteWriter {
 public:
  template <class T>
  void put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_array(std::span<const T> values) {
    if (values.empty()) return;  // nothing to copy (and no zero-length copy from a null pointer)
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size_bytes());
  }
  /// A string as u16 length + bytes.
  void put_string(std::string_view s) {
    put(static_cast<std::uint16_t>(s.size()));
    put_array(std::span<const char>(s.data(), s.size()));
  }
  [[nodiscard]] std::vector<std::byte>& bytes() noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

/// Reads values back; any read past the end throws Error(code) naming what was being read
/// (corrupt_file for files, protocol_error for wire frames).
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> bytes, ErrorCode code = ErrorCode::corrupt_file) : bytes_(bytes), code_(code) {}

  template <class T>
  T get(std::string_view what) {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    std::memcpy(&value, take(sizeof(T), what).data(), sizeof(T));
    return value;
  }
  /// count elements of T; the byte count is checked against what is left before anything is allocated.
  template <class T>
  std::span<const std::byte> take_array(std::uint64_t count, std::string_view what) {
    if (count > remaining() / sizeof(T)) fail(what);
    return take(static_cast<std::size_t>(count) * sizeof(T), what);
  }
  std::string get_string(std::string_view what) {
    const auto n = get<std::uint16_t>(what);
    const auto b = take(n, what);
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - at_; }
  [[nodiscard]] std::size_t offset() const noexcept { return at_; }
  /// The code its errors carry.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  std::span<const std::byte> take(std::size_t n, std::string_view what) {
    if (n > remaining()) fail(what);
    const auto b = bytes_.subspan(at_, n);
    at_ += n;
    return b;
  }
  [[noreturn]] void fail(std::string_view what) const {
    throw Error(code_, "truncated or oversized " + std::string(what) + " at byte " + std::to_string(at_));
  }

  std::span<const std::byte> bytes_;
  ErrorCode code_;
  std::size_t at_ = 0;
};

/// Copies an array of T out of bytes taken with ByteReader::take_array.
template <class T>
std::vector<T> to_vector(std::span<const std::byte> bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));  // memcpy(null, ..., 0) is UB
  return out;
}

}  // namespace softkv::detail
