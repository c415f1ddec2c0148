// File helpers over POSIX calls: short writes retried, every failure a typed io_error.
#include "storage/file.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "softkv/error.hpp"

namespace softkv::detail {

void throw_io_error(const std::string& what, const std::filesystem::path& path) {
  throw Error(ErrorCode::io_error, what + " " + path.string() + ": " + std::strerror(errno));
}

namespace {

std::atomic<unsigned> g_fault_ops{0};
std::atomic<std::uint64_t> g_fault_at{0};
std::atomic<std::uint64_t> g_fault_seen{0};
std::atomic<int> g_fault_errno{0};

// Whether this operation is the one the hook fails; sets errno if so. One relaxed load when disarmed.
bool injected(unsigned op) {
  if ((g_fault_ops.load(std::memory_order_relaxed) & op) == 0) return false;
  const std::uint64_t seen = g_fault_seen.fetch_add(1) + 1;
  if (seen != g_fault_at.load()) return false;
  errno = g_fault_errno.load();
  return true;
}

}  // namespace

void inject_fault(unsigned ops, std::uint64_t n, int error) {
  g_fault_ops.store(0);
  g_fault_seen.store(0);
  g_fault_at.store(n);
  g_fault_errno.store(error);
  g_fault_ops.store(n == 0 ? 0 : ops);
}

std::uint64_t fault_operations_seen() { return g_fault_seen.load(); }

File::File(const std::filesystem::path& path, int flags, int mode) : path_(path) {
  if ((flags & O_CREAT) != 0 && injected(kFaultCreate)) throw_io_error("cannot open", path);
  do fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw_io_error("cannot open", path);
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

void File::write_all(std::span<const std::byte> bytes) {
  if (!bytes.empty() && injected(kFaultWrite)) {
    const int error = errno;
    const std::size_t half = bytes.size() / 2;
    if (half > 0 && ::write(fd_, bytes.data(), half) < 0) {}  // a full disk takes part of a write
    errno = error;
    throw_io_error("cannot write", path_);
  }
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io_error("cannot write", path_);
    }
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
}

void File::sync_data() {
  if (injected(kFaultSync) || ::fdatasync(fd_) != 0) throw_io_error("cannot fsync", path_);
}

std::uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw_io_error("cannot stat", path_);
  return static_cast<std::uint64_t>(st.st_size);
}

void File::truncate(std::uint64_t size) {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) throw_io_error("cannot truncate", path_);
  if (::lseek(fd_, static_cast<off_t>(size), SEEK_SET) < 0) throw_io_error("cannot seek", path_);
}

void File::lock_exclusive() {
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      throw Error(ErrorCode::io_error, "data directory is in use by another process (" + path_.string() + " is locked)");
    throw_io_error("cannot lock", path_);
  }
}

void File::sync_all() {
  if (injected(kFaultSync) || ::fsync(fd_) != 0) throw_io_error("cannot fsync", path_);
}

std::size_t File::read_at(std::uint64_t offset, std::span<std::byte> out) const {
  for (;;) {
    const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
    if (n >= 0) return static_cast<std::size_t>(n);
    if (errno != EINTR) throw_io_error("cannot read", path_);
  }
}

std::vector<std::byte> read_file(const std::filesystem::path& path) {
  const File f(path, O_RDONLY);
  std::vector<std::byte> data(f.size());
  std::size_t done = 0;
  while (done < data.size()) {
    const std::size_t n = f.read_at(done, std::span(data).subspan(done));
    if (n == 0) throw Error(ErrorCode::io_error, "file " + path.string() + " shrank while being read");
    done += n;
  }
  return data;
}

void sync_directory(const std::filesystem::path& dir) { File(dir, O_RDONLY | O_DIRECTORY).sync_all(); }

void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  try {
    File f(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    f.write_all(bytes);
    f.sync_data();
    if (injected(kFaultRename) || ::rename(tmp.c_str(), path.c_str()) != 0) throw_io_error("cannot rename into", path);
  } catch (...) {
    std::error_code ignored;  // a failed write must not leave its partial copy taking the space
    std::filesystem::remove(tmp, ignored);
    throw;
  }
  sync_directory(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

}  // namespace softkv::detail
