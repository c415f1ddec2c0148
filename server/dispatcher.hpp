// The sharded server's MPI side: rank 0's dispatcher, which runs every engine request on every rank
// (coalescing concurrent queries into one collective pass), and the loop by which the other ranks follow it.
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "handler.hpp"
#include "shard.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {

/// The most queries one coalesced pass of the sharded server serves (the single server's cap, the
/// batch kernel's sweet spot); a request holding more runs alone.
inline constexpr std::size_t kMaxShardedBatch = 64;

/// Rank 0's hand-over point between the request threads and the MPI thread (rank 0's main thread,
/// the only thread of the job's processes on rank 0 that calls MPI). With coalescing on, a query that
/// every shard answers in one pass takes along the queued queries with the same collection, kind and
/// options (up to kMaxShardedBatch queries): one broadcast, one pass over each shard, one reduction,
/// and each client gets its own slice of the answer (docs/SHARDING.md, "The sharded server").
/// Thread safety: forward() and close() from any thread; run() on the MPI thread only.
class Dispatcher final : public RequestForwarder {
 public:
  /// Runs requests over comm (this is rank 0) with shard; coalesce: --coalesce on.
  Dispatcher(MPI_Comm comm, Shard& shard, bool coalesce) : comm_(comm), shard_(shard), coalesce_(coalesce) {}

  /// Queues request for the MPI thread and waits for its reply.
  wire::Reply forward(const wire::Request& request) override;

  /// No more requests: run() returns once the queue is empty.
  void close();

  /// The MPI thread: runs each request on every rank (in arrival order, but for the queued queries a
  /// pass takes along) until close(); then tells the other ranks to stop.
  void run();

 private:
  struct Job {
    const wire::Request* request;
    std::promise<wire::Reply> reply;
    std::string key;  ///< a query's collection, kind and options as encoded; empty: never coalesced
  };
  struct Member {
    Job* job;
    std::size_t queries;  ///< how many queries it holds
  };

  // The next job, or null once closed and drained.
  Job* next();
  // The queued jobs with first's key whose queries (about size / d each) fit in room, taken out of the queue.
  std::vector<Job*> take_companions(const Job& first, std::size_t d, std::size_t room);
  // Runs request on every rank (one broadcast, one collective execute); failures become ErrorReply.
  wire::Reply run_everywhere(const wire::Request& request);
  // Runs the members' queries (valid one-pass queries with one key) as one request and answers each
  // with its slice; when that request fails, runs each member alone, so that each gets its own answer.
  void run_coalesced(const std::vector<Member>& members);
  // Counts a pass serving n queries on collection name.
  void count_pass(const std::string& name, std::size_t n);
  // query_stats: this collection's counters (unknown_collection if none has that name).
  wire::Reply query_stats(const wire::QueryStats& m) const;

  // The header goes out with a non-blocking broadcast: the other ranks wait for it without spinning.
  void send_header(bool shutdown, std::size_t bytes);

  MPI_Comm comm_;
  Shard& shard_;
  const bool coalesce_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job*> queue_;
  bool closed_ = false;
  std::map<std::string, CoalescingStats> counters_;  ///< per collection; the MPI thread's alone
};

/// A rank other than 0: waits for rank 0's commands (polling a non-blocking broadcast, sleeping in
/// between, so that an idle rank takes no CPU) and runs each with the others until the shutdown command.
void follow(MPI_Comm comm, Shard& shard);

}  // namespace softkv::server
