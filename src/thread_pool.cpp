// ThreadPool: a queue of parts, workers that drain it, callers that help while they wait.
#include "thread_pool.hpp"

#include <pthread.h>

#include <atomic>
#include <exception>

namespace softkv::detail {

ThreadPool::ThreadPool(std::size_t workers) {
  workers_.reserve(workers);
  for (std::size_t i = 0; i < workers; ++i)
    workers_.emplace_back([this] {
      ::pthread_setname_np(::pthread_self(), kWorkerName);  // visible in top -H and /proc; the benchmark tells them apart by it
      worker_loop();
    });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::shared() {
  static ThreadPool pool(std::thread::hardware_concurrency() > 1 ? std::thread::hardware_concurrency() - 1 : 0);
  return pool;
}

bool ThreadPool::run_one_queued() {
  std::function<void()> task;
  {
    std::lock_guard lock(mutex_);
    if (queue_.empty()) return false;
    task = std::move(queue_.front());
    queue_.pop_front();
  }
  task();
  return true;
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::run(std::size_t parts, const std::function<void(std::size_t)>& fn) {
  if (parts == 0) return;
  if (parts == 1 || workers_.empty()) {
    for (std::size_t i = 0; i < parts; ++i) fn(i);
    return;
  }
  // Shared completion record; it lives on this frame, which outlives every part (we wait below).
  struct Completion {
    std::mutex mutex;
    std::condition_variable done;
    std::size_t remaining;
    std::exception_ptr error;
  } completion{{}, {}, parts - 1, nullptr};

  auto finish = [&completion](std::exception_ptr e) {
    std::lock_guard lock(completion.mutex);
    if (e && !completion.error) completion.error = e;
    if (--completion.remaining == 0) completion.done.notify_all();
  };
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 1; i < parts; ++i) {
      queue_.emplace_back([&fn, &finish, i] {
        try {
          fn(i);
          finish(nullptr);
        } catch (...) {
          finish(std::current_exception());
        }
      });
    }
  }
  wake_.notify_all();

  std::exception_ptr first;
  try {
    fn(0);
  } catch (...) {
    first = std::current_exception();
  }
  // Help with queued parts (ours or another caller's) instead of sleeping while work waits.
  for (;;) {
    {
      std::lock_guard lock(completion.mutex);
      if (completion.remaining == 0) break;
    }
    if (!run_one_queued()) {
      std::unique_lock lock(completion.mutex);
      completion.done.wait(lock, [&] { return completion.remaining == 0; });
      break;
    }
  }
  if (!first) first = completion.error;
  if (first) std::rethrow_exception(first);
}

}  // namespace softkv::detail
