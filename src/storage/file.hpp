// POSIX file helpers for durable storage: whole writes, fsync, atomic replace, directory sync, locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace softkv::detail {

/// An owned file descriptor; every failure throws Error(io_error) naming the path and errno.
class File {
 public:
  /// Opens path with open(2) flags (O_CLOEXEC is added) and mode.
  File(const std::filesystem::path& path, int flags, int mode = 0644);
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  /// Writes all bytes at the current position (retrying short writes and EINTR).
  void write_all(std::span<const std::byte> bytes);
  /// fdatasync(2): the data (and the size) are on stable storage when it returns.
  void sync_data();
  /// fsync(2), also for directories (making creates and renames in them durable).
  void sync_all();
  /// pread(2) of up to out.size() bytes at offset; returns how many were read (0 at end of file).
  std::size_t read_at(std::uint64_t offset, std::span<std::byte> out) const;
  /// Current size in bytes.
  [[nodiscard]] std::uint64_t size() const;
  /// Truncates to size bytes and moves the write position there.
  void truncate(std::uint64_t size);
  /// Takes an exclusive advisory lock (flock); throws io_error if another process holds it.
  void lock_exclusive();
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  int fd_ = -1;
  std::filesystem::path path_;
};

/// The whole content of a file; throws Error(io_error) if it cannot be read.
std::vector<std::byte> read_file(const std::filesystem::path& path);

/// Writes bytes to path.tmp, fsyncs it, renames it over path and fsyncs the directory.
void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes);

/// fsync(2) on a directory, so a rename or create in it is durable.
void sync_directory(const std::filesystem::path& dir);

/// Throws Error(io_error) with the operation, the path and strerror(errno).
[[noreturn]] void throw_io_error(const std::string& what, const std::filesystem::path& path);

/// Kinds of file operation the fault hook can fail (a bit mask).
enum FaultOp : unsigned {
  kFaultWrite = 1,   ///< File::write_all (fails after writing half its bytes, as a full disk does)
  kFaultSync = 2,    ///< File::sync_data / sync_all
  kFaultRename = 4,  ///< the rename of write_file_atomically
  kFaultCreate = 8,  ///< opening with O_CREAT
};

/// Test hook (SQLite's I/O-error loop is the model): from now on, the n-th (1-based) file operation
/// of a kind in `ops` fails with errno `error`, once; n = 0 disarms it. Process-wide.
void inject_fault(unsigned ops, std::uint64_t n, int error);

/// Operations of the armed kinds seen since inject_fault (a fault loop runs n up to this count).
std::uint64_t fault_operations_seen();

}  // namespace softkv::detail
