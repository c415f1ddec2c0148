// Query masks: which rows a query may see (QueryOptions tags_any, tag_range, exclude_ids), and the
// scans that visit only those rows without reading the values of the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "scan.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

/// Whether the options restrict the rows at all.
bool has_mask(const QueryOptions& options) noexcept;

/// Error(invalid_argument) for a mask outside its documented limits (sizes, lo > hi).
void check_mask(const QueryOptions& options);

/// A run of consecutive eligible rows [begin, begin + count).
struct RowRun {
  std::size_t begin = 0;  ///< first row
  std::size_t count = 0;  ///< rows in the run
};

/// The rows a masked query may see, as runs in storage order.
struct EligibleRows {
  std::vector<RowRun> runs;  ///< ascending, disjoint, non-adjacent
  std::size_t count = 0;     ///< rows in all runs: the N of the tail bound
};

/// Per zone of kRows consecutive rows, the smallest and largest tag: a min-max "zone map", as column
/// stores keep per row group. A mask skips a zone whose [min, max] meets neither its range nor any of its
/// tags without reading the zone's tags. Zones are conservative: an overwrite or a removal only widens a
/// zone, so a zone always covers its rows' tags; rebuild() makes them exact again.
class TagZones {
 public:
  /// Rows per zone (8 KiB of tags).
  static constexpr std::size_t kRows = 1024;
  /// Exact zones for tags.
  void rebuild(std::span<const std::uint64_t> tags);
  /// Row row (at most the row count before the call: == appends a row) now has tag tag.
  void set(std::size_t row, std::uint64_t tag);
  /// The rows are now rows (after a removal took the last row away): drops zones past the end.
  void shrink(std::size_t rows);
  /// Number of zones.
  [[nodiscard]] std::size_t size() const noexcept { return lo_.size(); }
  /// Smallest tag of zone z (a lower bound after overwrites and removals).
  [[nodiscard]] std::uint64_t lo(std::size_t z) const noexcept { return lo_[z]; }
  /// Largest tag of zone z (an upper bound after overwrites and removals).
  [[nodiscard]] std::uint64_t hi(std::size_t z) const noexcept { return hi_[z]; }

 private:
  std::vector<std::uint64_t> lo_, hi_;
};

/// The rows whose tag passes options' tag tests and which are not in excluded_rows (sorted ascending).
/// Reads only the tags (8 bytes a row), never keys or values, and of those only the zones that may
/// hold an eligible tag (zones: the zone map of tags, or null to read every tag).
EligibleRows eligible_rows(std::span<const std::uint64_t> tags, const TagZones* zones, const QueryOptions& options,
                           std::span<const std::size_t> excluded_rows);

/// One byte per row of span: 1 where the row is eligible (for filtering an index's candidates).
std::vector<std::uint8_t> eligible_flags(const EligibleRows& rows, std::size_t total_rows);

// The masked scans mirror scan.hpp's over the eligible rows only. A long run is scanned in place; short
// runs are gathered into a block of at most kScanBlockRows rows first (reading only eligible rows), so
// the kernels' hot loops stay unmasked. Runs are split over `parts` threads by eligible row count.

/// soft_scan_split over the eligible rows.
SoftScan masked_soft_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                          const EligibleRows& rows, std::size_t parts, std::size_t top_m);

/// blended_value over the eligible rows (the double pass on float overflow reads only them too).
std::vector<float> masked_blended_value(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                        const EligibleRows& rows, const SoftmaxState& state);

/// hard_scan_split over the eligible rows; the row is absolute within span.
ArgMax masked_hard_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                        const EligibleRows& rows, std::size_t parts);

/// soft_scan_batch_split over the eligible rows.
std::vector<SoftmaxState> masked_soft_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                                 const float* scales, const RowSpan& span, const EligibleRows& rows,
                                                 std::size_t parts);

/// hard_scan_batch_split over the eligible rows; rows are absolute within span.
std::vector<ArgMax> masked_hard_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                           const float* scales, const RowSpan& span, const EligibleRows& rows,
                                           std::size_t parts);

/// top_k_scan over the eligible rows (best first).
std::vector<TopScores::Item> masked_top_k_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                               const EligibleRows& rows, std::size_t top_k, std::size_t parts);

}  // namespace softkv::detail
