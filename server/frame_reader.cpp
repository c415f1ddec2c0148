// FrameReader: buffer growth, the server-wide cap, and frame cutting (with wire::scan_frame).
#include "frame_reader.hpp"

#include <algorithm>
#include <cstring>

namespace softkv::server {

bool ReceiveBudget::try_take(std::size_t bytes) {
  std::size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > cap_ - std::min(used, cap_)) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

FrameReader::FrameReader(std::uint32_t max_frame, ReceiveBudget& budget)
    : max_frame_(max_frame), budget_(budget), data_(new std::byte[kInitialBuffer]), capacity_(kInitialBuffer) {}

FrameReader::~FrameReader() { budget_.give_back(charge_of(capacity_)); }

void FrameReader::resize(std::size_t capacity) {
  std::unique_ptr<std::byte[]> bigger(new std::byte[capacity]);
  if (end_ > begin_) std::memcpy(bigger.get(), data_.get() + begin_, end_ - begin_);
  end_ -= begin_;
  begin_ = 0;
  data_ = std::move(bigger);
  capacity_ = capacity;
}

bool FrameReader::grow_to(std::size_t capacity) {
  const std::size_t more = charge_of(capacity) - charge_of(capacity_);
  if (!budget_.try_take(more)) return false;
  resize(capacity);
  return true;
}

FrameReader::Next FrameReader::next() {
  begin_ += consumed_;
  consumed_ = 0;
  if (begin_ == end_) {  // no unfinished frame: an idle connection keeps only a small buffer
    begin_ = end_ = 0;
    if (capacity_ > kKeepBuffer) {
      budget_.give_back(charge_of(capacity_) - charge_of(kInitialBuffer));
      resize(kInitialBuffer);
    }
  }
  const auto held = std::span<const std::byte>(data_.get() + begin_, end_ - begin_);
  const wire::FrameScan scan = wire::scan_frame(held, max_frame_);
  Next out;
  switch (scan.status) {
    case wire::FrameScan::Status::complete:
      out.status = Status::frame;
      out.frame = scan.frame;
      consumed_ = scan.size;
      return out;
    case wire::FrameScan::Status::too_large:
      out.status = Status::close;
      out.code = ErrorCode::frame_too_large;
      out.reason = "frame of " + std::to_string(scan.claimed) + " bytes exceeds the limit of " + std::to_string(max_frame_);
      out.unread = wire::kLengthPrefix + std::uint64_t{scan.claimed} - held.size();
      return out;
    case wire::FrameScan::Status::malformed:
      out.status = Status::close;
      out.reason = "frame length " + std::to_string(scan.claimed) + " is shorter than the 9-byte frame header";
      return out;
    case wire::FrameScan::Status::need_more: break;
  }
  if (end_ < capacity_) return out;  // room left: read into it
  if (begin_ > 0) {                  // room at the front: move the partial frame there
    std::memmove(data_.get(), data_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
    return out;
  }
  // Full of one unfinished frame: double, but never past the frame's own end (its length passed the
  // limit check above; before the length is known the buffer holds at least 4 bytes already).
  const std::size_t want = wire::kLengthPrefix + std::size_t{scan.claimed};
  if (grow_to(std::min(want, capacity_ * 2))) return out;
  out.status = Status::close;
  out.code = ErrorCode::server_busy;
  out.reason = "the server holds its limit of " + std::to_string(budget_.cap()) +
               " bytes of unfinished frames; send large frames later or in smaller parts";
  out.unread = want - held.size();
  return out;
}

}  // namespace softkv::server
