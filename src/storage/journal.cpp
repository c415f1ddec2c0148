// The journal: commit (check, log, apply, sync), snapshots that hold writers only while they copy, and
// the background thread for everysec syncs and size-triggered snapshots.
#include "storage/journal.hpp"

#include <chrono>
#include <utility>

#include "softkv/error.hpp"
#include "storage/file.hpp"

namespace softkv::detail {

Journal::Journal(std::filesystem::path dir, const DatabaseOptions& options, const RecoveredLog& recovered, Hooks hooks)
    : dir_(std::move(dir)), options_(options), hooks_(std::move(hooks)), sequence_(recovered.sequence),
      log_(std::make_shared<LogWriter>(recovered.segment, recovered.valid_bytes)),  // truncates a torn tail
      snapshot_bytes_(recovered.snapshot_bytes) {
  sync_directory(dir_);
  background_ = std::thread([this] { background_loop(); });
}

Journal::~Journal() {
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

void Journal::commit(const std::function<Mutation()>& build) {
  if (failed_) throw Error(ErrorCode::io_error, "the database stopped accepting writes after an earlier I/O error; reopen it");
  std::shared_ptr<LogWriter> log;
  std::uint64_t end = 0;
  {
    std::lock_guard lock(write_mutex_);
    const Mutation mutation = build();
    const EncodedMutation encoded = encode_mutation(mutation);
    if (encoded.payload.size() > kMaxRecordPayload)
      throw Error(ErrorCode::invalid_argument, "a write of " + std::to_string(encoded.payload.size()) +
                                                   " bytes is larger than one log record may be (1 GiB): split the batch");
    const std::vector<std::byte> header = record_header(sequence_ + 1, encoded.type, encoded.payload);
    try {
      end = log_->append(header, encoded.payload);  // on failure the segment is cut back to its last record
    } catch (...) {
      if (log_->broken()) failed_ = true;
      throw;
    }
    ++sequence_;
    try {
      hooks_.apply(mutation);
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

void Journal::sync_log(LogWriter& log, std::uint64_t end) {
  try {
    log.wait_durable(end);
  } catch (...) {
    failed_ = true;  // after a failed fsync the file's state is unknown (the kernel may drop the pages)
    throw;
  }
}

// Writers wait only while the images are copied and the log is rotated; the images are encoded,
// written and fsynced while writes go on into the new segment (queries never wait).
void Journal::snapshot() {
  std::lock_guard one_at_a_time(snapshot_mutex_);
  if (failed_) throw Error(ErrorCode::io_error, "no snapshot after an I/O error: the log must stay as it is until reopened");
  SnapshotCapture capture;
  std::uint64_t next = 0;
  {
    std::lock_guard lock(write_mutex_);
    capture = hooks_.capture();
    capture.image.sequence = sequence_;
    // Records after the image go to a new segment, so the old ones hold nothing the snapshot lacks.
    // Any failure here leaves the current segment in use and nothing rotated.
    log_->wait_durable(log_->appended());
    next = sequence_ + 1;
    auto rotated = std::make_shared<LogWriter>(dir_ / segment_name(next), 0);
    sync_directory(dir_);
    log_ = std::move(rotated);
    bytes_since_snapshot_ = 0;
  }
  const std::uint64_t size = write_snapshot(dir_, capture.image, capture.indexes, next);
  note_sizes(capture.image);
  hooks_.log("snapshot at sequence " + std::to_string(capture.image.sequence) + ": " + std::to_string(size) + " bytes");
}

void Journal::note_sizes(const SnapshotImage& image) {
  std::lock_guard lock(sizes_mutex_);
  snapshot_bytes_.clear();
  for (const auto& c : image.collections) {
    const Rows& rows = c.image.rows;
    snapshot_bytes_[c.name] = rows.ids.size() * 8 + (rows.keys.size() + rows.values.size()) * 4 + c.name.size() + 64;
  }
}

std::uint64_t Journal::snapshot_bytes(std::string_view name) const {
  std::lock_guard lock(sizes_mutex_);
  const auto it = snapshot_bytes_.find(name);
  return it == snapshot_bytes_.end() ? 0 : it->second;
}

void Journal::sync() {
  std::shared_ptr<LogWriter> log;
  {
    std::lock_guard lock(write_mutex_);
    log = log_;
  }
  sync_log(*log, log->appended());
}

std::uint64_t Journal::last_sequence() const {
  std::lock_guard lock(write_mutex_);
  return sequence_;
}

void Journal::request_snapshot() {
  {
    std::lock_guard lock(bg_mutex_);
    snapshot_wanted_ = true;
  }
  bg_wake_.notify_all();
}

// everysec syncs and requested snapshots, off the writers' threads.
void Journal::background_loop() {
  std::unique_lock lock(bg_mutex_);
  while (!stop_) {
    bg_wake_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_ || snapshot_wanted_; });
    if (stop_) break;
    const bool want_snapshot = std::exchange(snapshot_wanted_, false);
    lock.unlock();
    try {
      if (want_snapshot) snapshot();
      if (options_.fsync == FsyncPolicy::everysec) sync();
    } catch (const std::exception& e) {
      hooks_.log(std::string("background work failed: ") + e.what());
    }
    lock.lock();
  }
}

}  // namespace softkv::detail
