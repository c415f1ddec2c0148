// The journal: the write side of a data directory. One mutation at a time is logged, then applied
// (log order = apply order), made durable per the fsync policy, and snapshots rotate the log.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "codec/records.hpp"
#include "softkv/database.hpp"
#include "storage/directory.hpp"
#include "storage/snapshot.hpp"
#include "storage/wal.hpp"

namespace softkv::detail {

/// What a snapshot copies under the write lock: every collection's image, and saved indexes by name.
struct SnapshotCapture {
  SnapshotImage image;                                             ///< sequence is filled in by the journal
  std::map<std::string, std::vector<std::byte>, std::less<>> indexes;  ///< saved pruning indexes
};

/// Logs and applies mutations, syncs, snapshots. Thread safety: every method may be called
/// concurrently; commits are serialised. After an I/O error it cannot cut back cleanly (a failed
/// fsync, or a partial record it could not remove), it refuses writes and snapshots until reopened.
class Journal {
 public:
  /// What the journal calls back into: the one apply, and the capture of a snapshot.
  struct Hooks {
    std::function<void(const Mutation&)> apply;     ///< applies a logged mutation (live writes and replay alike)
    std::function<SnapshotCapture()> capture;       ///< copies every collection (called under the write lock)
    std::function<void(std::string_view)> log;      ///< operator log lines
  };

  /// Continues the log where recovery left it and starts the background thread (everysec, snapshots).
  Journal(std::filesystem::path dir, const DatabaseOptions& options, const RecoveredLog& recovered, Hooks hooks);
  /// Stops the background thread and syncs what was logged.
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  /// Under the write lock: build() checks the request against the current state and returns its
  /// mutation (a throw logs nothing); the mutation is logged and applied. Then, outside the lock, waits
  /// for durability under FsyncPolicy::always.
  void commit(const std::function<Mutation()>& build);
  /// Writes a snapshot now (see Database::snapshot).
  void snapshot();
  /// Forces everything logged so far to stable storage.
  void sync();
  /// Sequence number of the last logged mutation.
  [[nodiscard]] std::uint64_t last_sequence() const;
  /// A collection's share of the newest snapshot file, in bytes (0 if none).
  [[nodiscard]] std::uint64_t snapshot_bytes(std::string_view name) const;

 private:
  void sync_log(LogWriter& log, std::uint64_t end);
  void request_snapshot();
  void background_loop();
  void note_sizes(const SnapshotImage& image);

  std::filesystem::path dir_;
  DatabaseOptions options_;
  Hooks hooks_;
  mutable std::mutex write_mutex_;  // one mutation at a time: log order = apply order
  std::uint64_t sequence_ = 0;      // last logged sequence number
  std::shared_ptr<LogWriter> log_;
  std::uint64_t bytes_since_snapshot_ = 0;
  std::mutex snapshot_mutex_;       // one snapshot at a time (taken before write_mutex_, never after)
  std::atomic<bool> failed_{false};
  mutable std::mutex sizes_mutex_;
  std::map<std::string, std::uint64_t, std::less<>> snapshot_bytes_;
  std::mutex bg_mutex_;
  std::condition_variable bg_wake_;
  bool stop_ = false;
  bool snapshot_wanted_ = false;
  std::thread background_;  // last: started when everything above exists
};

}  // namespace softkv::detail
