// Multi-head scans (CollectionConfig::heads > 1): one pass over the eligible rows serves every head.
#pragma once

#include <cstddef>
#include <vector>

#include "mask.hpp"
#include "scan.hpp"

namespace softkv::detail {

/// Every row of a span as eligible rows (one run): the unmasked scope of a multi-head scan.
EligibleRows all_rows(std::size_t rows);

/// A multi-head soft scan merged over its parts: head j's (m, l, acc) over value slice j and its top rows.
struct HeadsSoftScan {
  std::vector<SoftmaxState> states;                 ///< heads states, each of value_dim / heads floats
  std::vector<std::vector<TopScores::Item>> top;    ///< heads lists (best first), empty unless top_m > 0
};

/// One multi-head query (slice j split with scales[j]) over the eligible rows in parts pieces.
HeadsSoftScan heads_soft_scan(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                              const RowSpan& span, const EligibleRows& rows, std::size_t parts, std::size_t top_m);

/// The concatenated blended value (dv floats); a head whose float accumulator overflowed although its
/// lse is finite is redone in double over the eligible rows with the same scores (as blended_value).
std::vector<float> heads_blended_value(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                                       const RowSpan& span, const EligibleRows& rows,
                                       const std::vector<SoftmaxState>& states);

/// heads argmaxes over the eligible rows in parts pieces; rows are absolute within span.
std::vector<ArgMax> heads_hard_scan(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                                    const RowSpan& span, const EligibleRows& rows, std::size_t parts);

/// nq multi-head queries (row-major nq x d, query b's slice j split with scales[b * heads + j]) in one
/// pass over the eligible rows: each sub-block of rows (about 256 KiB of keys and values, so it stays in
/// L2) is read from memory once and scanned by every query in turn. State b * heads + j is query b's
/// head j. Each query's states equal its own heads_soft_scan's to float rounding (the blocks of the
/// online softmax may fall differently).
std::vector<SoftmaxState> heads_soft_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                                const float* scales, std::size_t heads, const RowSpan& span,
                                                const EligibleRows& rows, std::size_t parts);

/// nq multi-head argmaxes in one pass, as heads_soft_scan_batch reads the rows; entry b * heads + j is
/// query b's head j, its row absolute within span (the same answers as heads_hard_scan, bit for bit).
std::vector<ArgMax> heads_hard_scan_batch(const KernelTable& k, const float* queries, std::size_t nq, const float* scales,
                                          std::size_t heads, const RowSpan& span, const EligibleRows& rows,
                                          std::size_t parts);

}  // namespace softkv::detail
