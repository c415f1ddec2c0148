// softkv::ShardedCollection: one collection spread over the ranks of an MPI job, queried exactly.
//
// This header includes <mpi.h> and takes an MPI_Comm: it is only for programs that use MPI
// themselves (link softkv::mpi), for which mpi.h is already their own dependency. The rest of
// softkv's public headers stay free of third-party types.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "softkv/collection.hpp"

namespace softkv {

/// The rank that owns id among `ranks` ranks: id mod ranks. A sharded collection fixes its rank
/// count at creation, so an id never moves.
[[nodiscard]] std::size_t shard_owner(std::uint64_t id, std::size_t ranks) noexcept;

/// A collection whose entries live on the ranks of an MPI communicator: entry id lives on rank
/// shard_owner(id, ranks()) in that rank's own Collection (its shard).
///
/// Every method except the accessors marked "local" is collective: every rank of the communicator
/// calls it, in the same order, with the same root (the MPI convention, as in PETSc or ScaLAPACK).
/// Inputs are read on `root` only (other ranks may pass empty spans); answers are returned on every
/// rank. Answers equal those of one Collection holding every entry, to float rounding: each rank
/// scans its shard and the partial states (m, l, acc, top list; hard id, score) are merged with one
/// MPI_Allreduce under a commutative user-defined MPI_Op applying the log-sum-exp rule (hard: the
/// highest score, ties to the smallest id). A caller error throws softkv::Error with the same code
/// on every rank, and nothing is changed. Not thread-safe: one thread per rank calls it (MPI's
/// collectives on one communicator must not interleave).
class ShardedCollection {
 public:
  /// Collective: an empty sharded collection over a duplicate of comm (so its messages never mix
  /// with the caller's). Every rank passes the same config; throws Error(invalid_argument) for a
  /// configuration check_config refuses. MPI must be initialised.
  ShardedCollection(MPI_Comm comm, const CollectionConfig& config);
  /// Collective: frees the duplicated communicator (every rank must destroy its object together).
  ~ShardedCollection();
  ShardedCollection(const ShardedCollection&) = delete;
  ShardedCollection& operator=(const ShardedCollection&) = delete;

  /// Local: this process's rank in the communicator.
  [[nodiscard]] std::size_t rank() const noexcept;
  /// Local: the number of ranks (shards), fixed at creation.
  [[nodiscard]] std::size_t ranks() const noexcept;
  /// Local: the rank that owns id (shard_owner(id, ranks())).
  [[nodiscard]] std::size_t owner(std::uint64_t id) const noexcept;
  /// Local: the configuration every shard was created with.
  [[nodiscard]] const CollectionConfig& config() const noexcept;
  /// Local: this rank's shard (its entries only); read-only, writes go through the collective methods.
  [[nodiscard]] const Collection& shard() const noexcept;

  /// Collective: the number of entries over all shards.
  [[nodiscard]] std::size_t size() const;
  /// Collective: the id add_batch assigns next (one above the largest id any shard ever stored).
  [[nodiscard]] std::uint64_t next_id() const;

  /// Collective: inserts or replaces n entries given at root (ids n, keys n x d, values n x dv); each
  /// row is stored by its owner. Checked completely at root first (as Collection::upsert_batch).
  void upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                    int root = 0);
  /// Collective: upsert_batch with n tags given at root (empty: every tag 0); each tag travels with its row.
  void upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                    std::span<const std::uint64_t> tags, int root = 0);
  /// Collective: adds n entries given at root with ids next_id() .. next_id() + n - 1; returns them on every rank.
  std::vector<std::uint64_t> add_batch(std::span<const float> keys, std::span<const float> values, int root = 0);
  /// Collective: add_batch with n tags given at root (empty: every tag 0); each tag travels with its row.
  std::vector<std::uint64_t> add_batch(std::span<const float> keys, std::span<const float> values,
                                       std::span<const std::uint64_t> tags, int root = 0);
  /// Collective: removes n distinct ids given at root, all or nothing: Error(unknown_id) when any
  /// shard lacks one, Error(invalid_argument) for an id given twice, before any is removed.
  void remove_batch(std::span<const std::uint64_t> ids, int root = 0);

  /// Collective: n >= 1 row-major queries given at root, answered on every rank like
  /// Collection::query on all entries. Options are read at root too, masks included (tags_any,
  /// tag_range, exclude_ids: broadcast after the fixed options; each shard keeps its eligible rows,
  /// candidates count the eligible entries of every shard, and a mask that keeps no entry on any
  /// shard is Error(empty_collection) on every rank). Pruned queries (top_k,
  /// epsilon) take the global top k (each rank's top k merged), softmax over those and the tail
  /// bound from the global k-th score and the global N; each shard needs an index that serves
  /// top_k (flat is exact; hnsw/ivf make the candidates and the bound estimates).
  [[nodiscard]] QueryResults query(std::span<const float> queries, Retrieval kind, const QueryOptions& options = {},
                                   int root = 0) const;
  /// Collective: one soft query (query(...).soft[0]).
  [[nodiscard]] SoftResult query_soft(std::span<const float> query, const QueryOptions& options = {}, int root = 0) const;
  /// Collective: one hard query (query(...).hard[0]).
  [[nodiscard]] HardResult query_hard(std::span<const float> query, const QueryOptions& options = {}, int root = 0) const;

  /// Local: wall seconds the last query on this rank spent in its reductions (MPI_Allreduce of the
  /// partial records), for benchmarks.
  [[nodiscard]] double last_reduce_seconds() const noexcept;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace softkv
