// Database: named collections kept by a write-ahead log (log, then apply) and snapshots, recovered on open.
#include "softkv/database.hpp"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <utility>

#include "collection_impl.hpp"
#include "storage/bytes.hpp"
#include "storage/config_codec.hpp"
#include "storage/file.hpp"
#include "storage/snapshot.hpp"
#include "storage/wal.hpp"

namespace softkv {


using detail::ByteReader;
using detail::ByteWriter;
using detail::RecordType;
using detail::get_config;
using detail::put_config;

namespace {

constexpr const char* kSnapshotFile = "snapshot.skv";
constexpr char kIndexMagic[8] = {'S', 'K', 'V', 'I', 'N', 'D', 'X', '1'};
constexpr std::size_t kIndexHeader = 8 + 8 + 8 + 4;  // magic, snapshot sequence, payload length, payload CRC-32
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

std::string segment_name(std::uint64_t first_sequence) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "wal-%020llu.log", static_cast<unsigned long long>(first_sequence));
  return buf;
}

// The first sequence number a segment file name announces, or 0 if the name is not a segment's.
std::uint64_t segment_start(const std::string& file) {
  if (file.size() != 28 || file.rfind("wal-", 0) != 0 || file.substr(24) != ".log") return 0;
  std::uint64_t v = 0;
  const auto [p, ec] = std::from_chars(file.data() + 4, file.data() + 24, v);
  return ec == std::errc() && p == file.data() + 24 ? v : 0;
}

// A collection's FAISS index file, written beside the snapshot whose sequence it carries.
std::filesystem::path index_path(const std::filesystem::path& dir, std::string_view name) {
  return dir / ("index-" + std::string(name) + ".faiss");
}

std::vector<std::byte> frame_index(std::uint64_t sequence, std::span<const std::byte> payload) {
  ByteWriter w;
  w.put_array(std::span<const char>(kIndexMagic, 8));
  w.put(sequence);
  w.put(std::uint64_t{payload.size()});
  w.put(detail::crc32_of(payload));
  w.put_array(payload);
  return std::move(w.bytes());
}

// The payload of an index file if it is intact and belongs to the snapshot at `sequence`; else why not.
std::span<const std::byte> unframe_index(std::span<const std::byte> bytes, std::uint64_t sequence, std::string& why) {
  if (bytes.size() < kIndexHeader || std::memcmp(bytes.data(), kIndexMagic, 8) != 0) {
    why = "not an index file (corrupt header)";
    return {};
  }
  std::uint64_t seq = 0, length = 0;
  std::uint32_t crc = 0;
  std::memcpy(&seq, bytes.data() + 8, 8);
  std::memcpy(&length, bytes.data() + 16, 8);
  std::memcpy(&crc, bytes.data() + 24, 4);
  const auto payload = bytes.subspan(kIndexHeader);
  if (length != payload.size() || detail::crc32_of(payload) != crc) {
    why = "corrupt (size or checksum mismatch)";
    return {};
  }
  if (seq != sequence) {
    why = "stale (written for snapshot sequence " + std::to_string(seq) + ", the snapshot is at " + std::to_string(sequence) + ")";
    return {};
  }
  return payload;
}

}  // namespace

class Database::Impl {
 public:
  Impl(const std::filesystem::path& dir, DatabaseOptions options)
      : dir_(dir), options_(std::move(options)), lock_(open_lock(dir)) {
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

  // ---- collections map ----
  std::shared_ptr<Collection> find(std::string_view name) const {
    std::shared_lock lock(map_mutex_);
    auto it = collections_.find(name);
    if (it == collections_.end()) throw Error(ErrorCode::unknown_collection, "no collection is named '" + std::string(name) + "'");
    return it->second;
  }

  // ---- mutations: under the write lock, prepare (validate + encode; may throw, nothing is logged),
  // log, apply (valid input: must not fail); then wait for durability outside the lock ----
  template <class Prepare, class Apply>
  void commit(RecordType type, Prepare&& prepare, Apply&& apply) {
    if (failed_) throw Error(ErrorCode::io_error, "the database stopped accepting writes after an earlier I/O error");
    std::shared_ptr<detail::LogWriter> log;
    std::uint64_t end = 0;
    {
      std::lock_guard lock(write_mutex_);
      const std::vector<std::byte> record = detail::encode_record(sequence_ + 1, type, prepare());
      try {
        end = log_->append(record);
        ++sequence_;
        apply();
      } catch (...) {
        failed_ = true;  // the log and memory may now disagree: refuse further writes until reopened
        throw;
      }
      log = log_;
      bytes_since_snapshot_ += record.size();
      if (options_.snapshot_after_bytes > 0 && bytes_since_snapshot_ >= options_.snapshot_after_bytes) request_snapshot();
    }
    if (options_.fsync == FsyncPolicy::always) sync_log(*log, end);
  }

  void sync_log(detail::LogWriter& log, std::uint64_t end) {
    try {
      log.wait_durable(end);
    } catch (...) {
      failed_ = true;
      throw;
    }
  }

  // Applies one record's payload (replay and live writes share this decoding).
  void apply(RecordType type, std::span<const std::byte> payload) {
    ByteReader r(payload);
    const std::string name = r.get_string("collection name");
    switch (type) {
      case RecordType::create: {
        const CollectionConfig config = get_config(r);
        std::unique_lock lock(map_mutex_);
        collections_[name] = std::make_shared<Collection>(config);
        break;
      }
      case RecordType::drop: {
        std::unique_lock lock(map_mutex_);
        collections_.erase(name);
        break;
      }
      case RecordType::upsert: {
        const auto c = find(name);
        const std::uint64_t n = r.get<std::uint64_t>("entry count");
        const auto ids = detail::to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"));
        const auto keys = detail::to_vector<float>(r.take_array<float>(n * c->config().dim, "keys"));
        const auto values = detail::to_vector<float>(r.take_array<float>(n * c->config().value_dim, "values"));
        c->upsert_batch(ids, keys, values);
        break;
      }
      case RecordType::remove: {
        const auto c = find(name);
        const std::uint64_t n = r.get<std::uint64_t>("id count");
        for (std::uint64_t id : detail::to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"))) c->remove(id);
        break;
      }
    }
  }

  // ---- snapshots ----
  // Writers wait only while the image is copied and the log is rotated; the image is encoded, written
  // and fsynced while writes go on into the new segment (queries never wait). The old segments are
  // deleted once the snapshot covering them is durable; a crash before that finds the previous
  // snapshot and every segment, and replays them.
  void snapshot() {
    std::lock_guard one_at_a_time(snapshot_mutex_);
    detail::SnapshotImage image;
    std::map<std::string, std::vector<std::byte>> indexes;  // name -> saved FAISS index
    std::uint64_t next = 0;
    {
      std::lock_guard lock(write_mutex_);
      image.sequence = sequence_;
      {
        std::shared_lock map_lock(map_mutex_);
        for (const auto& [name, c] : collections_) {
          detail::CollectionImage ci;
          ci.name = name;
          ci.config = c->config();
          const Collection::Impl& s = *c->impl_;
          std::shared_lock entries_lock(s.mutex_);
          ci.next_id = s.next_id_;
          ci.ids = s.ids_;
          ci.keys.assign(s.keys_.begin(), s.keys_.end());
          ci.values.assign(s.values_.begin(), s.values_.end());
          if (s.index_) {
            if (auto saved = s.index_->save(); !saved.empty()) indexes[name] = std::move(saved);
          }
          image.collections.push_back(std::move(ci));
        }
      }
      // Records after the image go to a new segment, so the old ones hold nothing the snapshot lacks.
      log_->wait_durable(log_->appended());
      next = sequence_ + 1;
      log_ = std::make_shared<detail::LogWriter>(dir_ / segment_name(next), 0);
      detail::sync_directory(dir_);
      bytes_since_snapshot_ = 0;
    }
    // Index files first: a crash before the snapshot's rename leaves them marked with a sequence the
    // old snapshot does not have, so they are treated as stale and rebuilt, never trusted.
    for (const auto& [name, saved] : indexes) detail::write_file_atomically(index_path(dir_, name), frame_index(image.sequence, saved));
    const auto bytes = detail::encode_snapshot(image);
    detail::write_file_atomically(dir_ / kSnapshotFile, bytes);
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {  // index files of dropped or unindexed collections
      const std::string file = e.path().filename().string();
      if (file.rfind("index-", 0) == 0 && e.path().extension() == ".faiss" &&
          !indexes.contains(file.substr(6, file.size() - 6 - 6)))
        std::filesystem::remove(e.path());
    }
    snapshot_sizes(image);
    for (const auto& [first, path] : segments())
      if (first < next) std::filesystem::remove(path);  // wholly covered by the snapshot
    detail::sync_directory(dir_);
    options_.log("snapshot at sequence " + std::to_string(image.sequence) + ": " + std::to_string(bytes.size()) + " bytes");
  }

  void snapshot_sizes(const detail::SnapshotImage& image) {
    std::lock_guard lock(sizes_mutex_);
    disk_bytes_.clear();
    for (const auto& c : image.collections)
      disk_bytes_[c.name] = c.ids.size() * 8 + (c.keys.size() + c.values.size()) * 4 + c.name.size() + 64;
  }

  std::uint64_t disk_bytes(const std::string& name) const {
    std::lock_guard lock(sizes_mutex_);
    auto it = disk_bytes_.find(name);
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
  static detail::File open_lock(const std::filesystem::path& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw Error(ErrorCode::io_error, "cannot create data directory " + dir.string() + ": " + ec.message());
    detail::File f(dir / kLockFile, O_RDWR | O_CREAT);
    f.lock_exclusive();
    return f;
  }

  // Segment files sorted by their first sequence number.
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> segments() const {
    std::vector<std::pair<std::uint64_t, std::filesystem::path>> out;
    for (const auto& e : std::filesystem::directory_iterator(dir_))
      if (const std::uint64_t start = segment_start(e.path().filename().string()); start > 0) out.emplace_back(start, e.path());
    std::sort(out.begin(), out.end());
    return out;
  }

  void restore(detail::CollectionImage& ci, std::uint64_t sequence) {
    auto c = std::make_shared<Collection>(ci.config);
    Collection::Impl& s = *c->impl_;
    const std::size_t n = ci.ids.size();
    s.ids_ = std::move(ci.ids);
    s.keys_.assign(ci.keys.begin(), ci.keys.end());
    s.values_.assign(ci.values.begin(), ci.values.end());
    for (std::size_t i = 0; i < n; ++i)
      if (!s.slot_of_.emplace(s.ids_[i], i).second)
        throw Error(ErrorCode::corrupt_file, "snapshot holds id " + std::to_string(s.ids_[i]) + " twice in '" + ci.name + "'");
    s.next_id_ = ci.next_id;
    s.size_hint_.store(n);
    if (s.index_) load_or_rebuild_index(ci.name, s, sequence);
    collections_[ci.name] = std::move(c);
  }

  // Installs the saved FAISS index when it is intact and belongs to this snapshot, else rebuilds it.
  void load_or_rebuild_index(const std::string& name, Collection::Impl& s, std::uint64_t sequence) {
    const auto path = index_path(dir_, name);
    std::string why;
    if (std::filesystem::exists(path)) {
      const auto bytes = detail::read_file(path);
      const auto payload = unframe_index(bytes, sequence, why);
      if (!payload.empty()) {
        if (s.index_->load(payload, s.span())) {
          options_.log("loaded the index of '" + name + "' from " + path.filename().string());
          return;
        }
        why = "does not match the snapshot's entries";
      }
      options_.log("index file " + path.filename().string() + " is " + why + "; rebuilding the index of '" + name + "'");
      s.index_->build_now(s.span());
      return;
    }
    s.index_->build_now(s.span());
    if (s.index_->ready() && s.index_->kind() != IndexKind::flat)
      options_.log("no index file for '" + name + "'; rebuilt its index from the snapshot");
  }

  void recover() {
    for (const auto& e : std::filesystem::directory_iterator(dir_))
      if (e.path().extension() == ".tmp") std::filesystem::remove(e.path());  // an interrupted atomic write
    const auto snap = dir_ / kSnapshotFile;
    if (std::filesystem::exists(snap)) {
      detail::SnapshotImage image = detail::decode_snapshot(detail::read_file(snap), snap.string());
      snapshot_sizes(image);
      sequence_ = image.sequence;
      for (auto& ci : image.collections) restore(ci, image.sequence);
    }
    const auto segs = segments();
    std::filesystem::path last;
    std::uint64_t last_size = 0;
    for (std::size_t i = 0; i < segs.size(); ++i) {
      const auto& path = segs[i].second;
      const auto bytes = detail::read_file(path);
      const detail::LogScan scan = detail::scan_log(bytes);
      for (const detail::RecordView& rec : scan.records) {
        if (rec.sequence <= sequence_) continue;  // already in the snapshot
        const std::string where = path.string() + " at byte " + std::to_string(rec.offset);
        if (rec.sequence != sequence_ + 1)
          throw Error(ErrorCode::corrupt_file, where + ": sequence " + std::to_string(rec.sequence) + " follows " +
                                                   std::to_string(sequence_) + " (records are missing)");
        try {
          apply(rec.type, rec.payload);
        } catch (const Error& e) {
          throw Error(ErrorCode::corrupt_file, where + ": record cannot be applied: " + e.what());
        }
        sequence_ = rec.sequence;
      }
      const bool is_last = i + 1 == segs.size();
      last = path;
      last_size = scan.valid_bytes;
      if (scan.end == detail::LogScan::End::clean) continue;
      const std::string where = path.string() + " at byte " + std::to_string(scan.valid_bytes) + ": " + scan.problem;
      if (scan.end == detail::LogScan::End::torn && is_last) {
        options_.log("cut a torn record off the log tail, " + where);
        continue;
      }
      if (!options_.repair) throw Error(ErrorCode::corrupt_file, where);
      options_.log("repair: keeping the valid prefix of " + where + "; later segments are set aside as .corrupt");
      for (std::size_t j = i + 1; j < segs.size(); ++j) {
        auto aside = segs[j].second;
        aside += ".corrupt";
        std::filesystem::rename(segs[j].second, aside);
      }
      break;
    }
    if (last.empty()) {
      last = dir_ / segment_name(sequence_ + 1);
      last_size = 0;
    }
    log_ = std::make_shared<detail::LogWriter>(last, last_size);  // truncates a torn tail
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
  (void)Collection(config);  // validates the configuration
  ByteWriter w;
  impl_->commit(
      RecordType::create,
      [&] {
        if (has_collection(name)) throw Error(ErrorCode::collection_exists, "a collection named '" + std::string(name) + "' exists");
        w.put_string(name);
        put_config(w, config);
        return w.bytes();
      },
      [&] { impl_->apply(RecordType::create, w.bytes()); });
}

void Database::drop_collection(std::string_view name) {
  ByteWriter w;
  impl_->commit(
      RecordType::drop,
      [&] {
        (void)impl_->find(name);
        w.put_string(name);
        return w.bytes();
      },
      [&] { impl_->apply(RecordType::drop, w.bytes()); });
}

std::vector<std::string> Database::list_collections() const {
  std::shared_lock lock(impl_->map_mutex_);
  std::vector<std::string> names;
  for (const auto& entry : impl_->collections_) names.push_back(entry.first);
  return names;
}

bool Database::has_collection(std::string_view name) const {
  std::shared_lock lock(impl_->map_mutex_);
  return impl_->collections_.find(name) != impl_->collections_.end();
}

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

namespace {

// Payload of an upsert record: name, n, ids, keys as given (cosine normalises again on replay), values.
std::vector<std::byte> upsert_payload(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                                      std::span<const float> values) {
  ByteWriter w;
  w.put_string(name);
  w.put(std::uint64_t{ids.size()});
  w.put_array(ids);
  w.put_array(keys);
  w.put_array(values);
  return std::move(w.bytes());
}

}  // namespace

std::vector<std::uint64_t> Database::add(std::string_view name, std::span<const float> keys, std::span<const float> values) {
  const auto c = impl_->find(name);
  std::vector<float> buffer;  // the keys as stored (normalised for cosine); the log keeps them as given
  std::size_t n = 0;
  const std::span<const float> prepared = c->impl_->validate_rows(keys, values, nullptr, buffer, n);
  std::vector<std::uint64_t> ids(n);
  impl_->commit(
      RecordType::upsert,
      [&] {  // ids come from the collection's counter, which only changes under this lock
        const std::uint64_t first = c->impl_->next_id();
        if (n > kReservedId - first) throw Error(ErrorCode::invalid_argument, "the id space is exhausted");
        for (std::size_t i = 0; i < n; ++i) ids[i] = first + i;
        return upsert_payload(name, ids, keys, values);
      },
      [&] { c->impl_->store_rows(ids, prepared.data(), values.data()); });
  return ids;
}

void Database::upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                      std::span<const float> values) {
  const auto c = impl_->find(name);
  std::vector<float> buffer;
  std::size_t n = 0;
  const std::span<const float> prepared = c->impl_->validate_rows(keys, values, &ids, buffer, n);
  impl_->commit(
      RecordType::upsert, [&] { return upsert_payload(name, ids, keys, values); },
      [&] { c->impl_->store_rows(ids, prepared.data(), values.data()); });
}

void Database::remove(std::string_view name, std::span<const std::uint64_t> ids) {
  const auto c = impl_->find(name);
  impl_->commit(
      RecordType::remove,
      [&] {  // all or nothing: every id must exist, once
        std::vector<std::uint64_t> sorted(ids.begin(), ids.end());
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
          throw Error(ErrorCode::invalid_argument, "an id appears twice in one remove");
        for (std::uint64_t id : ids)
          if (!c->contains(id)) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
        ByteWriter w;
        w.put_string(name);
        w.put(std::uint64_t{ids.size()});
        w.put_array(ids);
        return std::move(w.bytes());
      },
      [&] {
        for (std::uint64_t id : ids) c->remove(id);
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
