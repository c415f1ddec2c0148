// detail::CollectionImpl (Collection's implementation): a collection's rows, ids, id counter and index, behind the one lock that guards them.
// Only the Collection's own files include this header; the data is private and reached through the
// methods below, so every invariant (row i holds ids[i], slot_of[ids[i]] == i, next_id > every id,
// the index mirrors the rows) is kept in this file and in collection.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "id_map.hpp"
#include "query/pass_choice.hpp"
#include "stored_rows.hpp"
#include "tag_totals.hpp"
#include "value_chunks.hpp"
#include "value_moments.hpp"
#include "coalescer.hpp"
#include "index/pruning_index.hpp"
#include "mask.hpp"
#include "pruning.hpp"
#include "scan.hpp"
#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "writer_first_mutex.hpp"

namespace softkv {

namespace detail {
/// A single soft query waiting in a coalescer: its prepared query (d floats, split with its scale) and answer.
struct SoftPending : CoalescedQuery {
  const float* query = nullptr;    ///< prepared query, owned by the waiting caller
  const float* factors = nullptr;  ///< its score factor (split_scale), or one per head on a multi-head collection
  std::size_t top_m = 0;           ///< contributors it wants
  SoftResult result;             ///< its answer
};
/// A single hard query waiting in a coalescer.
struct HardPending : CoalescedQuery {
  const float* query = nullptr;    ///< prepared query
  const float* factors = nullptr;  ///< its score factor, or one per head
  HardResult result;             ///< its answer
};
/// The most queries one coalesced pass serves: the batch kernel's sweet spot (measured in bench/).
inline constexpr std::size_t kMaxCoalescedBatch = 64;

/// Collection's implementation: the rows, ids, tags, index and coalescers behind one lock.
class CollectionImpl {
 public:
  explicit CollectionImpl(const CollectionConfig& config);
  ~CollectionImpl();  // joins the background builder
  CollectionImpl(const CollectionImpl&) = delete;
  CollectionImpl& operator=(const CollectionImpl&) = delete;

  // ---- shape ----
  [[nodiscard]] const CollectionConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::size_t dim() const noexcept { return config_.dim; }
  [[nodiscard]] std::size_t value_dim() const noexcept { return config_.value_dim; }
  [[nodiscard]] std::size_t heads() const noexcept { return config_.heads; }

  // ---- reading: every method below that returns rows or indexes needs read_lock() held ----
  /// The shared lock queries hold while they read rows (writers wait; see writer_first_mutex.hpp).
  [[nodiscard]] std::shared_lock<detail::WriterFirstMutex> read_lock() const { return std::shared_lock(mutex_); }
  /// The rows as one view for the scans.
  [[nodiscard]] detail::RowSpan span() const {
    return {keys_.data(), values_.data(), ids_.data(), ids_.size(), dim(), value_dim(),
            keys_.precision(), values_.precision(), keys_.scales()};
  }
  /// Number of entries.
  [[nodiscard]] std::size_t rows() const noexcept { return ids_.size(); }
  /// Key of row r as float32 (as stored: rounded to the key precision).
  [[nodiscard]] std::vector<float> key_of(std::size_t r) const {
    std::vector<float> k(dim());
    keys_.get(r, k.data());
    return k;
  }
  /// Value of row r as float32 (as stored: rounded to the value precision).
  [[nodiscard]] std::vector<float> value_of(std::size_t r) const {
    std::vector<float> v(value_dim());
    values_.get(r, v.data());
    return v;
  }
  /// Row i's tag.
  [[nodiscard]] std::uint64_t tag_of_row(std::size_t row) const noexcept { return tags_[row]; }
  /// Every row's tag, in storage order (the masks test these).
  [[nodiscard]] std::span<const std::uint64_t> tags() const noexcept { return tags_; }
  /// The row holding id, if any.
  [[nodiscard]] std::optional<std::size_t> row_of(std::uint64_t id) const;
  /// The pruning index (null for IndexKind::exact).
  [[nodiscard]] const detail::PruningIndex* index() const noexcept { return index_.get(); }
  /// Number of entries without the lock (it may lag a write in progress).
  [[nodiscard]] std::size_t size_hint() const noexcept { return size_hint_.load(std::memory_order_relaxed); }
  /// Bytes a hard pass reads per row (the key as stored).
  [[nodiscard]] std::size_t key_row_bytes() const noexcept { return keys_.row_bytes(); }
  /// Bytes a soft pass reads per row (key and value as stored).
  [[nodiscard]] std::size_t row_bytes() const noexcept { return keys_.row_bytes() + values_.row_bytes(); }
  /// >= max_i ||v_i||_inf over the live rows (error_target's scale). Under the read lock.
  [[nodiscard]] double value_max() const noexcept { return value_max_; }
  /// The rows' totals for the block sample's control variates (summed at the first call). Under the read lock.
  [[nodiscard]] detail::MomentTotals moment_totals() const { return moments_.totals(detail::kernels(), span()); }
  /// The totals over a mask's eligible rows (value sums and squares), or empty ones (rows 0) when more than
  /// loose_limit of them lie outside whole chunks or its stale chunks hold more than stale_limit rows
  /// (ValueChunks::totals).
  [[nodiscard]] detail::EligibleTotals eligible_totals(const detail::EligibleRows& rows, std::size_t loose_limit,
                                                       std::size_t stale_limit) const {
    return chunks_.totals(span(), rows, loose_limit, stale_limit);
  }
  /// The totals over the rows whose tag is one of tags, which number eligible_rows, or empty ones while
  /// those tags' sums are stale (summed a share per query: the values of sweep_limit rows) or when they number
  /// otherwise (TagTotals::totals).
  [[nodiscard]] detail::EligibleTotals tag_totals(std::span<const std::uint64_t> tags, std::size_t eligible_rows,
                                                  std::size_t sweep_limit) const {
    return tag_totals_.totals(span(), tags_, tags, eligible_rows, sweep_limit);
  }
  /// Whether writes keep the totals (a query summed them and nothing made them be forgotten since).
  [[nodiscard]] bool moments_kept() const noexcept { return moments_.kept(); }

  // ---- writes (each takes the exclusive lock itself) ----
  /// Validates rows (ids empty: an add) and returns them as stored; throws the caller's typed errors.
  [[nodiscard]] Rows prepare(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                             std::span<const std::uint64_t> tags) const;
  /// Stores prepared rows whose ids are set; Error(internal) if their shape does not fit.
  void apply(const Rows& rows);
  /// Gives prepared rows (ids empty) the next ids and stores them, atomically; returns the ids.
  std::vector<std::uint64_t> add(Rows rows);
  /// Removes distinct present ids, all or nothing.
  void remove(std::span<const std::uint64_t> ids);
  /// The id add() assigns next.
  [[nodiscard]] std::uint64_t next_id() const;

  // ---- snapshots ----
  /// Copies everything under the shared lock.
  [[nodiscard]] CollectionImage image() const;
  /// Fills an empty Impl from an image; returns one line about the index.
  std::string restore(CollectionImage image);

  // ---- coalescing ----
  /// The coalescers of single soft and hard queries.
  [[nodiscard]] detail::Coalescer<detail::SoftPending>& soft_coalescer() const noexcept { return soft_coalescer_; }
  [[nodiscard]] detail::Coalescer<detail::HardPending>& hard_coalescer() const noexcept { return hard_coalescer_; }
  /// The planner's measured costs on this machine (pruning.hpp).
  [[nodiscard]] detail::PlannerCalibration& calibration() const noexcept { return calibration_; }
  /// How this collection's fused soft / hard passes of a few queries run (measured as they run).
  [[nodiscard]] detail::PassChoice& soft_pass_choice() const noexcept { return soft_pass_choice_; }
  [[nodiscard]] detail::PassChoice& hard_pass_choice() const noexcept { return hard_pass_choice_; }  ///< see soft_pass_choice
  /// Whether single queries are coalesced.
  [[nodiscard]] bool coalescing() const noexcept { return coalesce_.load(std::memory_order_relaxed); }
  /// Turns coalescing on or off.
  void set_coalescing(bool on) const noexcept { coalesce_.store(on, std::memory_order_relaxed); }

  // ---- background index builds ----
  /// Blocks until no build runs.
  void wait_until_indexed() const;
  /// Whether a build runs now.
  [[nodiscard]] bool index_building() const;

  // ---- query helpers (the query paths in src/query/ use these with read_lock() held) ----
  /// Validates row-major queries (dimension, finiteness) and returns them ready to score (unit length for cosine).
  [[nodiscard]] std::vector<float> prepare_queries(std::span<const float> queries, std::size_t& count) const;
  /// Error(empty_collection) when there are no rows.
  void require_entries() const;
  /// The rows options' mask keeps; Error(empty_collection) when it keeps none.
  [[nodiscard]] detail::EligibleRows eligible(const QueryOptions& options) const;
  /// The rows options' mask keeps, possibly none (eligible() without its empty check).
  [[nodiscard]] detail::EligibleRows eligible_or_none(const QueryOptions& options) const;
  /// Row slices for one scan reading floats_per_row floats per row.
  [[nodiscard]] std::size_t parts_for(const QueryOptions& options, std::size_t floats_per_row) const;
  /// Whether queries with these options search through the index rather than scanning.
  [[nodiscard]] bool use_index(const QueryOptions& options) const { return index_ && index_->ready() && !options.exact; }
  /// Rows of the index's candidates for a query split by split_scale into (query, scale) (live entries only).
  [[nodiscard]] std::vector<std::size_t> index_rows(const float* query, float scale, std::size_t k,
                                                    const QueryOptions& options) const;
  /// Error(numeric_overflow) unless lse is finite: detail::EveryScoreBelowRange for -inf (no row weighs anything).
  static void check_lse(double lse);

 private:
  // The keys as they will be stored: the input itself for dot, unit-length copies in buffer for cosine.
  std::span<const float> prepare_keys(std::span<const float> keys, std::vector<float>& buffer, std::string_view what) const;
  // Inserts or replaces one prepared row. Caller holds the exclusive lock.
  void put(std::uint64_t id, const float* key, const float* value, std::uint64_t tag);
  class MomentRows;  // rows a write takes out of or puts into moments_ (collection.cpp)
  // Raises value_max_ to cover a value row as stored.
  void note_value(const float* value);
  // Stores prepared rows with their ids and tags (empty: all 0) and tells the index. Caller holds the exclusive lock.
  void store(std::span<const std::uint64_t> ids, const float* keys, const float* values, std::span<const std::uint64_t> tags);
  // Starts the background builder if the index asks for a (re)build. Caller holds the write lock.
  void start_build_if_due();
  // The builder: prepare under the shared lock, build with no lock, install under the exclusive lock.
  void run_builds();

  // Storage: row i holds ids_[i], tags_[i], key row i of keys_, value row i of values_, each at the
  // config's precision. Removal moves the last row into the hole, so scans never see gaps and need no tombstone test.
  CollectionConfig config_;
  mutable detail::WriterFirstMutex mutex_;
  detail::StoredRows keys_;
  detail::StoredRows values_;
  std::vector<std::uint64_t> ids_;
  std::vector<std::uint64_t> tags_;  // tags_[i] is row i's tag; moved with the row like ids_
  detail::TagZones zones_;           // the min-max zone map of tags_, kept with every write
  IdMap slot_of_;  // id -> row
  std::uint64_t next_id_ = 0;
  // >= max_i ||v_i||_inf over the rows stored since the last restore (removes do not lower it): the
  // scale of error_target (an upper bound, so the error allowed is never below what was asked).
  double value_max_ = 0;
  // sum v and sum k v^T over the rows, kept by writes once a query summed them (error_target's control variates)
  mutable detail::ValueMoments moments_;
  // sum v and sum v^2 per chunk of rows, marked stale by writes (a masked error_target's known totals)
  mutable detail::ValueChunks chunks_;
  mutable detail::TagTotals tag_totals_;  // per-tag value sums (a tags_any mask's totals), touched like chunks_
  std::unique_ptr<detail::PruningIndex> index_;  // null for IndexKind::exact; updated under the write lock
  std::atomic<std::size_t> size_hint_{0};        // ids_.size(), published after each write (read without the lock)
  // Coalescing is query-side machinery, not collection state: usable through a const collection.
  mutable std::atomic<bool> coalesce_{true};
  mutable detail::PlannerCalibration calibration_;  // query-side too: measured by const queries
  mutable detail::PassChoice soft_pass_choice_, hard_pass_choice_;
  mutable detail::Coalescer<detail::SoftPending> soft_coalescer_{detail::kMaxCoalescedBatch};
  mutable detail::Coalescer<detail::HardPending> hard_coalescer_{detail::kMaxCoalescedBatch};
  // Background index builds, one at a time; the thread is joined in the destructor before the rest goes.
  mutable std::mutex build_mutex_;
  mutable std::condition_variable build_done_;
  bool building_ = false;
  std::thread builder_;
};

}  // namespace detail
}  // namespace softkv
