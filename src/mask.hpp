// Query masks: which rows a query may see (QueryOptions tags_any, tag_range, exclude_ids), and the
// scans that visit only those rows without reading the values of the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "scan.hpp"
#include "softkv/collection.hpp"

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

/// The rows whose tag passes options' tag tests and which are not in excluded_rows (sorted ascending).
/// Reads only the tags (8 bytes a row), never keys or values.
EligibleRows eligible_rows(std::span<const std::uint64_t> tags, const QueryOptions& options,
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
