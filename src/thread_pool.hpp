// A small fixed pool that splits one scan over the machine's cores; the caller runs a part too.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace softkv::detail {

/// Fixed set of worker threads. Thread safe: many callers may run() at once; tasks never block.
class ThreadPool {
 public:
  /// The name every worker thread carries (at most 15 characters, the kernel's limit).
  static constexpr const char* kWorkerName = "softkv-scan";

  /// Starts workers threads (0 is allowed: everything then runs on the caller).
  explicit ThreadPool(std::size_t workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Workers plus the calling thread.
  [[nodiscard]] std::size_t concurrency() const noexcept { return workers_.size() + 1; }

  /// Runs fn(0) .. fn(parts - 1), part 0 on the calling thread, and returns when all are done.
  /// The first exception thrown by a part is rethrown here after every part has finished.
  void run(std::size_t parts, const std::function<void(std::size_t)>& fn);

  /// The process-wide pool used by scans: hardware_concurrency() - 1 workers.
  static ThreadPool& shared();

 private:
  bool run_one_queued();
  void worker_loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace softkv::detail
