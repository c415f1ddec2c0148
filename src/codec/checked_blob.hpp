// Checked blobs: the one file header of snapshots and index files (magic, version, length, CRC-32).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace softkv::detail {

/// Header layout: 8-byte magic, u32 format version, u64 payload length, u32 payload CRC-32.
inline constexpr std::size_t kBlobHeaderSize = 8 + 4 + 8 + 4;

/// A blob whose header, length and checksum were verified.
struct OpenedBlob {
  std::uint32_t version = 0;             ///< the format version the writer recorded
  std::span<const std::byte> payload;    ///< the checked payload (a view into the input)
};

/// The file bytes of payload under an 8-character magic and a format version.
std::vector<std::byte> seal_blob(std::string_view magic, std::uint32_t version, std::span<const std::byte> payload);

/// Verifies magic, length and CRC-32; throws Error(corrupt_file) "<file> at byte N: <problem>".
/// The version is returned unchecked: each format decides which versions it reads.
OpenedBlob open_blob(std::span<const std::byte> bytes, std::string_view magic, const std::string& file);

}  // namespace softkv::detail
