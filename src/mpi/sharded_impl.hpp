// ShardedCollection's state, shared by its two halves: writes and routing (sharded_collection.cpp)
// and queries (sharded_query.cpp).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

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

/// n as an MPI count; Error(resource_exhausted) naming `what` when it does not fit an int.
int mpi_count(std::size_t n, const char* what);

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

  /// The global reduction of the partial records, timed into reduce_seconds_. Collective.
  void reduce(detail::PartialRecords& records);
  /// The element-wise sum over ranks of a vector of doubles (a convex blend's parts), as floats. Collective.
  [[nodiscard]] std::vector<float> sum_in_double(std::vector<double> local) const;
  /// MPI_Allreduce of one u64 with op. Collective.
  [[nodiscard]] std::uint64_t allreduce_u64(std::uint64_t local, MPI_Op op) const;
  /// Sends each owner its rows of `rows` (significant at root): the rows this rank owns, in root's
  /// order. Without vectors (a removal) only the ids travel. Collective.
  [[nodiscard]] Rows scatter(const Rows& rows, int root, bool with_vectors = true) const;

  /// n exact queries (no pruning), answered with one reduction for the whole batch. Collective.
  QueryResults exact(const std::vector<float>& queries, std::size_t n, Retrieval kind, const QueryOptions& options);
  /// One pruned soft query at k over `total` entries (two reductions). Collective.
  SoftResult pruned_at(const std::vector<float>& query, std::size_t k, std::size_t total, const QueryOptions& options);
  /// One pruned soft query (top_k, or epsilon's adaptive k). Collective.
  SoftResult pruned(const std::vector<float>& query, std::size_t total, const QueryOptions& options);
};

}  // namespace softkv
