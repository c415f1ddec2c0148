// CRC-32 through zlib, fed in pieces because zlib takes 32-bit lengths.
#include "codec/crc32.hpp"

#include <zlib.h>

#include <algorithm>

namespace softkv::detail {

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (!bytes.empty()) {
    const std::size_t n = std::min<std::size_t>(bytes.size(), 1u << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(n));
    bytes = bytes.subspan(n);
  }
  return static_cast<std::uint32_t>(crc);
}

}  // namespace softkv::detail
