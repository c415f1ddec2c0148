// Snapshot files (every collection at one log sequence number) and the index files written beside them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "softkv/types.hpp"

namespace softkv::detail {

/// One collection of a snapshot: its name and its image (CollectionImage::index is not part of the
/// snapshot file: it goes to the collection's index file).
struct NamedImage {
  std::string name;        ///< collection name
  CollectionImage image;   ///< configuration, id counter and rows as stored
};

/// A whole database at the moment every record up to `sequence` had been applied.
struct SnapshotImage {
  std::uint64_t sequence = 0;             ///< last log sequence number the snapshot includes
  std::vector<NamedImage> collections;    ///< every collection
};

/// Snapshot format version written by encode_snapshot (decode_snapshot reads 1, 2 and 3).
/// 1: configuration as cereal u64 fields. 2: configuration in the shared codec layout (codec/config.hpp).
/// 3: the configuration's compact-storage fields follow it, rows are stored at their precision
/// (f16/bf16: 2 bytes per element, i8: 1 byte per element then one float scale per row), and a
/// tags section follows each collection's rows.
inline constexpr std::uint32_t kSnapshotVersion = 3;

/// The snapshot file's name in a data directory.
inline constexpr const char* kSnapshotFile = "snapshot.skv";

/// The file bytes: a checked blob (codec/checked_blob.hpp, magic "SKVSNAP1") around a cereal payload.
std::vector<std::byte> encode_snapshot(const SnapshotImage& image);

/// Parses file bytes; throws Error(corrupt_file) naming `file` and the offset of the first problem.
/// Sizes and counts are checked against the file's length before anything is allocated, and each
/// configuration against ConfigLimits (the same check as at creation).
SnapshotImage decode_snapshot(std::span<const std::byte> bytes, const std::string& file);

/// Where a collection's saved pruning index lives in a data directory.
std::filesystem::path index_file_path(const std::filesystem::path& dir, std::string_view name);

/// Index file bytes: a checked blob (magic "SKVINDEX") holding the snapshot sequence and the index's bytes.
std::vector<std::byte> encode_index_file(std::uint64_t sequence, std::span<const std::byte> index);

/// The index bytes of an index file if it is intact and was written with the snapshot at `sequence`;
/// otherwise empty, with the reason in `why` (the index is then rebuilt, never trusted). Reads the
/// format before version 2 (magic "SKVINDX1") too.
std::vector<std::byte> decode_index_file(std::span<const std::byte> bytes, std::uint64_t sequence, std::string& why);

}  // namespace softkv::detail
