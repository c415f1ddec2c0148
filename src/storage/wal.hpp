// The write-ahead log: record framing with checksums, a tolerant parser, a group-committing writer, and
// the naming of its segment files.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "codec/records.hpp"
#include "storage/file.hpp"

namespace softkv::detail {

/// Record header: u32 payload length, u64 sequence, u8 type, u32 payload CRC-32, u32 CRC-32 of
/// the previous 17 bytes. The header checksum means a damaged length reads as corruption, never as
/// a torn tail that would silently drop the records after it.
inline constexpr std::size_t kRecordHeaderSize = 21;

/// Largest payload a record may claim (a batch is split by the writer long before this).
inline constexpr std::uint32_t kMaxRecordPayload = 1u << 30;

/// One record as found in a log buffer.
struct RecordView {
  std::uint64_t sequence = 0;             ///< strictly increasing by one across the log
  RecordType type = RecordType::create;   ///< what it does
  std::span<const std::byte> payload;     ///< its bytes (checksum verified)
  std::uint64_t offset = 0;               ///< where its header starts in the buffer
};

/// The outcome of parsing a log buffer.
struct LogScan {
  enum class End { clean, torn, corrupt };
  std::vector<RecordView> records;   ///< the valid prefix
  std::uint64_t valid_bytes = 0;     ///< length of the valid prefix
  End end = End::clean;              ///< clean: ends on a record boundary; torn: a partial last record
  std::string problem;               ///< for torn/corrupt: what was wrong at valid_bytes
};

/// The header of one record (kRecordHeaderSize bytes); the payload follows it in the log.
std::vector<std::byte> record_header(std::uint64_t sequence, RecordType type, std::span<const std::byte> payload);

/// Frames one record (header + payload).
std::vector<std::byte> encode_record(std::uint64_t sequence, RecordType type, std::span<const std::byte> payload);

/// Parses records from bytes. A record cut off by the end of the buffer, or a bad last record that
/// reaches exactly to the end, is a torn tail; a bad record followed by more bytes is corruption.
LogScan scan_log(std::span<const std::byte> bytes);

/// Appends records to one log segment. append() is called by one writer at a time; wait_durable()
/// may be called by many threads at once and shares one fdatasync among them (group commit).
/// A failed append cuts the file back to the last whole record, so the segment never keeps a partial
/// record that a later one would follow; if even that fails the writer is broken() for good.
class LogWriter {
 public:
  /// Opens (creating if needed) path for appending at byte offset `size`.
  LogWriter(const std::filesystem::path& path, std::uint64_t size);

  /// Writes a framed record to the file (not yet durable); returns the byte offset after it. On an I/O
  /// error it truncates back to the previous record and rethrows Error(io_error).
  std::uint64_t append(std::span<const std::byte> header, std::span<const std::byte> payload);
  /// Whether a failed append could not be cut back (the file may end in a partial record).
  [[nodiscard]] bool broken() const;
  /// Returns once every byte up to offset is on stable storage.
  void wait_durable(std::uint64_t offset);
  /// Bytes written so far (appended, durable or not).
  [[nodiscard]] std::uint64_t appended() const;
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return file_.path(); }

 private:
  File file_;
  mutable std::mutex mutex_;
  std::condition_variable synced_;
  std::uint64_t appended_ = 0;
  std::uint64_t durable_ = 0;
  bool syncing_ = false;
  std::atomic<bool> broken_{false};
};

/// A segment's file name: "wal-" + its first sequence number in 20 digits + ".log".
std::string segment_name(std::uint64_t first_sequence);

/// The segments of a data directory as (first sequence number, path), sorted.
std::vector<std::pair<std::uint64_t, std::filesystem::path>> list_segments(const std::filesystem::path& dir);

}  // namespace softkv::detail
