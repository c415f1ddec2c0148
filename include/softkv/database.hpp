// softkv::Database: named collections in a data directory, kept by a write-ahead log and snapshots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "softkv/collection.hpp"

namespace softkv {

/// When the log is forced to stable storage.
enum class FsyncPolicy : std::uint8_t {
  always = 0,    ///< before a write returns (default); concurrent writers share one fsync
  everysec = 1,  ///< by a background thread once a second: a crash may lose the last second
  never = 2,     ///< left to the operating system: a crash may lose any unflushed write
};

/// How a database opens and keeps its data.
struct DatabaseOptions {
  FsyncPolicy fsync = FsyncPolicy::always;           ///< durability of acknowledged writes
  std::uint64_t snapshot_after_bytes = 64ull << 20;  ///< logged bytes that trigger a background snapshot; 0: never
  bool coalesce = true;  ///< concurrent single queries on a collection share passes (Collection::set_coalescing)
  bool repair = false;  ///< on a corrupt log record, keep the valid prefix instead of refusing to open
  /// Receives recovery and snapshot log lines (default: standard error).
  std::function<void(std::string_view)> log;
};

/// Size and shape of one collection.
struct CollectionStats {
  std::string name;                 ///< its name
  std::size_t size = 0;             ///< entries
  std::size_t dim = 0;              ///< key dimension
  std::size_t value_dim = 0;        ///< value dimension
  Metric metric = Metric::dot;      ///< similarity
  IndexKind index = IndexKind::exact;  ///< configured pruning index
  std::uint64_t bytes_in_memory = 0;   ///< keys, values, ids and tags held in memory
  std::uint64_t bytes_on_disk = 0;     ///< its share of the newest snapshot file
  // Compact storage (issue 14).
  Precision key_precision = Precision::f32;    ///< how its keys are stored
  Precision value_precision = Precision::f32;  ///< how its values are stored
  std::size_t heads = 1;                       ///< attention heads (issue 15)
};

/// A directory of named collections. Every mutation is appended to a write-ahead log (length,
/// sequence number, checksum) before it is applied; snapshots bound the log. Opening recovers the
/// newest valid snapshot plus the log after it; a torn last record is cut off, corruption elsewhere
/// refuses to open with Error(corrupt_file) naming the file and offset (unless options.repair).
///
/// Durability: with FsyncPolicy::always a write is on stable storage when its call returns. A write
/// is visible to queries as soon as it is applied, which may be just before it is durable.
/// Thread safety: all methods may be called concurrently; writes are applied one at a time.
/// One process at a time may open a directory (it is locked).
class Database {
 public:
  /// Opens (creating if needed) the data directory and recovers its state.
  explicit Database(const std::filesystem::path& dir, DatabaseOptions options = {});
  /// Stops background work and syncs the log; does not snapshot (call snapshot() for a fast restart).
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  /// Throws Error(invalid_argument) unless name is a valid collection name (as create_collection checks it).
  static void check_name(std::string_view name);
  /// Creates a collection; names are 1-64 characters of [A-Za-z0-9_.-], not starting with '.'.
  void create_collection(std::string_view name, const CollectionConfig& config);
  /// Drops a collection and its entries.
  void drop_collection(std::string_view name);
  /// Names of all collections, sorted.
  [[nodiscard]] std::vector<std::string> list_collections() const;
  /// Whether a collection has this name.
  [[nodiscard]] bool has_collection(std::string_view name) const;
  /// The collection for queries; it stays valid (though no longer updated) if it is dropped.
  [[nodiscard]] std::shared_ptr<const Collection> collection(std::string_view name) const;
  /// Shape and sizes of a collection.
  [[nodiscard]] CollectionStats stats(std::string_view name) const;

  /// Adds n entries (row-major n x d keys, n x dv values, tags empty or n) and returns their new ids.
  std::vector<std::uint64_t> add(std::string_view name, std::span<const float> keys, std::span<const float> values,
                                 std::span<const std::uint64_t> tags = {});
  /// Inserts or replaces n entries by id (tags empty, meaning all 0, or n).
  void upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
              std::span<const float> values, std::span<const std::uint64_t> tags = {});
  /// Removes entries by id; throws Error(unknown_id) (removing nothing) if any id is absent.
  void remove(std::string_view name, std::span<const std::uint64_t> ids);

  /// Writes a snapshot of every collection now and deletes the log it covers. Queries never wait for
  /// it; writers wait only while the collections are copied, not while the copy is encoded and written.
  void snapshot();
  /// Forces everything logged so far to stable storage (useful with everysec or never).
  void sync();
  /// Sequence number of the last logged mutation.
  [[nodiscard]] std::uint64_t last_sequence() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace softkv
