// The sharded server. Rank 0 runs the TCP front end; its request threads hand every engine request to
// the MPI dispatcher (rank 0's main thread, the only thread of the process that calls MPI), which
// broadcasts it (the request's own wire encoding) to every rank and runs it there with them: writes
// on the owners of their rows (id mod P), queries on every shard merged with the library's partial
// records (detail::ShardScan, the same code as ShardedCollection), stats summed.
#include "sharded.hpp"

#include <mpi.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "handler.hpp"
#include "mpi/sharded_impl.hpp"
#include "overloaded.hpp"
#include "softkv/simd.hpp"
#include "softkv/version.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {
namespace {

namespace fs = std::filesystem;
using detail::Overloaded;

// What rank 0 broadcasts before each command's payload.
enum class Command : std::uint32_t { request = 1, shutdown = 2 };
struct CommandHeader {
  Command command = Command::shutdown;
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;  // the encoded request that follows
};

// Rank 0's record of the last committed cross-shard write: DIR/commits, two 16-byte slots (the
// transaction number and a check word) written alternately, so that a torn write spoils only the
// slot being written and the other still holds the previous commit.
class CommitLog {
 public:
  explicit CommitLog(const fs::path& path, bool sync) : sync_(sync) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error(ErrorCode::io_error, "cannot open " + path.string() + ": " + std::strerror(errno));
    std::uint64_t slots[4] = {};
    const ssize_t n = ::pread(fd_, slots, sizeof(slots), 0);
    for (int i = 0; i < 2 && n >= (i + 1) * 16; ++i)
      if (slots[2 * i + 1] == check(slots[2 * i])) last_ = std::max(last_, slots[2 * i]);
  }
  ~CommitLog() { ::close(fd_); }
  CommitLog(const CommitLog&) = delete;
  CommitLog& operator=(const CommitLog&) = delete;

  // The last committed transaction (0: none).
  [[nodiscard]] std::uint64_t last() const { return last_; }
  // Records txn (> last()) as committed, on stable storage when sync.
  void commit(std::uint64_t txn) {
    const std::uint64_t slot[2] = {txn, check(txn)};
    if (::pwrite(fd_, slot, sizeof(slot), static_cast<off_t>((txn % 2) * sizeof(slot))) != static_cast<ssize_t>(sizeof(slot)) ||
        (sync_ && ::fdatasync(fd_) != 0))
      throw Error(ErrorCode::io_error, std::string("cannot record a commit point in the commit log: ") + std::strerror(errno));
    last_ = txn;
  }

 private:
  static std::uint64_t check(std::uint64_t txn) { return txn * 0x9E3779B97F4A7C15ull + 0x736f66746b76ull; }
  int fd_ = -1;
  bool sync_;
  std::uint64_t last_ = 0;
};

// Writes bytes to path, on stable storage (file and directory) when sync.
void write_file(const fs::path& path, std::span<const std::byte> bytes, bool sync) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(ErrorCode::io_error, "cannot create " + path.string() + ": " + std::strerror(errno));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      throw Error(ErrorCode::io_error, "cannot write " + path.string() + ": " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  const bool synced = !sync || ::fdatasync(fd) == 0;
  ::close(fd);
  if (!synced) throw Error(ErrorCode::io_error, "cannot fsync " + path.string() + ": " + std::strerror(errno));
  if (!sync) return;
  const int dfd = ::open(path.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// The request a part file holds (a request frame, as rank 0 broadcasts them).
wire::Request decode_command(std::span<const std::byte> bytes) {
  const wire::FrameScan scan = wire::scan_frame(bytes, std::numeric_limits<std::uint32_t>::max());
  if (scan.status != wire::FrameScan::Status::complete) throw Error(ErrorCode::corrupt_file, "an incomplete request frame");
  return wire::decode_request(scan.frame, wire::kProtocolVersion);
}

// Test hook (tests/test_sharded_server.cpp): SOFTKV_TEST_CRASH="<rank>:<write|parts|commit>:<n>" makes
// that rank kill itself with SIGKILL in its n-th cross-shard write: before it writes its part (write),
// once every part is durable (parts), or once rank 0 has logged the commit point (commit).
struct CrashPoint {
  int rank = -1;
  std::string point;
  std::uint64_t nth = 0;
  CrashPoint() {
    const char* spec = std::getenv("SOFTKV_TEST_CRASH");
    if (spec == nullptr) return;
    const std::string s(spec);
    const auto a = s.find(':'), b = s.rfind(':');
    if (a == std::string::npos || b == a) return;
    rank = std::atoi(s.substr(0, a).c_str());
    point = s.substr(a + 1, b - a - 1);
    nth = std::strtoull(s.substr(b + 1).c_str(), nullptr, 10);
  }
  void at(std::size_t my_rank, const char* here, std::uint64_t count) const {
    if (rank == static_cast<int>(my_rank) && point == here && count == nth) ::kill(::getpid(), SIGKILL);
  }
};

// One rank's part of the sharded server: its Database (its shard of every collection) and the
// communicator. execute() is collective: every rank calls it with the same request, in the same order.
class Shard {
 public:
  // dir: the job's data directory (DIR), where this rank keeps its part files; commits: rank 0's
  // commit log (null on the other ranks); sync: fsync part files (--fsync always).
  Shard(MPI_Comm comm, Database& db, fs::path dir, CommitLog* commits, bool sync)
      : comm_(comm), db_(db), dir_(std::move(dir)), commits_(commits), sync_(sync) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
    rank_ = static_cast<std::size_t>(rank);
    ranks_ = static_cast<std::size_t>(size);
  }

  // Collective, at start after every rank opened its Database: completes the cross-shard writes that
  // rank 0 committed (re-applying this rank's part, which is idempotent) and drops the parts of the
  // others, which no client was told had succeeded. Returns the parts re-applied and dropped here.
  std::pair<std::size_t, std::size_t> recover(std::uint64_t last_committed) {
    next_txn_ = last_committed + 1;
    std::size_t applied = 0, dropped = 0;
    agree([&] {
      const std::string prefix = "part-" + std::to_string(rank_) + "-";
      std::vector<std::pair<std::uint64_t, fs::path>> parts;
      for (const auto& e : fs::directory_iterator(dir_)) {
        const std::string name = e.path().filename().string();
        if (name.rfind(prefix, 0) != 0) continue;
        parts.emplace_back(std::strtoull(name.c_str() + prefix.size(), nullptr, 10), e.path());
      }
      std::sort(parts.begin(), parts.end());
      for (const auto& [txn, path] : parts) {
        if (txn <= last_committed) {
          std::ifstream in(path, std::ios::binary);
          const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          wire::Request part;
          try {
            part = decode_command(std::as_bytes(std::span(text.data(), text.size())));
          } catch (const Error& e) {
            throw Error(ErrorCode::corrupt_file, path.string() + " (the part of committed write " + std::to_string(txn) +
                                                     ") cannot be read: " + e.what());
          }
          apply_part(part);
          ++applied;
        } else {
          ++dropped;
        }
        fs::remove(path);
      }
    });
    return {applied, dropped};
  }

  // The reply to request on rank 0 (other ranks discard theirs). A failure throws softkv::Error on
  // every rank alike.
  wire::Reply execute(const wire::Request& request) {
    return std::visit(
        Overloaded{
            [](const wire::Hello&) -> wire::Reply { throw session_only(); },
            [](const wire::Auth&) -> wire::Reply { throw session_only(); },
            [](const wire::Ping&) -> wire::Reply { throw session_only(); },
            [&](const wire::Create& m) -> wire::Reply {
              agree([&] {
                Database::check_name(m.name);
                check_config(m.config);
                if (db_.has_collection(m.name)) throw Error(ErrorCode::collection_exists, "a collection named '" + m.name + "' exists");
              });
              mutate(m, ranks_);
              return wire::Ack{};
            },
            [&](const wire::Drop& m) -> wire::Reply {
              agree([&] { (void)db_.collection(m.name); });
              mutate(m, ranks_);
              return wire::Ack{};
            },
            [&](const wire::List&) -> wire::Reply { return wire::NamesReply{db_.list_collections()}; },
            [&](const wire::Describe& m) -> wire::Reply { return describe(m); },
            [&](const wire::QueryStats&) -> wire::Reply {
              throw Error(ErrorCode::unsupported,
                          "query_stats is not supported by the sharded server (coalescing counters are per rank)");
            },
            [&](const wire::Add& m) -> wire::Reply { return add(m); },
            [&](const wire::Upsert& m) -> wire::Reply {
              agree([&] {
                (void)db_.collection(m.name)->prepare(m.ids, m.keys, m.values, m.tags);
                detail::mpi_count(m.ids.size(), "a write");
              });
              write_mine(m.name, m.ids, m.keys, m.values, m.tags);
              return wire::Ack{};
            },
            [&](const wire::Remove& m) -> wire::Reply { return remove(m); },
            [&](const wire::Get& m) -> wire::Reply { return get(m); },
            [&](const wire::Query& m) -> wire::Reply { return query(m); },
            [&](const wire::Snapshot&) -> wire::Reply {
              agree([&] { db_.snapshot(); });
              return wire::Ack{};
            },
            [&](const wire::Stats&) -> wire::Reply {
              std::uint64_t sequence = db_.last_sequence();  // the sum over shards of their logged mutations
              MPI_Allreduce(MPI_IN_PLACE, &sequence, 1, MPI_UINT64_T, MPI_SUM, comm_);
              return wire::StatsReply{kVersion, std::string(simd_path()), db_.list_collections().size(), 0, 0, sequence};
            },
        },
        request);
  }

  [[nodiscard]] std::size_t rank() const { return rank_; }

 private:
  static Error session_only() { return Error(ErrorCode::internal, "hello, auth and ping are the session's, not the shards'"); }

  // Runs body on this rank, then agrees with every rank: when any rank failed, every rank throws the
  // error of the rank with the highest code (the lowest such rank), with that rank's message.
  template <typename Body>
  void agree(const Body& body) {
    int code = 0;
    std::string message;
    try {
      body();
    } catch (const Error& e) {
      code = static_cast<int>(e.code());
      message = e.what();
    } catch (const std::bad_alloc&) {
      code = static_cast<int>(ErrorCode::resource_exhausted);
      message = "out of memory on shard " + std::to_string(rank_);
    } catch (const std::exception& e) {
      code = static_cast<int>(ErrorCode::internal);
      message = std::string("internal error (please report): ") + e.what();
    }
    struct {
      int code;
      int rank;
    } local{code, static_cast<int>(rank_)}, global{0, 0};
    MPI_Allreduce(&local, &global, 1, MPI_2INT, MPI_MAXLOC, comm_);
    if (global.code == 0) return;
    detail::RootStatus status;
    if (global.rank == static_cast<int>(rank_)) status = detail::status_of(Error(static_cast<ErrorCode>(code), message));
    detail::broadcast_status(status, global.rank, comm_);  // throws it on every rank
  }

  // The number of ranks owning at least one of ids.
  [[nodiscard]] std::size_t owners_of(std::span<const std::uint64_t> ids) const {
    std::vector<bool> owns(ranks_, false);
    for (std::uint64_t id : ids) owns[shard_owner(id, ranks_)] = true;
    return static_cast<std::size_t>(std::count(owns.begin(), owns.end(), true));
  }

  // Stores the rows of a write that this rank owns (ids[i] mod P == rank), all of them checked before.
  void write_mine(const std::string& name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                  std::span<const float> values, std::span<const std::uint64_t> tags) {
    std::optional<wire::Request> part;
    agree([&] {
      const auto c = db_.collection(name);
      const std::size_t d = c->config().dim, dv = c->config().value_dim;
      wire::Upsert mine{name, {}, {}, {}, {}};
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (shard_owner(ids[i], ranks_) != rank_) continue;
        mine.ids.push_back(ids[i]);
        mine.keys.insert(mine.keys.end(), keys.begin() + static_cast<std::ptrdiff_t>(i * d),
                         keys.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
        mine.values.insert(mine.values.end(), values.begin() + static_cast<std::ptrdiff_t>(i * dv),
                           values.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
        if (!tags.empty()) mine.tags.push_back(tags[i]);
      }
      if (!mine.ids.empty()) part = std::move(mine);
    });
    mutate(part, owners_of(ids));
  }

  // Applies this rank's part of a write to its Database. Idempotent, for recovery: a part whose write
  // was committed may have been applied before the crash (create: skipped if the collection exists;
  // drop: if it does not; remove: ids already gone are skipped; upsert stores the same rows again).
  void apply_part(const wire::Request& part) {
    std::visit(Overloaded{
                   [&](const wire::Create& m) {
                     if (!db_.has_collection(m.name)) db_.create_collection(m.name, m.config);
                   },
                   [&](const wire::Drop& m) {
                     if (db_.has_collection(m.name)) db_.drop_collection(m.name);
                   },
                   [&](const wire::Upsert& m) { db_.upsert(m.name, m.ids, m.keys, m.values, m.tags); },
                   [&](const wire::Remove& m) {
                     const auto c = db_.collection(m.name);
                     std::vector<std::uint64_t> present;
                     for (std::uint64_t id : m.ids)
                       if (c->contains(id)) present.push_back(id);
                     if (!present.empty()) db_.remove(m.name, present);
                   },
                   [&](const auto&) { throw Error(ErrorCode::internal, "a part of a write that is not a mutation"); },
               },
               part);
  }

  // Collective: runs one checked write whose parts (mine: this rank's, if any) are on `owners` ranks.
  // One owner: its Database logs and applies its part at once (one log record: atomic by itself).
  // Several (DESIGN.md "Sharding over MPI"): each owner first makes its part durable in a part file
  // (DIR/part-<rank>-<txn>); then rank 0 logs the commit point (txn, in DIR/commits); then each owner
  // applies its part through its Database and deletes the file. A crash before the commit point
  // leaves parts that recovery drops; after it, parts that recovery completes: all or nothing.
  void mutate(const std::optional<wire::Request>& mine, std::size_t owners) {
    if (owners <= 1) {
      agree([&] {
        if (mine) apply_part(*mine);
      });
      return;
    }
    const std::uint64_t txn = next_txn_++;
    ++spanning_;
    const fs::path part_file = dir_ / ("part-" + std::to_string(rank_) + "-" + std::to_string(txn));
    const auto forget = [&] {
      std::error_code ec;
      fs::remove(part_file, ec);
    };
    try {
      crash_.at(rank_, "write", spanning_);
      agree([&] {
        if (mine) write_file(part_file, wire::encode_request(*mine, 0, wire::kProtocolVersion), sync_);
      });
      crash_.at(rank_, "parts", spanning_);
      agree([&] {
        if (commits_ != nullptr) commits_->commit(txn);
      });
    } catch (...) {
      forget();  // not committed: no rank applies its part
      throw;
    }
    crash_.at(rank_, "commit", spanning_);
    agree([&] {
      if (!mine) return;
      apply_part(*mine);  // on failure the file stays: the next start completes the committed write
      forget();
    });
  }

  wire::Reply add(const wire::Add& m) {
    std::uint64_t first = 0;
    std::size_t n = 0;
    agree([&] {
      const auto c = db_.collection(m.name);
      (void)c->prepare({}, m.keys, m.values, m.tags);  // every check Database::add makes, on every rank alike
      first = c->next_id();
      n = m.keys.size() / c->config().dim;
    });
    MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_UINT64_T, MPI_MAX, comm_);  // the global next id
    if (n > kReservedId - first) throw Error(ErrorCode::invalid_argument, "the id space is exhausted");
    std::vector<std::uint64_t> ids(n);
    for (std::size_t i = 0; i < n; ++i) ids[i] = first + i;
    write_mine(m.name, ids, m.keys, m.values, m.tags);
    return wire::IdsReply{std::move(ids)};
  }

  wire::Reply remove(const wire::Remove& m) {
    std::vector<std::uint64_t> mine;
    std::uint64_t missing = kReservedId;
    agree([&] {
      const auto c = db_.collection(m.name);
      std::vector<std::uint64_t> sorted(m.ids.begin(), m.ids.end());
      std::sort(sorted.begin(), sorted.end());
      const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
      if (twice != sorted.end()) throw Error(ErrorCode::invalid_argument, "remove: id " + std::to_string(*twice) + " is given twice");
      for (std::uint64_t id : m.ids)
        if (shard_owner(id, ranks_) == rank_) {
          mine.push_back(id);
          if (!c->contains(id)) missing = std::min(missing, id);
        }
    });
    MPI_Allreduce(MPI_IN_PLACE, &missing, 1, MPI_UINT64_T, MPI_MIN, comm_);
    if (missing != kReservedId) throw Error(ErrorCode::unknown_id, "remove: no entry has id " + std::to_string(missing));
    std::optional<wire::Request> part;
    if (!mine.empty()) part = wire::Remove{m.name, std::move(mine)};
    mutate(part, owners_of(m.ids));
    return wire::Ack{};
  }

  wire::Reply get(const wire::Get& m) {
    const int owner = static_cast<int>(shard_owner(m.id, ranks_));
    Entry entry;
    detail::RootStatus status;
    if (owner == static_cast<int>(rank_)) {
      try {
        entry = db_.collection(m.name)->get(m.id);
      } catch (const Error& e) {
        status = detail::status_of(e);
      } catch (const std::bad_alloc&) {
        status = detail::status_of(Error(ErrorCode::resource_exhausted, "get: out of memory on the owner"));
      }
    }
    detail::broadcast_status(status, owner, comm_);
    std::uint64_t shape[3] = {entry.key.size(), entry.value.size(), entry.tag};
    MPI_Bcast(shape, 3, MPI_UINT64_T, owner, comm_);
    entry.id = m.id;
    entry.key.resize(shape[0]);
    entry.value.resize(shape[1]);
    entry.tag = shape[2];
    MPI_Bcast(entry.key.data(), static_cast<int>(shape[0]), MPI_FLOAT, owner, comm_);
    MPI_Bcast(entry.value.data(), static_cast<int>(shape[1]), MPI_FLOAT, owner, comm_);
    return wire::GetReply{std::move(entry)};
  }

  wire::Reply describe(const wire::Describe& m) {
    CollectionStats stats;
    agree([&] { stats = db_.stats(m.name); });
    std::uint64_t sums[3] = {stats.size, stats.bytes_in_memory, stats.bytes_on_disk};
    MPI_Allreduce(MPI_IN_PLACE, sums, 3, MPI_UINT64_T, MPI_SUM, comm_);
    stats.size = sums[0];
    stats.bytes_in_memory = sums[1];
    stats.bytes_on_disk = sums[2];
    return wire::DescribeReply{std::move(stats)};
  }

  wire::Reply query(const wire::Query& m) {
    const Retrieval kind = m.kind == wire::QueryKind::hard ? Retrieval::hard : Retrieval::soft;
    std::shared_ptr<const Collection> c;
    std::size_t n = 0;
    agree([&] {
      c = db_.collection(m.name);
      n = detail::check_query(*c, m.queries, kind, m.options);
    });
    const detail::ShardScan scan{*c, comm_, rank_, ranks_, nullptr};
    QueryResults r = scan.answer(m.queries, n, kind, m.options);
    if (kind == Retrieval::hard) return wire::HardReply{std::move(r.hard)};
    return wire::SoftReply{std::move(r.soft)};
  }

  MPI_Comm comm_;
  Database& db_;
  fs::path dir_;
  CommitLog* commits_;
  bool sync_;
  std::size_t rank_ = 0, ranks_ = 1;
  std::uint64_t next_txn_ = 1;  // the number the next cross-shard write takes (the same on every rank)
  std::uint64_t spanning_ = 0;  // cross-shard writes this process ran (for the test hook)
  CrashPoint crash_;
};

// Rank 0's hand-over point between the request threads and the MPI thread.
class Dispatcher final : public RequestForwarder {
 public:
  Dispatcher(MPI_Comm comm, Shard& shard) : comm_(comm), shard_(shard) {}

  wire::Reply forward(const wire::Request& request) override {
    Job job{&request, {}};
    auto reply = job.reply.get_future();
    {
      std::lock_guard lock(mutex_);
      if (closed_) return wire::ErrorReply{ErrorCode::server_busy, "the sharded server is shutting down"};
      queue_.push_back(&job);
    }
    ready_.notify_one();
    return reply.get();
  }

  // No more requests: run() returns once the queue is empty.
  void close() {
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
    }
    ready_.notify_one();
  }

  // The MPI thread (rank 0's main thread): runs each request on every rank, in arrival order, until
  // close(); then tells the other ranks to stop.
  void run() {
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [&] { return closed_ || !queue_.empty(); });
        if (queue_.empty()) break;
        job = queue_.front();
        queue_.pop_front();
      }
      wire::Reply reply;
      try {
        const std::vector<std::byte> bytes = wire::encode_request(*job->request, 0, wire::kProtocolVersion);
        CommandHeader h{Command::request, 0, bytes.size()};
        detail::mpi_count(bytes.size(), "a request");
        send(h);
        MPI_Bcast(const_cast<std::byte*>(bytes.data()), static_cast<int>(bytes.size()), MPI_BYTE, 0, comm_);
        reply = shard_.execute(*job->request);
      } catch (...) {
        reply = current_error_reply();
      }
      job->reply.set_value(std::move(reply));
    }
    CommandHeader h{Command::shutdown, 0, 0};
    send(h);
  }

 private:
  struct Job {
    const wire::Request* request;
    std::promise<wire::Reply> reply;
  };

  // The header goes out with a non-blocking broadcast: the other ranks wait for it without spinning.
  void send(CommandHeader& h) {
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Ibcast(&h, sizeof(h), MPI_BYTE, 0, comm_, &r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
  }

  MPI_Comm comm_;
  Shard& shard_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job*> queue_;
  bool closed_ = false;
};

// A rank other than 0: waits for commands (polling a non-blocking broadcast, sleeping in between, so
// an idle rank takes no CPU) and runs each with the others until the shutdown command.
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
      const wire::FrameScan scan = wire::scan_frame(bytes, std::numeric_limits<std::uint32_t>::max());
      if (scan.status != wire::FrameScan::Status::complete) throw Error(ErrorCode::internal, "an incomplete command frame");
      request = wire::decode_request(scan.frame, wire::kProtocolVersion);
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

bool is_shard_dir(const std::string& name) {
  if (name.rfind("shard-", 0) != 0 || name.size() == 6) return false;
  return std::all_of(name.begin() + 6, name.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

}  // namespace

std::size_t mpi_world_size() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size == nullptr) return 1;
  const long n = std::strtol(size, nullptr, 10);
  return n > 1 ? static_cast<std::size_t>(n) : 1;
}

void check_shard_count(const fs::path& dir, std::size_t ranks) {
  const fs::path file = dir / "shards";
  std::error_code ec;
  if (fs::exists(file, ec)) {
    std::ifstream in(file);
    std::size_t recorded = 0;
    if (!(in >> recorded) || recorded < 2)
      throw Error(ErrorCode::corrupt_file, file.string() + " does not hold a shard count");
    if (ranks == 1)
      throw Error(ErrorCode::invalid_argument, dir.string() + " is a sharded database of " + std::to_string(recorded) +
                                                   " shards: start it with mpirun -np " + std::to_string(recorded) +
                                                   " softkv-server --data " + dir.string());
    if (recorded != ranks)
      throw Error(ErrorCode::invalid_argument,
                  dir.string() + " holds " + std::to_string(recorded) + " shards (" + file.string() + ") but this job has " +
                      std::to_string(ranks) + " ranks: restart with mpirun -np " + std::to_string(recorded) +
                      " (resharding, moving rows between shards, is not supported)");
    return;
  }
  if (ranks == 1) return;
  fs::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot create " + dir.string() + ": " + ec.message());
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "LOCK" || name.rfind("wal-", 0) == 0 || name.rfind("snapshot", 0) == 0)
      throw Error(ErrorCode::invalid_argument, dir.string() + " holds a single-process database (" + name +
                                                   "); a sharded server needs its own directory");
    if (is_shard_dir(name))
      throw Error(ErrorCode::invalid_argument, dir.string() + " has shard directories but no " + file.string() +
                                                   ": refusing to guess the shard count");
  }
  const fs::path tmp = dir / "shards.tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << ranks << "\n";
    out.flush();
    if (!out) throw Error(ErrorCode::io_error, "cannot write " + tmp.string());
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  fs::rename(tmp, file, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot write " + file.string() + ": " + ec.message());
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

int run_sharded(const fs::path& dir, const DatabaseOptions& options, ServerConfig config, const int stop_pipe[2]) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const auto finish = [&](int status) {
    MPI_Comm_free(&comm);
    MPI_Finalize();
    return status;
  };
  if (rank != 0) {  // rank 0 ends the job (mpirun forwards SIGINT/SIGTERM to every rank)
    std::signal(SIGINT, SIG_IGN);
    std::signal(SIGTERM, SIG_IGN);
  }
  // Rank 0 checks (and on first start records) the shard count; every rank learns the outcome.
  detail::RootStatus status;
  if (rank == 0) {
    try {
      if (provided < MPI_THREAD_FUNNELED) throw Error(ErrorCode::unsupported, "the MPI library does not provide MPI_THREAD_FUNNELED");
      check_shard_count(dir, static_cast<std::size_t>(size));
    } catch (const std::exception& e) {
      status = detail::status_of(Error(ErrorCode::invalid_argument, e.what()));
    }
  }
  MPI_Bcast(&status, sizeof(status), MPI_BYTE, 0, comm);
  if (status.code != 0) {
    if (rank == 0) spdlog::error("{}", status.message);
    return finish(2);
  }

  // Every rank opens its shard; the job starts only if all did.
  std::unique_ptr<Database> db;
  const fs::path mine = dir / ("shard-" + std::to_string(rank));
  int failed = 0;
  try {
    db = std::make_unique<Database>(mine, options);
  } catch (const std::exception& e) {
    spdlog::error("shard {}: cannot open {}: {}", rank, mine.string(), e.what());
    failed = 1;
  }
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, comm);
  if (failed != 0) {
    db.reset();
    return finish(1);
  }
  // Rank 0's commit log tells every rank which cross-shard writes committed; each completes or drops its parts.
  std::unique_ptr<CommitLog> commits;
  std::uint64_t last_committed = 0;
  failed = 0;
  if (rank == 0) {
    try {
      commits = std::make_unique<CommitLog>(dir / "commits", options.fsync == FsyncPolicy::always);
      last_committed = commits->last();
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      failed = 1;
    }
  }
  MPI_Bcast(&failed, 1, MPI_INT, 0, comm);
  if (failed != 0) {
    db.reset();
    return finish(1);
  }
  MPI_Bcast(&last_committed, 1, MPI_UINT64_T, 0, comm);
  Shard shard(comm, *db, dir, commits.get(), options.fsync == FsyncPolicy::always);
  try {
    const auto [applied, dropped] = shard.recover(last_committed);
    if (applied + dropped > 0)
      spdlog::info("shard {}: recovery completed {} committed cross-shard write part(s) and dropped {} uncommitted one(s)",
                   rank, applied, dropped);
  } catch (const std::exception& e) {
    if (rank == 0) spdlog::error("recovery of the cross-shard writes failed: {}", e.what());
    db.reset();
    return finish(1);
  }

  if (rank != 0) {
    MPI_Bcast(&status, sizeof(status), MPI_BYTE, 0, comm);  // whether rank 0 could bind
    if (status.code == 0) follow(comm, shard);
  } else {
    Dispatcher dispatcher(comm, shard);
    config.forwarder = &dispatcher;
    std::unique_ptr<Server> server;
    try {
      server = std::make_unique<Server>(*db, config);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      status = detail::status_of(Error(ErrorCode::io_error, e.what()));
    }
    MPI_Bcast(&status, sizeof(status), MPI_BYTE, 0, comm);
    if (status.code != 0) {
      db.reset();
      return finish(1);
    }
    spdlog::info("softkv-server {} (sharded, {} ranks) on {}:{}, kernel path {}, data {} (shard-0 .. shard-{}), {} collection(s)",
                 kVersion, size, config.host, server->port(), simd_path(), dir.string(), size - 1,
                 db->list_collections().size());
    spdlog::info("connect with: softkv --port {} stats   (or softkv::Client / Python softkv.Client)", server->port());
    int exit_status = 0;
    std::thread front([&] {
      try {
        server->run();
      } catch (const std::exception& e) {
        spdlog::error("the server stopped on an error: {}", e.what());
        exit_status = 1;
      }
      dispatcher.close();
    });
    std::thread waiter([&] {
      char sig = 0;
      while (::read(stop_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      if (sig != 0) spdlog::info("signal {}: finishing in-flight requests", int(sig));
      server->stop();
    });
    dispatcher.run();  // until the front end has stopped and every request was answered
    front.join();
    const char wake = 0;  // ends the waiter if the server stopped for another reason
    [[maybe_unused]] const auto n = ::write(stop_pipe[1], &wake, 1);
    waiter.join();
    server.reset();
    if (exit_status != 0) status.code = 1;
  }
  // Every rank writes a snapshot of its shard before it exits (a fast restart; the logs alone suffice).
  int snapshot_failed = 0;
  try {
    db->snapshot();
  } catch (const std::exception& e) {
    spdlog::error("shard {}: the snapshot before exit failed: {}; the log is intact and the next start replays it", rank, e.what());
    snapshot_failed = 1;
  }
  db.reset();
  MPI_Allreduce(MPI_IN_PLACE, &snapshot_failed, 1, MPI_INT, MPI_MAX, comm);
  const int exit_status = status.code != 0 || snapshot_failed != 0 ? 1 : 0;
  if (rank == 0) spdlog::info(exit_status == 0 ? "stopped" : "stopped with errors");
  return finish(exit_status);
}

}  // namespace softkv::server
