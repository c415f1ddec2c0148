// Group commit for reads: concurrent single queries on one collection share one pass over its rows.
// The first query runs at once, alone; queries that arrive while a pass runs wait, and when it ends
// the first of them leads the next pass for all of them (up to a cap). No timer, so an idle store
// adds no latency.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "softkv/types.hpp"

namespace softkv::detail {

/// What one waiting query carries besides its own input and output: its failure, and its place in
/// the coalescer's hand-off (guarded by the coalescer's mutex).
struct CoalescedQuery {
  std::exception_ptr error;  ///< set by the pass that served the query, if it failed for this query
  bool done = false;         ///< served
  bool lead = false;         ///< must lead the next pass
};

/// Serves queries of type Q (derived from CoalescedQuery) alone or in batches; one coalescer per
/// collection and kind of pass. Thread safety: run() may be called from any number of threads.
template <class Q>
class Coalescer {
 public:
  /// At most max_batch queries share one pass.
  explicit Coalescer(std::size_t max_batch) : max_batch_(max_batch) {}

  /// Serves q: at once through alone(q) if no pass is running, otherwise in a later batch(queries)
  /// run by the first query that waited. Returns when q was served; a failure is in q.error.
  void run(Q& q, const std::function<void(Q&)>& alone, const std::function<void(std::span<Q* const>)>& batch) {
    std::unique_lock lock(mutex_);
    if (!running_) {
      running_ = true;
      count_pass(1);
      lock.unlock();
      try {
        alone(q);
      } catch (...) {
        q.error = std::current_exception();
      }
      hand_off();
      return;
    }
    queue_.push_back(&q);
    wake_.wait(lock, [&] { return q.done || q.lead; });
    if (q.done) return;
    std::vector<Q*> members;  // q is at the front: it was woken as the first of the queue
    while (!queue_.empty() && members.size() < max_batch_) {
      members.push_back(queue_.front());
      queue_.pop_front();
    }
    count_pass(members.size());
    lock.unlock();
    try {
      batch(members);
    } catch (...) {  // a failure of the whole pass (e.g. the collection became empty) is every member's
      const std::exception_ptr e = std::current_exception();
      for (Q* m : members)
        if (!m->error) m->error = e;
    }
    lock.lock();
    for (Q* m : members) m->done = true;
    lock.unlock();
    hand_off();
  }

  /// Serves q at once through alone(q), whether or not a pass is running, and counts it as a pass of
  /// one: for passes so short that handing one to another thread would cost more than it saves.
  void run_now(Q& q, const std::function<void(Q&)>& alone) {
    {
      std::lock_guard lock(mutex_);
      count_pass(1);
    }
    try {
      alone(q);
    } catch (...) {
      q.error = std::current_exception();
    }
  }

  /// Queries waiting for a pass now (for tests and statistics).
  [[nodiscard]] std::size_t waiting() const {
    std::lock_guard lock(mutex_);
    return queue_.size();
  }

  /// Queries served, passes run, largest pass so far.
  [[nodiscard]] CoalescingStats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  // The pass is over: the first waiting query leads the next one, or the coalescer goes idle.
  void hand_off() {
    {
      std::lock_guard lock(mutex_);
      if (queue_.empty()) running_ = false;
      else queue_.front()->lead = true;
    }
    wake_.notify_all();  // the members just served and the next leader
  }

  void count_pass(std::size_t n) {
    stats_.queries += n;
    stats_.passes += 1;
    stats_.max_batch = std::max<std::uint64_t>(stats_.max_batch, n);
  }

  const std::size_t max_batch_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool running_ = false;
  std::deque<Q*> queue_;
  CoalescingStats stats_;
};

}  // namespace softkv::detail
