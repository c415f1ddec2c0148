// softkv::Collection: (id, key, value) vectors answered by soft (softmax-weighted) or hard (argmax) retrieval.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "softkv/types.hpp"

namespace softkv {

namespace detail {
class CollectionImpl;  ///< a collection's rows, index and lock (src/collection_impl.hpp)
}  // namespace detail

/// A set of (id, key, value) entries with fixed dimensions, queried by soft or hard retrieval.
///
/// Thread safety: any number of threads may query concurrently (const methods take a shared
/// lock); a write (add, upsert, remove) is exclusive and waits for running queries. Index training
/// and rebuilds run in the background without the lock: queries keep using the previous index (or
/// the exact scan before the first build) until the new one is swapped in. Every
/// method validates its input completely before changing anything, so a throwing call leaves
/// the collection as it was.
class Collection {
 public:
  /// Creates an empty collection; throws Error(invalid_argument) for a configuration check_config refuses.
  explicit Collection(const CollectionConfig& config);
  ~Collection();
  Collection(Collection&&) noexcept;             ///< moves the entries; the source becomes unusable
  Collection& operator=(Collection&&) noexcept;  ///< moves the entries; the source becomes unusable
  Collection(const Collection&) = delete;
  Collection& operator=(const Collection&) = delete;

  /// The configuration the collection was created with.
  [[nodiscard]] const CollectionConfig& config() const noexcept;
  /// Number of entries.
  [[nodiscard]] std::size_t size() const;
  /// Entries options' mask (tags_any, tag_range, exclude_ids) keeps, 0 when it keeps none; size()
  /// without a mask. Throws Error(invalid_argument) for a mask outside its limits.
  [[nodiscard]] std::size_t eligible_count(const QueryOptions& options) const;
  /// Number of entries without taking the lock (it never waits; it may lag a write in progress).
  [[nodiscard]] std::size_t size_hint() const noexcept;
  /// Whether an entry has this id.
  [[nodiscard]] bool contains(std::uint64_t id) const;
  /// The entry with this id; throws Error(unknown_id).
  [[nodiscard]] Entry get(std::uint64_t id) const;
  /// All ids, in storage order (not sorted).
  [[nodiscard]] std::vector<std::uint64_t> ids() const;

  /// Adds one entry with this tag and returns its new id (one above the largest id ever used).
  std::uint64_t add(std::span<const float> key, std::span<const float> value, std::uint64_t tag = 0);
  /// Adds n entries from row-major n x d keys and n x dv values; returns their ids in order. tags is
  /// empty (every tag 0) or holds n tags.
  std::vector<std::uint64_t> add_batch(std::span<const float> keys, std::span<const float> values,
                                       std::span<const std::uint64_t> tags = {});
  /// Inserts or replaces the entry with this id (any id but 2^64-1, which is reserved); a replaced
  /// entry takes the new tag.
  void upsert(std::uint64_t id, std::span<const float> key, std::span<const float> value, std::uint64_t tag = 0);
  /// Inserts or replaces n entries; ids has n elements, keys n x d, values n x dv, tags 0 or n.
  void upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys,
                    std::span<const float> values, std::span<const std::uint64_t> tags = {});
  /// Removes the entry with this id; throws Error(unknown_id) if there is none.
  void remove(std::uint64_t id);
  /// Removes n distinct ids, all or nothing: throws Error(unknown_id) or Error(invalid_argument) (an id
  /// given twice) before removing any.
  void remove_batch(std::span<const std::uint64_t> ids);

  /// The first door of a write in two steps: checks rows exactly as upsert_batch would (as add_batch
  /// would when ids is empty) and returns them as they will be stored, keys normalised for cosine.
  /// Changes nothing; a Database logs the result before it applies it.
  [[nodiscard]] Rows prepare(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                             std::span<const std::uint64_t> tags = {}) const;
  /// The second door: stores rows that prepare() returned, with one id per row (inserting or replacing
  /// each). It does not validate again; rows whose shape does not fit are Error(internal).
  void apply(const Rows& rows);
  /// The id add() assigns next: one above the largest id ever stored.
  [[nodiscard]] std::uint64_t next_id() const;

  /// A consistent copy of every entry, the id counter and the saved pruning index: what a snapshot keeps.
  [[nodiscard]] CollectionImage image() const;
  /// A collection holding exactly the image (same entries, storage order and id counter). Its index is
  /// loaded from image.index when that matches the entries and rebuilt otherwise; an index that cannot
  /// be built leaves queries on the exact scan. `note`, when given, receives one line saying which.
  /// Throws Error(invalid_argument) for a configuration outside ConfigLimits and Error(corrupt_file)
  /// for an inconsistent image (row sizes, an id twice, an id at or above next_id).
  [[nodiscard]] static Collection restore(CollectionImage image, std::string* note = nullptr);

  /// The one query entry point: n >= 1 row-major queries (n x d), soft or hard. A query plan decides
  /// the path once (docs/DESIGN.md, "The data path of a query"): every query in one fused pass over the
  /// eligible rows (n > 1 and a plain scan: no top_m for soft, no top_k / epsilon / error_target, no
  /// hnsw/ivf/automatic index for hard, no iterations), else each query on its own (pruned, estimated or
  /// through the index when asked; a plain scan may be coalesced with other callers' queries). A fused
  /// answer has candidates = rows_scored = N (the eligible entries under a mask), tail_bound 0 and no
  /// contributors. Throws the first failing query's error. query_soft, query_hard and the batch methods
  /// are this call with one result shape or another.
  [[nodiscard]] QueryResults query(std::span<const float> queries, Retrieval kind, const QueryOptions& options = {}) const;
  /// Soft retrieval: softmax(s) . V over every entry (per head on a multi-head collection; iterated when
  /// options.iterations > 1). Throws on empty collection or bad query; top_k/epsilon on a multi-head
  /// collection are Error(unsupported).
  [[nodiscard]] SoftResult query_soft(std::span<const float> query, const QueryOptions& options = {}) const;
  /// Hard retrieval: the value of argmax s_i (ties: smallest id). Only the keys are read. With an
  /// HNSW or IVF index (and !options.exact) the best of the index's top 64 is taken (rescored, ties
  /// to the smallest id among them), which may miss the true best.
  [[nodiscard]] HardResult query_hard(std::span<const float> query, const QueryOptions& options = {}) const;
  /// Soft retrieval for B row-major queries (B x d): query() with the answers side by side; a plain
  /// scan reads the entries once for all of them. Contributors are not reported in batches: options.top_m must be 0.
  [[nodiscard]] SoftBatchResult query_soft_batch(std::span<const float> queries,
                                                 const QueryOptions& options = {}) const;
  /// Hard retrieval for B row-major queries (B x d): query() with the answers side by side; an exact
  /// scan reads the keys once for all of them (hnsw, ivf and automatic answer through the index, query by query).
  [[nodiscard]] HardBatchResult query_hard_batch(std::span<const float> queries,
                                                 const QueryOptions& options = {}) const;

  /// Coalescing (on by default): a single exact query that arrives while another pass over this
  /// collection runs waits, and runs with every query that waited as one batched pass when that pass
  /// ends (each keeps its own scale, top_m and kind); a query on an idle collection runs at once.
  /// A coalesced answer equals the batched kernel's and differs from the single-query path only by
  /// float rounding. Pruned queries (top_k, epsilon), masked queries, index-searched hard queries and
  /// queries on multi-head collections never wait.
  /// Safe to change at any time; queries already waiting are still served.
  void set_coalescing(bool on) const noexcept;
  /// Whether coalescing is on.
  [[nodiscard]] bool coalescing() const noexcept;
  /// Counters of the coalesced single queries (soft and hard passes together).
  [[nodiscard]] CoalescingStats coalescing_stats() const;

  /// Blocks until background index work (IVF training, HNSW/IVF builds and rebuilds) has finished.
  /// Until an index is built, pruned queries scan every entry and report searched_with = exact.
  void wait_until_indexed() const;
  /// Whether background index work is running now.
  [[nodiscard]] bool index_building() const;

  /// The scale a query with these options uses; throws Error(invalid_argument) for a bad T or scale.
  [[nodiscard]] float resolve_scale(const QueryOptions& options) const;
  /// Throws the Error a query of this kind would throw for these options alone (temperature or scale;
  /// the mask's limits; for soft, top_k/epsilon and the index they need, ef_search, nprobe); returns
  /// normally otherwise.
  /// Lets a caller refuse a request before it reaches the rows (softkv::ShardedCollection's root).
  void check_options(const QueryOptions& options, Retrieval kind) const;

 private:
  std::unique_ptr<detail::CollectionImpl> impl_;
};

}  // namespace softkv
