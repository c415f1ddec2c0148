// A reader-writer lock where a waiting writer goes before newly arriving readers (no writer starvation).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>

namespace softkv::detail {

/// Meets the SharedMutex requirements (usable with std::shared_lock / std::unique_lock).
/// glibc's std::shared_mutex prefers readers, so a steady stream of queries can hold off a write
/// indefinitely; here a writer waits only for the readers already inside.
class WriterFirstMutex {
 public:
  void lock() {
    std::unique_lock l(mutex_);
    ++writers_waiting_;
    writer_turn_.wait(l, [this] { return !writer_active_ && readers_ == 0; });
    --writers_waiting_;
    writer_active_ = true;
  }

  void unlock() {
    {
      std::lock_guard l(mutex_);
      writer_active_ = false;
    }
    writer_turn_.notify_one();
    reader_turn_.notify_all();
  }

  void lock_shared() {
    std::unique_lock l(mutex_);
    reader_turn_.wait(l, [this] { return !writer_active_ && writers_waiting_ == 0; });
    ++readers_;
  }

  void unlock_shared() {
    bool last;
    {
      std::lock_guard l(mutex_);
      last = --readers_ == 0;
    }
    if (last) writer_turn_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable writer_turn_;
  std::condition_variable reader_turn_;
  std::size_t readers_ = 0;
  std::size_t writers_waiting_ = 0;
  bool writer_active_ = false;
};

}  // namespace softkv::detail
