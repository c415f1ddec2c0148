// Log records: framing, parsing with torn-tail vs corruption detection, and group commit.
#include "storage/wal.hpp"

#include <fcntl.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>

#include "storage/bytes.hpp"

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

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths: feed large buffers in pieces.
  while (!bytes.empty()) {
    const std::size_t n = std::min<std::size_t>(bytes.size(), 1u << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(n));
    bytes = bytes.subspan(n);
  }
  return static_cast<std::uint32_t>(crc);
}

std::vector<std::byte> encode_record(std::uint64_t sequence, RecordType type, std::span<const std::byte> payload) {
  ByteWriter w;
  w.put(static_cast<std::uint32_t>(payload.size()));
  w.put(sequence);
  w.put(static_cast<std::uint8_t>(type));
  w.put(crc32_of(payload));
  w.put(crc32_of(w.bytes()));
  w.put_array(payload);
  return std::move(w.bytes());
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
    if (h.length > kMaxRecordPayload || h.type < 1 || h.type > 4)
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

std::uint64_t LogWriter::append(std::span<const std::byte> record) {
  file_.write_all(record);
  std::lock_guard lock(mutex_);
  appended_ += record.size();
  return appended_;
}

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

}  // namespace softkv::detail
