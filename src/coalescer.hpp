// Group commit for reads: concurrent single queries on one collection share one pass over its rows.
// The first query runs at once, alone; queries that arrive while a pass runs wait, and when it ends
// the first of them leads the next pass for all of them (up to a cap). A leader first waits, briefly,
// for the queries the last pass says are coming: the clients a pass has just answered send their next
// queries a round trip later, and a pass started without them leaves them to wait a whole pass (passes
// then alternate, a few queries each). The wait ends as soon as they are there, and never lasts more
// than a quarter of a recent pass; an idle store (no pass within the last one's duration) and a lone
// client (passes of one) wait for nothing, so they keep the latency of no coalescing.
#pragma once

#include <algorithm>
#include <chrono>
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
      if (expected_now() <= 1) {  // idle, or a lone client: at once
        count_pass(1);
        const auto start = Clock::now();
        lock.unlock();
        try {
          alone(q);
        } catch (...) {
          q.error = std::current_exception();
        }
        hand_off(1, start);
        return;
      }
      queue_.push_front(&q);  // the clients of the last pass are coming back: q gathers them
    } else {
      queue_.push_back(&q);
      if (gathering_) gather_.notify_one();
      wake_.wait(lock, [&] { return q.done || q.lead; });
      if (q.done) return;
    }
    // q leads (it is at the front of the queue): first the brief wait for the expected arrivals.
    const std::size_t target = std::min(max_batch_, expected_);
    if (queue_.size() < target) {
      gathering_ = true;
      gather_.wait_until(lock, Clock::now() + window(), [&] { return queue_.size() >= target; });
      gathering_ = false;
    }
    std::vector<Q*> members;
    while (!queue_.empty() && members.size() < max_batch_) {
      members.push_back(queue_.front());
      queue_.pop_front();
    }
    count_pass(members.size());
    const auto start = Clock::now();
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
    hand_off(members.size(), start);
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
  using Clock = std::chrono::steady_clock;

  // The pass of `served` queries that began at start is over: it updates what the next leader expects
  // (the queries it served, which come back, and those that queued meanwhile) and how long passes
  // take; then the first waiting query leads the next pass, or the coalescer goes idle.
  void hand_off(std::size_t served, Clock::time_point start) {
    {
      std::lock_guard lock(mutex_);
      const Clock::time_point end = Clock::now();
      const double seconds = std::chrono::duration<double>(end - start).count();
      pass_seconds_ = pass_seconds_ == 0 ? seconds : 0.75 * pass_seconds_ + 0.25 * seconds;
      last_end_ = end;
      expected_ = served + queue_.size();
      if (queue_.empty()) running_ = false;
      else queue_.front()->lead = true;
    }
    wake_.notify_all();  // the members just served and the next leader
  }

  // What a query arriving at an idle coalescer should gather: 1 (nothing) when no pass ended within
  // the last pass's duration (the store was idle: its clients are not waiting on a round trip).
  [[nodiscard]] std::size_t expected_now() const {
    const double since = std::chrono::duration<double>(Clock::now() - last_end_).count();
    return since > pass_seconds_ ? 1 : expected_;
  }

  // The longest a leader waits for the expected arrivals: a quarter of a recent pass.
  [[nodiscard]] Clock::duration window() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(0.25 * pass_seconds_));
  }

  void count_pass(std::size_t n) {
    stats_.queries += n;
    stats_.passes += 1;
    stats_.max_batch = std::max<std::uint64_t>(stats_.max_batch, n);
  }

  const std::size_t max_batch_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable gather_;  // a gathering leader waits on it; arrivals notify it
  bool running_ = false;
  bool gathering_ = false;
  std::size_t expected_ = 1;    // queries the next pass should gather: the last pass's and those queued meanwhile
  double pass_seconds_ = 0;     // recent passes' duration (moving average)
  Clock::time_point last_end_;  // when the last pass ended
  std::deque<Q*> queue_;
  CoalescingStats stats_;
};

}  // namespace softkv::detail
