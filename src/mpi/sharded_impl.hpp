// ShardedCollection's state, shared by its two halves: writes and routing (sharded_collection.cpp)
// and queries (sharded_query.cpp).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "codec/parts.hpp"
#include "mpi/partial_record.hpp"
#include "softkv/error.hpp"
#include "softkv/mpi.hpp"

namespace softkv {
namespace detail {

/// The outcome of a root-side check, broadcast so that every rank throws the same Error or none.
struct RootStatus {
  std::uint32_t code = 0;   ///< 0, or the ErrorCode root hit
  char message[244] = {};   ///< its message, cut to fit
};

/// The status carrying e.
RootStatus status_of(const Error& e);

/// Broadcasts root's status over comm and throws its Error on every rank if it holds one.
void broadcast_status(RootStatus& status, int root, MPI_Comm comm);

/// How the ranks agree on an error (the one rule of the sharded collection and the sharded server).
/// root_decides: body runs on root only (a check of a request) and every rank throws root's error, or
/// none does. agree: body runs on every rank and, when any rank failed, every rank throws the failure
/// of the lowest failing rank with the highest code (its own message there; "out of memory on rank R"
/// for an allocation). Any exception counts, as error_of maps it: no rank leaves the collective that
/// follows while the others wait in it. Both are collective over comm.
void root_decides(MPI_Comm comm, int root, const std::function<void()>& body);
/// See root_decides.
void agree(MPI_Comm comm, const std::function<void()>& body);

/// n as an MPI count; Error(resource_exhausted) naming `what` when it does not fit an int.
int mpi_count(std::size_t n, const char* what);

/// The checks a sharded query passes before it is broadcast (shapes, finite values, options as one
/// collection checks them, masks within their limits): returns the number of queries, throws Error otherwise.
std::size_t check_query(const Collection& shard, std::span<const float> queries, Retrieval kind, const QueryOptions& options);

/// One rank's shard of one collection and the communicator its queries reduce over: the scan and
/// merge of a sharded query, shared by ShardedCollection and the sharded server. Every method is
/// collective over comm (every rank calls it with the same arguments, after check_query passed).
struct ShardScan {
  const Collection& shard;         ///< this rank's entries
  MPI_Comm comm;                   ///< the ranks holding the other shards
  std::size_t rank;                ///< this rank in comm
  std::size_t ranks;               ///< P
  double* reduce_seconds = nullptr;  ///< where time in reductions is added (may be null)

  /// The answers to n row-major queries q (exact or pruned, as opts say), on every rank.
  [[nodiscard]] QueryResults answer(const std::vector<float>& q, std::size_t n, Retrieval kind, const QueryOptions& opts) const;
  /// n exact queries (no pruning), answered with one reduction for the whole batch.
  [[nodiscard]] QueryResults exact(const std::vector<float>& queries, std::size_t n, Retrieval kind, const QueryOptions& options) const;
  /// One pruned soft query at k over `total` eligible entries, `local` of them on this shard (two reductions).
  [[nodiscard]] SoftResult pruned_at(const std::vector<float>& query, std::size_t k, std::size_t local, std::size_t total,
                                     const QueryOptions& options) const;
  /// One pruned soft query (top_k, or epsilon's adaptive k) over `total` eligible entries, `local` here.
  [[nodiscard]] SoftResult pruned(const std::vector<float>& query, std::size_t local, std::size_t total,
                                  const QueryOptions& options) const;
  /// The global reduction of the partial records, timed into *reduce_seconds.
  void reduce(PartialRecords& records) const;
  /// The blend sum_i e^{s_i - lse} v_i in double over every rank's parts (s_i, v_i of dim floats), as
  /// floats: the slow path of a blend whose float accumulator overflowed. Collective.
  [[nodiscard]] std::vector<float> blend_in_double(const std::vector<std::pair<double, const float*>>& parts, double lse,
                                                   std::size_t dim) const;
};

}  // namespace detail

/// A rank's part of a sharded collection: its shard and its duplicate of the communicator.
class ShardedCollection::Impl {
 public:
  Impl(MPI_Comm comm, const CollectionConfig& config);
  ~Impl();

  MPI_Comm comm_ = MPI_COMM_NULL;  ///< a duplicate of the caller's communicator, ours alone
  std::size_t rank_ = 0;           ///< this rank
  std::size_t ranks_ = 1;          ///< P
  Collection shard_;               ///< the entries this rank owns
  double reduce_seconds_ = 0;      ///< time in reductions during the last query

  /// This rank's shard as a ShardScan (the query half), timing reductions into reduce_seconds_.
  [[nodiscard]] detail::ShardScan scan() { return {shard_, comm_, rank_, ranks_, &reduce_seconds_}; }
  /// MPI_Allreduce of one u64 with op. Collective.
  [[nodiscard]] std::uint64_t allreduce_u64(std::uint64_t local, MPI_Op op) const;

};

}  // namespace softkv
