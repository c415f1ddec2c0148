// FrameReader: one connection's receive buffer, cut into frames; grows only as bytes arrive, under a
// server-wide cap on the memory that unfinished frames may hold. No sockets: bytes in, frames out.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "softkv/error.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {

/// The receive-buffer memory all connections may hold together (bytes above each buffer's first
/// FrameReader::kInitialBuffer). Thread safe: readers on every I/O thread share one.
class ReceiveBudget {
 public:
  /// A budget of cap bytes.
  explicit ReceiveBudget(std::size_t cap) : cap_(cap) {}
  /// Takes bytes if they fit under the cap; false (and nothing taken) if not.
  bool try_take(std::size_t bytes);
  /// Returns bytes taken earlier.
  void give_back(std::size_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  /// Bytes currently taken.
  [[nodiscard]] std::size_t used() const { return used_.load(std::memory_order_relaxed); }
  /// The cap.
  [[nodiscard]] std::size_t cap() const { return cap_; }

 private:
  const std::size_t cap_;
  std::atomic<std::size_t> used_{0};
};

/// Owns a connection's receive buffer. The owner loops: next(); on need_more, read into space() and
/// call received(n). The buffer doubles only when full, up to what the pending frame needs, so a
/// frame's declared length never allocates by itself; growth past kInitialBuffer is charged to the
/// budget, and a buffer above kKeepBuffer is released as soon as it holds no unfinished frame.
/// Not thread safe (one per connection).
class FrameReader {
 public:
  static constexpr std::size_t kInitialBuffer = 4096;     ///< every connection's free buffer
  static constexpr std::size_t kKeepBuffer = 64 * 1024;  ///< larger buffers are released when empty

  /// What next() found.
  enum class Status {
    frame,      ///< a whole frame: `frame` is valid until the next call to next()
    need_more,  ///< read into space(), then received()
    close,      ///< the connection cannot go on: answer `code`/`reason`, then close
  };
  /// The result of next().
  struct Next {
    Status status = Status::need_more;  ///< which of the three
    wire::Frame frame;                  ///< Status::frame only; points into the buffer
    ErrorCode code = ErrorCode::protocol_error;  ///< Status::close: the error to send
    std::string reason;                 ///< Status::close: its message
    std::uint64_t unread = 0;           ///< Status::close: bytes of the refused frame not yet received
  };

  /// A reader admitting frames up to max_frame (the length field), charging growth to budget.
  FrameReader(std::uint32_t max_frame, ReceiveBudget& budget);
  ~FrameReader();
  FrameReader(const FrameReader&) = delete;
  FrameReader& operator=(const FrameReader&) = delete;

  /// Changes the frame limit (e.g. once the connection has authenticated); applies to frames whose
  /// length has not been accepted yet.
  void set_max_frame(std::uint32_t max_frame) { max_frame_ = max_frame; }
  /// The next frame, "need more" (with space() ready, grown if the frame needs it), or a reason to close.
  Next next();
  /// Where to receive; not empty after next() said need_more.
  [[nodiscard]] std::span<std::byte> space() { return {data_.get() + end_, capacity_ - end_}; }
  /// n bytes were written to the front of space().
  void received(std::size_t n) { end_ += n; }
  /// Bytes received that no returned frame covers (the start of the next frame, or more frames).
  [[nodiscard]] std::size_t pending() const { return end_ - begin_ - consumed_; }
  /// The buffer's current size in bytes.
  [[nodiscard]] std::size_t capacity() const { return capacity_; }

 private:
  bool grow_to(std::size_t capacity);
  void resize(std::size_t capacity);
  [[nodiscard]] static std::size_t charge_of(std::size_t capacity) {
    return capacity > kInitialBuffer ? capacity - kInitialBuffer : 0;
  }

  std::uint32_t max_frame_;
  ReceiveBudget& budget_;
  std::unique_ptr<std::byte[]> data_;  // default-initialised: capacity is not touched until written
  std::size_t capacity_ = 0;
  std::size_t begin_ = 0, end_ = 0;  // unconsumed bytes are [begin_, end_)
  std::size_t consumed_ = 0;         // size of the frame last returned, dropped by the next call
};

}  // namespace softkv::server
