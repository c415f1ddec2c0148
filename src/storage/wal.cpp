// Log records: framing, parsing with torn-tail vs corruption detection, and group commit.
#include "storage/wal.hpp"

#include <fcntl.h>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "codec/bytes.hpp"
#include "codec/crc32.hpp"

namespace softkv::detail {
namespace {

struct Header {
  std::uint32_t length;
  std::uint64_t sequence;
  std::uint8_t type;
  std::uint32_t payload_crc;
  std::uint32_t header_crc;
};

Header read_header(const std::byte* p) {
  Header h{};
  std::memcpy(&h.length, p, 4);
  std::memcpy(&h.sequence, p + 4, 8);
  std::memcpy(&h.type, p + 12, 1);
  std::memcpy(&h.payload_crc, p + 13, 4);
  std::memcpy(&h.header_crc, p + 17, 4);
  return h;
}

bool all_zero(std::span<const std::byte> bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == std::byte{0}; });
}

}  // namespace

std::vector<std::byte> record_header(std::uint64_t sequence, RecordType type, std::span<const std::byte> payload) {
  ByteWriter w;
  w.put(static_cast<std::uint32_t>(payload.size()));
  w.put(sequence);
  w.put(static_cast<std::uint8_t>(type));
  w.put(crc32_of(payload));
  w.put(crc32_of(w.bytes()));
  return std::move(w.bytes());
}

std::vector<std::byte> encode_record(std::uint64_t sequence, RecordType type, std::span<const std::byte> payload) {
  std::vector<std::byte> record = record_header(sequence, type, payload);
  record.insert(record.end(), payload.begin(), payload.end());
  return record;
}

LogScan scan_log(std::span<const std::byte> bytes) {
  LogScan scan;
  std::uint64_t at = 0;
  auto stop = [&](LogScan::End end, std::string problem) {
    scan.end = end;
    scan.problem = std::move(problem);
    scan.valid_bytes = at;
    return scan;
  };
  while (at < bytes.size()) {
    const std::span<const std::byte> rest = bytes.subspan(at);
    if (rest.size() < kRecordHeaderSize) return stop(LogScan::End::torn, "partial record header");
    const Header h = read_header(rest.data());
    if (crc32_of(rest.first(17)) != h.header_crc) {
      // A zero-filled tail (space the file system extended but never wrote) is a torn write.
      if (all_zero(rest)) return stop(LogScan::End::torn, "zero-filled tail");
      return stop(LogScan::End::corrupt, "record header checksum mismatch");
    }
    if (h.length > kMaxRecordPayload || h.type < 1 || h.type > kMaxRecordType)
      return stop(LogScan::End::corrupt, "record header out of range");
    if (rest.size() - kRecordHeaderSize < h.length) return stop(LogScan::End::torn, "partial record payload");
    const std::span<const std::byte> payload = rest.subspan(kRecordHeaderSize, h.length);
    if (crc32_of(payload) != h.payload_crc) {
      const bool last = rest.size() == kRecordHeaderSize + h.length;
      return stop(last ? LogScan::End::torn : LogScan::End::corrupt, "record payload checksum mismatch");
    }
    if (!scan.records.empty() && h.sequence != scan.records.back().sequence + 1)
      return stop(LogScan::End::corrupt, "sequence number " + std::to_string(h.sequence) + " after " +
                                             std::to_string(scan.records.back().sequence));
    scan.records.push_back({h.sequence, static_cast<RecordType>(h.type), payload, at});
    at += kRecordHeaderSize + h.length;
  }
  scan.valid_bytes = at;
  return scan;
}

LogWriter::LogWriter(const std::filesystem::path& path, std::uint64_t size)
    : file_(path, O_WRONLY | O_CREAT), appended_(size), durable_(size) {
  file_.truncate(size);  // drops a torn tail and positions the writes
}

std::uint64_t LogWriter::append(std::span<const std::byte> header, std::span<const std::byte> payload) {
  // One appender at a time (the caller's contract), so appended_ only changes here: the write itself
  // runs without the mutex, which wait_durable's waiters need.
  if (broken_.load()) throw Error(ErrorCode::io_error, "the log " + file_.path().string() + " ends in a partial record it could not remove");
  const std::uint64_t before = appended();
  try {
    file_.write_all(header);
    file_.write_all(payload);
  } catch (const Error&) {
    try {
      file_.truncate(before);  // a partial record must not stay behind the next one
    } catch (const Error&) {
      broken_.store(true);
    }
    throw;
  }
  std::lock_guard lock(mutex_);
  appended_ += header.size() + payload.size();
  return appended_;
}

bool LogWriter::broken() const { return broken_.load(); }

std::uint64_t LogWriter::appended() const {
  std::lock_guard lock(mutex_);
  return appended_;
}

void LogWriter::wait_durable(std::uint64_t offset) {
  std::unique_lock lock(mutex_);
  while (durable_ < offset) {
    if (syncing_) {  // a sync is running: it may cover us; wait and look again
      synced_.wait(lock);
      continue;
    }
    syncing_ = true;
    const std::uint64_t target = appended_;  // everything written so far rides on this sync
    lock.unlock();
    try {
      file_.sync_data();
    } catch (...) {
      lock.lock();
      syncing_ = false;
      synced_.notify_all();
      throw;
    }
    lock.lock();
    durable_ = std::max(durable_, target);
    syncing_ = false;
    synced_.notify_all();
  }
}

std::string segment_name(std::uint64_t first_sequence) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "wal-%020llu.log", static_cast<unsigned long long>(first_sequence));
  return buf;
}

std::vector<std::pair<std::uint64_t, std::filesystem::path>> list_segments(const std::filesystem::path& dir) {
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string file = e.path().filename().string();
    if (file.size() != 28 || file.rfind("wal-", 0) != 0 || file.substr(24) != ".log") continue;
    std::uint64_t first = 0;
    const auto [p, ec] = std::from_chars(file.data() + 4, file.data() + 24, first);
    if (ec == std::errc() && p == file.data() + 24 && first > 0) out.emplace_back(first, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace softkv::detail
