// Rank 0's MPI dispatcher of the sharded server and the other ranks' command loop: every request is
// broadcast (its own wire encoding) and run on every rank together (shard.cpp); concurrent queries
// that every shard answers in one pass share that pass (group commit for reads, as src/coalescer.hpp).
#include "dispatcher.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <string>
#include <thread>
#include <type_traits>
#include <variant>

#include "mpi/sharded_impl.hpp"

namespace softkv::server {
namespace {

// What rank 0 broadcasts before each command's payload.
enum class Command : std::uint32_t { request = 1, shutdown = 2 };
struct CommandHeader {
  Command command = Command::shutdown;
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;  // the encoded request that follows
};

// What must be equal for queries to share a pass: collection, kind and options, as the other ranks
// will see them (the wire encoding of the query without its vectors).
std::string coalescing_key(const wire::Query& q) {
  const std::vector<std::byte> bytes =
      wire::encode_request(wire::Query{q.name, q.kind, q.options, {}, q.decoded_version}, 0, wire::kProtocolVersion);
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// results[first, first + n) of a soft or hard reply, as that kind of reply.
wire::Reply slice(wire::Reply& reply, std::size_t first, std::size_t n) {
  const auto part = [&](auto& results) {
    using Results = std::remove_reference_t<decltype(results)>;
    return Results(std::make_move_iterator(results.begin() + static_cast<std::ptrdiff_t>(first)),
                   std::make_move_iterator(results.begin() + static_cast<std::ptrdiff_t>(first + n)));
  };
  if (auto* soft = std::get_if<wire::SoftReply>(&reply)) return wire::SoftReply{part(soft->results)};
  return wire::HardReply{part(std::get<wire::HardReply>(reply).results)};
}

// The number of answers a soft or hard reply holds (0 for any other reply).
std::size_t answers_in(const wire::Reply& reply) {
  if (const auto* soft = std::get_if<wire::SoftReply>(&reply)) return soft->results.size();
  if (const auto* hard = std::get_if<wire::HardReply>(&reply)) return hard->results.size();
  return 0;
}

}  // namespace

wire::Reply Dispatcher::forward(const wire::Request& request) {
  Job job{&request, {}, {}};
  if (const auto* q = std::get_if<wire::Query>(&request); q != nullptr && coalesce_) {
    try {
      job.key = coalescing_key(*q);  // on the request thread: the MPI thread only compares
    } catch (...) {                  // (out of memory) the query runs alone
      job.key.clear();
    }
  }
  auto reply = job.reply.get_future();
  {
    std::lock_guard lock(mutex_);
    if (closed_) return wire::ErrorReply{ErrorCode::server_busy, "the sharded server is shutting down"};
    queue_.push_back(&job);
  }
  ready_.notify_one();
  return reply.get();
}

void Dispatcher::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  ready_.notify_one();
}

Dispatcher::Job* Dispatcher::next() {
  std::unique_lock lock(mutex_);
  ready_.wait(lock, [&] { return closed_ || !queue_.empty(); });
  if (queue_.empty()) return nullptr;
  Job* job = queue_.front();
  queue_.pop_front();
  return job;
}

std::vector<Dispatcher::Job*> Dispatcher::take_companions(const Job& first, std::size_t d, std::size_t room) {
  std::vector<Job*> taken;
  std::lock_guard lock(mutex_);
  for (auto it = queue_.begin(); it != queue_.end() && room > 0;) {
    if ((*it)->key != first.key) {  // another collection, kind or options, or not a query (an empty key)
      ++it;
      continue;
    }
    const std::size_t n = std::max<std::size_t>(1, std::get<wire::Query>(*(*it)->request).queries.size() / d);
    if (n > room) {
      ++it;
      continue;
    }
    taken.push_back(*it);
    room -= n;
    it = queue_.erase(it);
  }
  return taken;
}

void Dispatcher::run() {
  while (Job* first = next()) {
    if (const auto* m = std::get_if<wire::QueryStats>(first->request)) {
      first->reply.set_value(query_stats(*m));
      continue;
    }
    std::size_t n = 0;
    if (!first->key.empty()) n = shard_.one_pass_queries(std::get<wire::Query>(*first->request));
    if (n == 0 || n > kMaxShardedBatch) {  // not coalesced, not counted (as on the single server)
      wire::Reply reply = run_everywhere(*first->request);
      if (!std::holds_alternative<wire::ErrorReply>(reply)) {
        // A collection created or dropped (a name now meaning another collection) starts from zero counters.
        if (const auto* c = std::get_if<wire::Create>(first->request)) counters_.erase(c->name);
        if (const auto* dr = std::get_if<wire::Drop>(first->request)) counters_.erase(dr->name);
      }
      first->reply.set_value(std::move(reply));
      continue;
    }
    // The queries queued behind it with the same key join its pass. Each is checked on its own: one that
    // fails a check (a wrong dimension, a NaN) runs alone afterwards and gets its own error.
    const std::size_t d = std::get<wire::Query>(*first->request).queries.size() / n;
    std::vector<Member> members{{first, n}};
    std::vector<Job*> alone;
    for (Job* job : take_companions(*first, d, kMaxShardedBatch - n)) {
      const std::size_t m = shard_.one_pass_queries(std::get<wire::Query>(*job->request));
      if (m == 0) alone.push_back(job);
      else members.push_back({job, m});
    }
    run_coalesced(members);
    for (Job* job : alone) job->reply.set_value(run_everywhere(*job->request));
  }
  send_header(/*shutdown=*/true, 0);
}

void Dispatcher::run_coalesced(const std::vector<Member>& members) {
  // A member's request belongs to its connection's thread, which may free it as soon as its reply is
  // set: everything read from a request (the name the pass is counted under) is read before that.
  const auto& lead = std::get<wire::Query>(*members.front().job->request);
  const std::string name = lead.name;
  if (members.size() == 1) {
    wire::Reply reply = run_everywhere(lead);
    count_pass(name, members.front().queries);
    members.front().job->reply.set_value(std::move(reply));
    return;
  }
  std::size_t total = 0;
  wire::Reply reply;
  try {
    wire::Query batch{lead.name, lead.kind, lead.options, {}, lead.decoded_version};
    for (const Member& m : members) {
      const auto& q = std::get<wire::Query>(*m.job->request).queries;
      batch.queries.insert(batch.queries.end(), q.begin(), q.end());
      total += m.queries;
    }
    reply = run_everywhere(batch);
  } catch (...) {  // (out of memory building the batch) nothing was broadcast: each runs alone below
    reply = current_error_reply();
  }
  if (std::holds_alternative<wire::ErrorReply>(reply)) {
    // Every member passed its checks, so this is rare (an overflow in one query, the collection
    // emptied or dropped meanwhile): no member may get an error that another member's query caused.
    for (const Member& m : members) {
      wire::Reply alone = run_everywhere(*m.job->request);
      count_pass(name, m.queries);
      m.job->reply.set_value(std::move(alone));
    }
    return;
  }
  if (answers_in(reply) != total) {  // a broken invariant: say so to every member, who lost nothing
    for (const Member& m : members)
      m.job->reply.set_value(wire::ErrorReply{ErrorCode::internal, "internal error (please report): a coalesced sharded query "
                                                                   "answered " + std::to_string(answers_in(reply)) +
                                                                   " of " + std::to_string(total) + " queries"});
    return;
  }
  count_pass(name, total);
  std::size_t first = 0;
  for (const Member& m : members) {
    m.job->reply.set_value(slice(reply, first, m.queries));
    first += m.queries;
  }
}

wire::Reply Dispatcher::run_everywhere(const wire::Request& request) {
  try {
    const std::vector<std::byte> bytes = wire::encode_request(request, 0, wire::kProtocolVersion);
    detail::mpi_count(bytes.size(), "a request");
    send_header(/*shutdown=*/false, bytes.size());
    MPI_Bcast(const_cast<std::byte*>(bytes.data()), static_cast<int>(bytes.size()), MPI_BYTE, 0, comm_);
    return shard_.execute(request);
  } catch (...) {
    return current_error_reply();
  }
}

void Dispatcher::count_pass(const std::string& name, std::size_t n) {
  CoalescingStats& s = counters_[name];
  s.queries += n;
  s.passes += 1;
  s.max_batch = std::max<std::uint64_t>(s.max_batch, n);
}

wire::Reply Dispatcher::query_stats(const wire::QueryStats& m) const {
  try {
    shard_.require_collection(m.name);
    const auto it = counters_.find(m.name);
    return wire::QueryStatsReply{it != counters_.end() ? it->second : CoalescingStats{}};
  } catch (...) {
    return current_error_reply();
  }
}

void Dispatcher::send_header(bool shutdown, std::size_t bytes) {
  CommandHeader h{shutdown ? Command::shutdown : Command::request, 0, bytes};
  MPI_Request r = MPI_REQUEST_NULL;
  MPI_Ibcast(&h, sizeof(h), MPI_BYTE, 0, comm_, &r);
  MPI_Wait(&r, MPI_STATUS_IGNORE);
}

void follow(MPI_Comm comm, Shard& shard) {
  for (;;) {
    CommandHeader h;
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Ibcast(&h, sizeof(h), MPI_BYTE, 0, comm, &r);
    auto pause = std::chrono::microseconds(20);
    for (int done = 0;;) {
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (done != 0) break;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    if (h.command != Command::request) return;
    std::vector<std::byte> bytes(h.bytes);
    MPI_Bcast(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, 0, comm);
    wire::Request request;
    try {
      request = decode_command(bytes);
    } catch (const std::exception& e) {  // rank 0 encoded it: the ranks could no longer agree on anything
      spdlog::critical("shard {}: cannot decode a command from rank 0 ({}); aborting the job", shard.rank(), e.what());
      MPI_Abort(comm, 3);
    }
    try {
      (void)shard.execute(request);
    } catch (const std::exception&) {  // every rank throws alike; rank 0 reports it to the client
    }
  }
}

}  // namespace softkv::server
