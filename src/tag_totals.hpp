// Sums of the values per tag, kept lazily: the known totals of a block sample masked by tags_any alone,
// whatever the storage order (rows of several tags interleaved, as rows appended by many writers are),
// where ValueChunks needs long runs (estimate.hpp; docs/PRUNING.md, "Masks").
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "scan.hpp"
#include "value_chunks.hpp"

namespace softkv::detail {

/// Per tag asked for, sum v_j and sum v_j^2 per coordinate in double over the rows holding it, with their
/// count and largest |v_j|, and where keeps_key_sums sum k_j v_j^T and sum k_j (KeySums: at most 16 KiB a
/// tag, 64 MiB at kMaxTags). A tag's sums are stale after a write to one of its rows (touch, under the
/// collection's exclusive lock); stale tags are summed again by one sweep in storage order over the rows'
/// tags, a share of it per query (under the collection's shared lock and a mutex of its own). Per-tag sums
/// do not depend on where the rows are stored; a sweep in progress does: a tag leaves it (to be swept
/// again) only when a write or a move reaches the rows already swept, so appends and writes past the
/// sweep let it finish.
class TagTotals {
 public:
  /// Most tags kept; asking for more forgets the tags known to hold no row first, then every kept sum.
  static constexpr std::size_t kMaxTags = 4096;
  /// Most tags one sweep sums at once (a mask of more tags takes several sweeps).
  static constexpr std::size_t kSweepTags = 64;

  /// Row `row`, holding tag, was written or removed: the tag's sums are stale (and, if the row lies behind
  /// the sweep in progress, its partial sums too).
  void touch(std::uint64_t tag, std::size_t row) noexcept;
  /// A row holding tag moved from row `from` to row `to` (a remove fills its hole with the last row): its
  /// sums still hold, a sweep's partial ones not if the move crossed the sweep (the row counted twice or never).
  void moved(std::uint64_t tag, std::size_t from, std::size_t to) noexcept;
  /// Every tag is stale (a restore replaced the rows).
  void clear() noexcept;
  /// The totals over the rows of span whose tag (row_tags, one per row) is one of tags, if every such tag
  /// is summed and their rows number exactly eligible_rows (else empty: rows 0). Stale tags are first
  /// summed by the sweep, which reads the values of at most sweep_limit rows a query, passing over rows of
  /// other tags by their tag alone (a mask's first queries warm its tags a share at a time and answer
  /// without totals).
  [[nodiscard]] EligibleTotals totals(const RowSpan& span, std::span<const std::uint64_t> row_tags, std::span<const std::uint64_t> tags,
                                      std::size_t eligible_rows, std::size_t sweep_limit) const;

 private:
  struct Entry {
    std::vector<double> sum, square;  // dv each
    KeySums keys;                     // sum k v^T and sum k (kept for small d x dv)
    std::size_t rows = 0;             // rows holding the tag
    double abs_max = 0;               // their largest |v_j|
    bool fresh = false;               // sums match the rows
    bool sweeping = false;            // in the sweep in progress
  };
  // Sums the sweep's tags over rows [sweep_at_, ...) until sweep_limit rows were read or the rows end.
  void advance(const RowSpan& span, std::span<const std::uint64_t> row_tags, std::size_t sweep_limit) const;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::uint64_t, Entry> entries_;
  mutable std::vector<std::uint64_t> sweep_;  // the tags the sweep in progress sums (empty: none)
  mutable std::size_t sweep_at_ = 0;          // its next row
};

}  // namespace softkv::detail
