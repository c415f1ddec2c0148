// CRC-32 (zlib's polynomial) of byte spans: the checksum of log records, snapshots and index files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace softkv::detail {

/// CRC-32 (zlib's polynomial, as crc32(3)) of bytes; any length.
std::uint32_t crc32_of(std::span<const std::byte> bytes);

}  // namespace softkv::detail
