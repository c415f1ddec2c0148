// One rank of the sharded server (sharded.hpp): its shard of every collection (a Database) and the
// collective execution of a request, with the commit protocol that keeps a write over several shards
// all or nothing across a crash.
#pragma once

#include <functional>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "codec/records.hpp"
#include "softkv/database.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {

// Rank 0's record of the last committed cross-shard write: DIR/commits, a 16-byte header then two
// 16-byte slots (the transaction number with the count of ranks holding a part of it, and a check
// word) written alternately, so that a torn write spoils only the slot being written and the other
// still holds the previous commit.
class CommitLog {
 public:
  // Opens path, which create() made: throws Error(invalid_argument) when it is missing and
  // Error(corrupt_file) when its header or both slots are damaged. legacy: the headerless format
  // before job identities (created on first use), rewritten in this format; sync: fdatasync every
  // commit (--fsync always).
  CommitLog(const std::filesystem::path& path, bool sync, bool legacy = false);
  ~CommitLog();
  CommitLog(const CommitLog&) = delete;
  CommitLog& operator=(const CommitLog&) = delete;

  // Writes an empty commit log (no commit yet) to path, on stable storage.
  static void create(const std::filesystem::path& path);

  // The last committed transaction (0: none).
  [[nodiscard]] std::uint64_t last() const { return last_; }
  // How many ranks held a part of it (0: not recorded, a log of format 1).
  [[nodiscard]] std::uint64_t owners() const { return owners_; }
  // Whether one of the two slots failed its check when the log was opened (last() is the other's).
  [[nodiscard]] bool damaged_slot() const { return damaged_slot_; }
  // Records txn (> last()) as committed, with the number of ranks holding a part of it, on stable
  // storage when sync.
  void commit(std::uint64_t txn, std::size_t owners);

 private:
  int fd_ = -1;
  bool sync_;
  std::uint64_t last_ = 0;
  std::uint64_t owners_ = 0;
  bool damaged_slot_ = false;
};

// The request a command file (or a part file written before format "skvpart1") holds: a request
// frame at the highest protocol version.
wire::Request decode_command(std::span<const std::byte> bytes);

// Test hook (tests/test_sharded_server.cpp): SOFTKV_TEST_CRASH="<rank>:<write|parts|commit>:<n>" makes
// that rank kill itself with SIGKILL in its n-th cross-shard write: before it writes its part (write),
// once every part is durable (parts), or once rank 0 has logged the commit point (commit).
struct CrashPoint {
  int rank = -1;           // the rank that dies (-1: none)
  std::string point;       // where
  std::uint64_t nth = 0;   // in which cross-shard write of this process
  CrashPoint();            // reads SOFTKV_TEST_CRASH
  // Kills this process when (my_rank, here, count) is the configured point.
  void at(std::size_t my_rank, const char* here, std::uint64_t count) const;
};

// One rank's part of the sharded server: its Database (its shard of every collection) and the
// communicator. execute() is collective: every rank calls it with the same request, in the same order.
class Shard {
 public:
  // dir: the job's data directory (DIR), where this rank keeps its part files; job: the job id its
  // parts carry; commits: rank 0's commit log (null on the other ranks); sync: fsync part files
  // (--fsync always).
  Shard(MPI_Comm comm, Database& db, std::filesystem::path dir, std::string job, CommitLog* commits, bool sync);

  // Collective, at start after every rank opened its Database: completes the cross-shard writes that
  // rank 0 committed (re-applying this rank's part, which is idempotent) and drops the parts of the
  // others, which no client was told had succeeded. Returns the parts re-applied and dropped here.
  // First every rank reads and checks every part it must complete (checksum, and that it is this
  // job's, this rank's and this write's): a damaged or foreign part, or a part file of a rank the
  // job does not have, throws Error(corrupt_file / invalid_argument) on every rank before any rank
  // changes anything.
  // owners: how many ranks held a part of write last_committed (0: unknown); fewer holding its part
  // or its applied marker (a part file deleted by hand) throws Error(corrupt_file) on every rank.
  std::pair<std::size_t, std::size_t> recover(std::uint64_t last_committed, std::uint64_t owners);

  // The reply to request on rank 0 (other ranks discard theirs). A failure throws softkv::Error on
  // every rank alike.
  wire::Reply execute(const wire::Request& request);

  [[nodiscard]] std::size_t rank() const { return rank_; }

  // Not collective (rank 0's dispatcher, before it broadcasts anything): the number of queries in q
  // when q passes every check its collective run makes (on this rank's copy of the collection, whose
  // configuration every rank shares) and every shard answers it in one pass over its rows: exact soft
  // queries without a top-m list (the batched kernel), hard queries scanning every key (an exact or
  // flat collection, or the exact flag). 0 otherwise: an invalid query, or one answered query by query.
  [[nodiscard]] std::size_t one_pass_queries(const wire::Query& q) const;

  // Not collective: throws Error(unknown_collection) unless a collection is named name.
  void require_collection(const std::string& name) const;

 private:
  static Error session_only() { return Error(ErrorCode::internal, "hello, auth and ping are the session's, not the shards'"); }

  // Runs body on this rank, then agrees with every rank (detail::agree, the one rule of the sharded
  // collection and server): when any rank failed, every rank throws that failure.
  void agree(const std::function<void()>& body) const;

  // Applies this rank's part of a write to its Database. Idempotent, for recovery: a part whose write
  // was committed may have been applied before the crash (create: skipped if the collection exists;
  // drop: if it does not; remove: ids already gone are skipped; upsert stores the same rows again).
  void apply_part(const detail::Mutation& part);

  // Collective: runs one checked write, each rank its part of it (detail::part_of, the split the library's
  // ShardedCollection scatters). One owner: its Database logs and applies its part at once (one log
  // record: atomic by itself). Several (docs/SHARDING.md, "The sharded server"): each owner first makes
  // its part durable in a part file (DIR/part-<rank>-<txn>, detail::encode_part); then rank 0 logs the
  // commit point (txn, in DIR/commits); then each owner applies its part through its Database and deletes
  // the file. A crash before the commit point leaves parts that recovery drops; after it, parts that
  // recovery completes: all or nothing.
  void mutate(const detail::Mutation& whole);

  // The requests that take more than one step (each collective).
  wire::Reply add(const wire::Add& m);
  wire::Reply remove(const wire::Remove& m);
  wire::Reply get(const wire::Get& m);
  wire::Reply describe(const wire::Describe& m);
  wire::Reply query(const wire::Query& m);

  MPI_Comm comm_;
  Database& db_;
  std::filesystem::path dir_;
  std::string job_;
  CommitLog* commits_;
  bool sync_;
  std::size_t rank_ = 0, ranks_ = 1;
  // Marks this rank's part of a write applied (see shard.cpp) and returns the marker's path.
  std::filesystem::path mark_applied(const std::filesystem::path& part) const;

  std::uint64_t next_txn_ = 1;  // the number the next cross-shard write takes (the same on every rank)
  std::optional<std::filesystem::path> last_marker_;  // this rank's applied marker of the last cross-shard write
  std::uint64_t spanning_ = 0;  // cross-shard writes this process ran (for the test hook)
  CrashPoint crash_;
};

}  // namespace softkv::server
