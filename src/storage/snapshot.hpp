// Snapshot files: every collection's entries at one log sequence number, in a checksummed cereal payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "softkv/collection.hpp"

namespace softkv::detail {

/// One collection as persisted: configuration, id counter and entries (keys as stored).
struct CollectionImage {
  std::string name;                  ///< collection name
  CollectionConfig config;           ///< shape, metric, scale, index configuration
  std::uint64_t next_id = 0;         ///< the id add() assigns next
  std::vector<std::uint64_t> ids;    ///< n ids
  std::vector<float> keys;           ///< n x d, as stored (unit length for cosine)
  std::vector<float> values;         ///< n x dv
};

/// A whole database at the moment every record up to `sequence` had been applied.
struct SnapshotImage {
  std::uint64_t sequence = 0;                   ///< last log sequence number the snapshot includes
  std::vector<CollectionImage> collections;     ///< every collection
};

/// File format version written by encode_snapshot.
inline constexpr std::uint32_t kSnapshotVersion = 1;

/// The file bytes: magic "SKVSNAP1", u32 version, u64 payload length, u32 payload CRC-32, payload.
std::vector<std::byte> encode_snapshot(const SnapshotImage& image);

/// Parses file bytes; throws Error(corrupt_file) naming `file` and the offset of the first problem.
/// Sizes and counts are checked against the file's length before anything is allocated.
SnapshotImage decode_snapshot(std::span<const std::byte> bytes, const std::string& file);

}  // namespace softkv::detail
