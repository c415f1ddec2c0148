// A data directory's files: recovery (snapshot + log replay, in order) and the writing of snapshots.
// It knows files and records, not collections: the database passes in what to do with each.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "codec/records.hpp"
#include "storage/snapshot.hpp"

namespace softkv::detail {

/// What recovery did to the log, for the writer that goes on from there.
struct RecoveredLog {
  std::uint64_t sequence = 0;          ///< last sequence number applied (snapshot or log)
  std::filesystem::path segment;       ///< the segment new records are appended to
  std::uint64_t valid_bytes = 0;       ///< its length after cutting a torn tail
  std::map<std::string, std::uint64_t, std::less<>> snapshot_bytes;  ///< per collection: its share of the snapshot
};

/// Callbacks of recover_directory.
struct RecoveryHandlers {
  /// A collection from the snapshot; image.index holds its saved index when one is intact and current.
  std::function<void(std::string name, CollectionImage image)> restore;
  /// The next logged mutation, in log order; a throw stops recovery with Error(corrupt_file) naming the record.
  std::function<void(const Mutation&)> replay;
  /// Dimensions of a collection by name (legacy upsert records do not carry them).
  DimensionsOf dimensions;
  /// Receives one line per thing worth telling an operator.
  std::function<void(std::string_view)> log;
};

/// Recovers a data directory: removes leftovers of interrupted atomic writes, loads the snapshot,
/// replays every later record. A torn tail is cut off the last segment (and off an earlier segment
/// when the next one starts right after the valid prefix: that record was never acknowledged). A gap
/// in sequence numbers, including a segment missing between the snapshot and the log, is
/// Error(corrupt_file); with `repair`, a corrupt record keeps the valid prefix before it and sets the
/// later segments aside as *.corrupt (repair cannot bridge a missing segment or a damaged snapshot).
RecoveredLog recover_directory(const std::filesystem::path& dir, bool repair, const RecoveryHandlers& handlers);

/// Writes a snapshot's files after the log has been rotated to segment `first_kept`: the index files
/// (sealed with the snapshot's sequence), then the snapshot file (atomically), then removes index
/// files of collections not in `indexes` and the segments before `first_kept`. A failure leaves the
/// previous snapshot and every segment in place (and no temporary file). Returns the snapshot's size.
std::uint64_t write_snapshot(const std::filesystem::path& dir, const SnapshotImage& image,
                             const std::map<std::string, std::vector<std::byte>, std::less<>>& indexes, std::uint64_t first_kept);

}  // namespace softkv::detail
