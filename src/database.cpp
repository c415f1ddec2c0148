// Database: named collections kept by a write-ahead log. Every write is one Mutation: checked against the
// current state, logged, then applied by the same apply() that replays the log at open.
#include "softkv/database.hpp"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <utility>

#include "codec/records.hpp"
#include "config_limits.hpp"
#include "overloaded.hpp"
#include "softkv/error.hpp"
#include "storage/directory.hpp"
#include "storage/file.hpp"
#include "storage/wal.hpp"

namespace softkv {
namespace {

constexpr const char* kLockFile = "LOCK";

void check_name(std::string_view name) {
  const bool ok = !name.empty() && name.size() <= 64 && name.front() != '.' &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                           c == '-' || c == '.';
                  });
  if (!ok)
    throw Error(ErrorCode::invalid_argument, "collection name '" + std::string(name) +
                                                 "' must be 1-64 characters of [A-Za-z0-9_.-], not starting with '.'");
}

detail::File lock_directory(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot create data directory " + dir.string() + ": " + ec.message());
  detail::File f(dir / kLockFile, O_RDWR | O_CREAT);
  f.lock_exclusive();
  return f;
}

}  // namespace

class Database::Impl {
 public:
  Impl(const std::filesystem::path& dir, DatabaseOptions options)
      : dir_(dir), options_(std::move(options)), lock_(lock_directory(dir)) {
    if (!options_.log) options_.log = [](std::string_view line) { std::fprintf(stderr, "softkv: %.*s\n", int(line.size()), line.data()); };
    recover();
    background_ = std::thread([this] { background_loop(); });
  }

  ~Impl() {
    {
      std::lock_guard lock(bg_mutex_);
      stop_ = true;
    }
    bg_wake_.notify_all();
    background_.join();
    try {
      std::lock_guard lock(write_mutex_);
      log_->wait_durable(log_->appended());
    } catch (...) {  // a destructor must not throw; the log keeps what reached the disk
    }
  }

  // ---- the registry ----
  std::shared_ptr<Collection> find_or_null(std::string_view name) const {
    std::shared_lock lock(map_mutex_);
    const auto it = collections_.find(name);
    return it == collections_.end() ? nullptr : it->second;
  }

  std::shared_ptr<Collection> find(std::string_view name) const {
    auto c = find_or_null(name);
    if (!c) throw Error(ErrorCode::unknown_collection, "no collection is named '" + std::string(name) + "'");
    return c;
  }

  // A collection looked up before the write lock (to validate rows outside it) must still be the one
  // under that name when the write is logged: a drop (and a create of the same name) in between makes
  // the write fail with unknown_collection instead of logging a record that applies elsewhere or nowhere.
  void require_current(std::string_view name, const std::shared_ptr<Collection>& c) const {
    if (find_or_null(name) != c) throw Error(ErrorCode::unknown_collection, "collection '" + std::string(name) + "' was dropped");
  }

  // ---- writes: under the write lock, build the mutation (checks against the current state; may throw,
  // nothing is logged), log it, apply it; then wait for durability outside the lock ----
  void commit(const std::function<detail::Mutation()>& build) {
    if (failed_) throw Error(ErrorCode::io_error, "the database stopped accepting writes after an earlier I/O error; reopen it");
    std::shared_ptr<detail::LogWriter> log;
    std::uint64_t end = 0;
    {
      std::lock_guard lock(write_mutex_);
      const detail::Mutation mutation = build();
      const detail::EncodedMutation encoded = detail::encode_mutation(mutation);
      if (encoded.payload.size() > detail::kMaxRecordPayload)
        throw Error(ErrorCode::invalid_argument, "a write of " + std::to_string(encoded.payload.size()) +
                                                     " bytes is larger than one log record may be (1 GiB): split the batch");
      const std::vector<std::byte> header = detail::record_header(sequence_ + 1, encoded.type, encoded.payload);
      try {
        end = log_->append(header, encoded.payload);  // on failure the segment is cut back to its last record
      } catch (...) {
        if (log_->broken()) failed_ = true;
        throw;
      }
      ++sequence_;
      try {
        apply(mutation);
      } catch (...) {
        failed_ = true;  // logged but not applied (an internal error): memory and log disagree until reopened
        throw;
      }
      log = log_;
      bytes_since_snapshot_ += header.size() + encoded.payload.size();
      if (options_.snapshot_after_bytes > 0 && bytes_since_snapshot_ >= options_.snapshot_after_bytes) request_snapshot();
    }
    if (options_.fsync == FsyncPolicy::always) sync_log(*log, end);
  }

  void sync_log(detail::LogWriter& log, std::uint64_t end) {
    try {
      log.wait_durable(end);
    } catch (...) {
      failed_ = true;  // after a failed fsync the file's state is unknown (the kernel may drop the pages)
      throw;
    }
  }

  // The one apply: live writes (after logging) and replay at open.
  void apply(const detail::Mutation& m) {
    std::visit(detail::Overloaded{
                   [&](const detail::mutation::Create& c) {
                     // Live creates were checked; a record from before ConfigLimits may need fitting.
                     std::string changed;
                     auto collection = std::make_shared<Collection>(detail::fit_index_limits(c.config, &changed));
                     if (!changed.empty()) options_.log("'" + c.name + "': index settings brought into range: " + changed);
                     std::unique_lock lock(map_mutex_);
                     collections_[c.name] = std::move(collection);
                   },
                   [&](const detail::mutation::Drop& d) {
                     std::unique_lock lock(map_mutex_);
                     collections_.erase(d.name);
                   },
                   [&](const detail::mutation::Upsert& u) {
                     const auto c = find(u.name);
                     if (!u.keys_as_given) return c->apply(u.rows);
                     // A record from before format 2 holds cosine keys as the client gave them.
                     Rows rows = c->prepare(u.rows.ids, u.rows.keys, u.rows.values);
                     c->apply(rows);
                   },
                   [&](const detail::mutation::Remove& r) { find(r.name)->remove_batch(r.ids); },
               },
               m);
  }

  // ---- snapshots ----
  // Writers wait only while the images are copied and the log is rotated; the images are encoded,
  // written and fsynced while writes go on into the new segment (queries never wait).
  void snapshot() {
    std::lock_guard one_at_a_time(snapshot_mutex_);
    if (failed_) throw Error(ErrorCode::io_error, "no snapshot after an I/O error: the log must stay as it is until reopened");
    detail::SnapshotImage image;
    std::map<std::string, std::vector<std::byte>, std::less<>> indexes;
    std::uint64_t next = 0;
    {
      std::lock_guard lock(write_mutex_);
      image.sequence = sequence_;
      {
        std::shared_lock map_lock(map_mutex_);
        for (const auto& [name, c] : collections_) {
          CollectionImage ci = c->image();
          if (!ci.index.empty()) indexes[name] = std::move(ci.index);
          ci.index.clear();
          image.collections.push_back({name, std::move(ci)});
        }
      }
      // Records after the image go to a new segment, so the old ones hold nothing the snapshot lacks.
      // Any failure here leaves the current segment in use and nothing rotated.
      log_->wait_durable(log_->appended());
      next = sequence_ + 1;
      auto rotated = std::make_shared<detail::LogWriter>(dir_ / detail::segment_name(next), 0);
      detail::sync_directory(dir_);
      log_ = std::move(rotated);
      bytes_since_snapshot_ = 0;
    }
    const std::uint64_t size = detail::write_snapshot(dir_, image, indexes, next);
    {
      std::lock_guard lock(sizes_mutex_);
      disk_bytes_.clear();
      for (const auto& c : image.collections)
        disk_bytes_[c.name] = c.image.rows.ids.size() * 8 + (c.image.rows.keys.size() + c.image.rows.values.size()) * 4 + c.name.size() + 64;
    }
    options_.log("snapshot at sequence " + std::to_string(image.sequence) + ": " + std::to_string(size) + " bytes");
  }

  std::uint64_t disk_bytes(std::string_view name) const {
    std::lock_guard lock(sizes_mutex_);
    const auto it = disk_bytes_.find(name);
    return it == disk_bytes_.end() ? 0 : it->second;
  }

  void request_snapshot() {
    {
      std::lock_guard lock(bg_mutex_);
      snapshot_wanted_ = true;
    }
    bg_wake_.notify_all();
  }

  // everysec syncs and requested snapshots, off the writers' threads.
  void background_loop() {
    std::unique_lock lock(bg_mutex_);
    while (!stop_) {
      bg_wake_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_ || snapshot_wanted_; });
      if (stop_) break;
      const bool want_snapshot = std::exchange(snapshot_wanted_, false);
      lock.unlock();
      try {
        if (want_snapshot) snapshot();
        if (options_.fsync == FsyncPolicy::everysec) {
          std::shared_ptr<detail::LogWriter> log;
          {
            std::lock_guard w(write_mutex_);
            log = log_;
          }
          sync_log(*log, log->appended());
        }
      } catch (const std::exception& e) {
        options_.log(std::string("background work failed: ") + e.what());
      }
      lock.lock();
    }
  }

  // ---- recovery ----
  void recover() {
    detail::RecoveryHandlers handlers;
    handlers.log = options_.log;
    handlers.restore = [&](std::string name, CollectionImage image) {
      std::string note;
      auto c = std::make_shared<Collection>(Collection::restore(std::move(image), &note));
      if (!note.empty()) options_.log("'" + name + "': " + note);
      collections_[std::move(name)] = std::move(c);
    };
    handlers.replay = [&](const detail::Mutation& m) { apply(m); };
    handlers.dimensions = [&](const std::string& name) -> std::optional<std::pair<std::size_t, std::size_t>> {
      const auto c = find_or_null(name);
      if (!c) return std::nullopt;
      return std::pair{c->config().dim, c->config().value_dim};
    };
    detail::RecoveredLog recovered = detail::recover_directory(dir_, options_.repair, handlers);
    sequence_ = recovered.sequence;
    disk_bytes_ = std::move(recovered.snapshot_bytes);
    log_ = std::make_shared<detail::LogWriter>(recovered.segment, recovered.valid_bytes);  // truncates a torn tail
    detail::sync_directory(dir_);
  }

  std::filesystem::path dir_;
  DatabaseOptions options_;
  detail::File lock_;
  mutable std::shared_mutex map_mutex_;  // the collections map (queries hold it only to look up)
  std::map<std::string, std::shared_ptr<Collection>, std::less<>> collections_;
  std::mutex write_mutex_;               // one mutation at a time: log order = apply order
  std::uint64_t sequence_ = 0;           // last logged sequence number
  std::shared_ptr<detail::LogWriter> log_;
  std::uint64_t bytes_since_snapshot_ = 0;
  std::mutex snapshot_mutex_;  // one snapshot at a time (taken before write_mutex_, never after)
  std::atomic<bool> failed_{false};
  mutable std::mutex sizes_mutex_;
  std::map<std::string, std::uint64_t, std::less<>> disk_bytes_;
  std::mutex bg_mutex_;
  std::condition_variable bg_wake_;
  bool stop_ = false;
  bool snapshot_wanted_ = false;
  std::thread background_;
};

Database::Database(const std::filesystem::path& dir, DatabaseOptions options)
    : impl_(std::make_unique<Impl>(dir, std::move(options))) {}

Database::~Database() = default;

void Database::create_collection(std::string_view name, const CollectionConfig& config) {
  check_name(name);
  check_config(config);
  impl_->commit([&]() -> detail::Mutation {
    if (impl_->find_or_null(name)) throw Error(ErrorCode::collection_exists, "a collection named '" + std::string(name) + "' exists");
    return detail::mutation::Create{std::string(name), config};
  });
}

void Database::drop_collection(std::string_view name) {
  impl_->commit([&]() -> detail::Mutation {
    (void)impl_->find(name);
    return detail::mutation::Drop{std::string(name)};
  });
}

std::vector<std::string> Database::list_collections() const {
  std::shared_lock lock(impl_->map_mutex_);
  std::vector<std::string> names;
  for (const auto& entry : impl_->collections_) names.push_back(entry.first);
  return names;
}

bool Database::has_collection(std::string_view name) const { return impl_->find_or_null(name) != nullptr; }

std::shared_ptr<const Collection> Database::collection(std::string_view name) const { return impl_->find(name); }

CollectionStats Database::stats(std::string_view name) const {
  const auto c = impl_->find(name);
  CollectionStats s;
  s.name = name;
  s.size = c->size();
  s.dim = c->config().dim;
  s.value_dim = c->config().value_dim;
  s.metric = c->config().metric;
  s.index = c->config().index.kind;
  s.bytes_in_memory = s.size * (8 + 4 * (s.dim + s.value_dim));
  s.bytes_on_disk = impl_->disk_bytes(s.name);
  return s;
}

std::vector<std::uint64_t> Database::add(std::string_view name, std::span<const float> keys, std::span<const float> values) {
  const auto c = impl_->find(name);
  Rows rows = c->prepare({}, keys, values);  // validated and normalised once, outside the write lock
  const std::size_t n = rows.keys.size() / c->config().dim;
  std::vector<std::uint64_t> ids;
  impl_->commit([&]() -> detail::Mutation {
    impl_->require_current(name, c);
    const std::uint64_t first = c->next_id();  // changes only under this lock
    if (n > kReservedId - first) throw Error(ErrorCode::invalid_argument, "the id space is exhausted");
    rows.ids.resize(n);
    for (std::size_t i = 0; i < n; ++i) rows.ids[i] = first + i;
    ids = rows.ids;
    return detail::mutation::Upsert{std::string(name), std::move(rows)};
  });
  return ids;
}

void Database::upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                      std::span<const float> values) {
  const auto c = impl_->find(name);
  Rows rows = c->prepare(ids, keys, values);
  if (rows.ids.size() * c->config().dim != rows.keys.size())  // no ids for n > 0 rows (prepare reads that as an add)
    throw Error(ErrorCode::dimension_mismatch,
                "0 ids but " + std::to_string(rows.keys.size() / c->config().dim) + " keys");
  impl_->commit([&]() -> detail::Mutation {
    impl_->require_current(name, c);
    return detail::mutation::Upsert{std::string(name), std::move(rows)};
  });
}

void Database::remove(std::string_view name, std::span<const std::uint64_t> ids) {
  const auto c = impl_->find(name);
  impl_->commit([&]() -> detail::Mutation {  // all or nothing: every id present, once
    impl_->require_current(name, c);
    std::vector<std::uint64_t> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw Error(ErrorCode::invalid_argument, "an id appears twice in one remove");
    for (std::uint64_t id : ids)
      if (!c->contains(id)) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
    return detail::mutation::Remove{std::string(name), {ids.begin(), ids.end()}};
  });
}

void Database::snapshot() { impl_->snapshot(); }

void Database::sync() {
  std::shared_ptr<detail::LogWriter> log;
  {
    std::lock_guard lock(impl_->write_mutex_);
    log = impl_->log_;
  }
  impl_->sync_log(*log, log->appended());
}

std::uint64_t Database::last_sequence() const {
  std::lock_guard lock(impl_->write_mutex_);
  return impl_->sequence_;
}

}  // namespace softkv
