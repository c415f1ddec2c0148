// Splits one scan over threads and merges the parts: (m, l, acc) by log-sum-exp, argmax by (score, id).
#pragma once

#include <cstddef>
#include <vector>

#include "simd/kernel_table.hpp"
#include "softmax_state.hpp"
#include "top_scores.hpp"

namespace softkv::detail {

/// How many parts a scan of rows x floats_per_row should use: requested if non-zero, otherwise
/// enough that each part streams at least ~1 MiB, at most max_parts; never more than rows.
std::size_t choose_parts(std::size_t rows, std::size_t floats_per_row, std::size_t requested,
                         std::size_t max_parts);

/// The merged softmax over span and, if top_m > 0, its top_m rows (best first).
struct SoftScan {
  SoftmaxState state;                    ///< merged (m, l, acc)
  std::vector<TopScores::Item> top;      ///< best rows, empty unless requested
};

/// One query over span in parts pieces (run on the shared pool), merged exactly.
SoftScan soft_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                         std::size_t parts, std::size_t top_m);

/// Argmax over span in parts pieces; the returned row is absolute within span.
ArgMax hard_scan_split(const KernelTable& k, const float* query, const RowSpan& span, std::size_t parts);

/// nq queries over span in parts pieces; one merged state per query.
std::vector<SoftmaxState> soft_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                                float scale, const RowSpan& span, std::size_t parts);

/// nq argmaxes over span in parts pieces; rows are absolute within span.
std::vector<ArgMax> hard_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                          const RowSpan& span, std::size_t parts);

}  // namespace softkv::detail
