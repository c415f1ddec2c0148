// ShardedCollection: rows routed to their owner rank (id mod P); writes checked at root, their parts
// (mpi/parts.hpp, the sharded server's too) scattered to owners.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>
#include <string>

#include "error_of.hpp"
#include "ids.hpp"
#include "mpi/parts.hpp"
#include "mpi/sharded_impl.hpp"

namespace softkv {
namespace detail {

RootStatus status_of(const Error& e) {
  RootStatus s;
  s.code = static_cast<std::uint32_t>(e.code());
  std::strncpy(s.message, e.what(), sizeof(s.message) - 1);
  return s;
}

void broadcast_status(RootStatus& status, int root, MPI_Comm comm) {
  MPI_Bcast(&status, sizeof(status), MPI_BYTE, root, comm);
  if (status.code != 0) throw Error(static_cast<ErrorCode>(status.code), status.message);
}

void root_decides(MPI_Comm comm, int root, const std::function<void()>& body) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  RootStatus status;
  if (rank == root) {
    try {
      body();
    } catch (...) {
      const ErrorOf e = error_of(std::current_exception());
      status = status_of(Error(e.code, e.code == ErrorCode::resource_exhausted ? "out of memory at the root (rank " + std::to_string(root) + ")"
                                                                             : e.message));
    }
  }
  broadcast_status(status, root, comm);  // throws it on every rank
}

void agree(MPI_Comm comm, const std::function<void()>& body) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int code = 0;
  std::string message;
  try {
    body();
  } catch (...) {  // whatever it is, every rank must reach the reduction below
    const ErrorOf e = error_of(std::current_exception());
    code = static_cast<int>(e.code);
    message = e.code == ErrorCode::resource_exhausted ? "out of memory on rank " + std::to_string(rank) : e.message;
  }
  struct {
    int code;
    int rank;
  } local{code, rank}, global{0, 0};
  MPI_Allreduce(&local, &global, 1, MPI_2INT, MPI_MAXLOC, comm);
  if (global.code == 0) return;
  RootStatus status;
  if (global.rank == rank) status = status_of(Error(static_cast<ErrorCode>(code), message));
  broadcast_status(status, global.rank, comm);  // throws it on every rank
}

int mpi_count(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Error(ErrorCode::resource_exhausted, std::string("sharded collection: ") + what + " exceeds MPI's int counts");
  return static_cast<int>(n);
}

}  // namespace detail

std::size_t shard_owner(std::uint64_t id, std::size_t ranks) noexcept { return detail::owner_of(id, ranks); }

namespace {
// Sharded collections merge one softmax per query: multi-head ones are not built (issue 15).
const CollectionConfig& single_head(const CollectionConfig& config) {
  if (config.heads != 1)
    throw Error(ErrorCode::unsupported, "sharded collections are single-head: heads must be 1, got " + std::to_string(config.heads));
  return config;
}
}  // namespace

ShardedCollection::Impl::Impl(MPI_Comm comm, const CollectionConfig& config) : shard_(single_head(config)) {
  MPI_Comm_dup(comm, &comm_);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  rank_ = static_cast<std::size_t>(rank);
  ranks_ = static_cast<std::size_t>(size);
}

ShardedCollection::Impl::~Impl() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0) MPI_Comm_free(&comm_);  // after MPI_Finalize the communicator is gone with MPI
}

std::uint64_t ShardedCollection::Impl::allreduce_u64(std::uint64_t local, MPI_Op op) const {
  std::uint64_t global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_UINT64_T, op, comm_);
  return global;
}

ShardedCollection::ShardedCollection(MPI_Comm comm, const CollectionConfig& config)
    : impl_(std::make_unique<Impl>(comm, config)) {}

ShardedCollection::~ShardedCollection() = default;

std::size_t ShardedCollection::rank() const noexcept { return impl_->rank_; }
std::size_t ShardedCollection::ranks() const noexcept { return impl_->ranks_; }
std::size_t ShardedCollection::owner(std::uint64_t id) const noexcept { return shard_owner(id, impl_->ranks_); }
const CollectionConfig& ShardedCollection::config() const noexcept { return impl_->shard_.config(); }
const Collection& ShardedCollection::shard() const noexcept { return impl_->shard_; }
double ShardedCollection::last_reduce_seconds() const noexcept { return impl_->reduce_seconds_; }

std::size_t ShardedCollection::size() const { return impl_->allreduce_u64(impl_->shard_.size(), MPI_SUM); }

std::uint64_t ShardedCollection::next_id() const { return impl_->allreduce_u64(impl_->shard_.next_id(), MPI_MAX); }

void ShardedCollection::upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys,
                                     std::span<const float> values, int root) {
  upsert_batch(ids, keys, values, {}, root);
}

void ShardedCollection::upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys,
                                     std::span<const float> values, std::span<const std::uint64_t> tags, int root) {
  Impl& im = *impl_;
  detail::EncodedParts parts;
  detail::root_decides(im.comm_, root, [&] {
    if (ids.empty() && !keys.empty())
      throw Error(ErrorCode::dimension_mismatch, "upsert: " + std::to_string(keys.size()) + " key floats but no ids");
    // every check Collection::upsert_batch makes, then each owner's rows (detail::part_of, as the server splits)
    parts = detail::encode_parts(detail::mutation::Upsert{"", im.shard_.prepare(ids, keys, values, tags), false}, im.ranks_);
  });
  const std::optional<detail::Mutation> mine = detail::scatter_parts(parts, root, im.comm_);
  // Every rank stores its part, and the ranks agree: one that could not (out of memory) fails the call on
  // every rank, so none leaves for the next collective alone (the parts stored elsewhere stay: a library
  // write is not a transaction across ranks; the sharded server's two-phase commit is, docs/SHARDING.md).
  detail::agree(im.comm_, [&] {
    if (mine) im.shard_.apply(std::get<detail::mutation::Upsert>(*mine).rows);
  });
}

std::vector<std::uint64_t> ShardedCollection::add_batch(std::span<const float> keys, std::span<const float> values,
                                                        int root) {
  return add_batch(keys, values, {}, root);
}

std::vector<std::uint64_t> ShardedCollection::add_batch(std::span<const float> keys, std::span<const float> values,
                                                        std::span<const std::uint64_t> tags, int root) {
  Impl& im = *impl_;
  const std::uint64_t first = next_id();
  std::uint64_t n = 0;
  std::vector<std::uint64_t> ids;
  detail::root_decides(im.comm_, root, [&] {
    n = keys.size() / im.shard_.config().dim;
    ids = detail::next_ids(first, n);
  });
  upsert_batch(ids, keys, values, tags, root);  // checks shapes (keys vs n ids, values) and the reserved id at root
  MPI_Bcast(&n, 1, MPI_UINT64_T, root, im.comm_);
  ids.resize(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = first + i;
  return ids;
}

void ShardedCollection::remove_batch(std::span<const std::uint64_t> ids, int root) {
  Impl& im = *impl_;
  detail::EncodedParts parts;
  detail::root_decides(im.comm_, root, [&] {
    detail::check_distinct(ids);
    parts = detail::encode_parts(detail::mutation::Remove{"", {ids.begin(), ids.end()}}, im.ranks_);
  });
  const std::optional<detail::Mutation> part = detail::scatter_parts(parts, root, im.comm_);
  const std::vector<std::uint64_t> mine = part ? std::get<detail::mutation::Remove>(*part).ids : std::vector<std::uint64_t>{};
  // Phase 1: every owner checks its ids; the smallest missing id anywhere is the one every rank names.
  std::uint64_t missing = kReservedId;
  for (std::uint64_t id : mine)
    if (!im.shard_.contains(id)) missing = std::min(missing, id);
  missing = im.allreduce_u64(missing, MPI_MIN);
  if (missing != kReservedId) throw Error(ErrorCode::unknown_id, "remove: no entry has id " + std::to_string(missing));
  // Phase 2: nothing can fail any more (ids distinct and present).
  if (!mine.empty()) im.shard_.remove_batch(mine);
}

}  // namespace softkv
