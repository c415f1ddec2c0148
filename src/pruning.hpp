// Pruned soft retrieval: candidates from an index, an exact softmax over them, a tail bound on the rest.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "scan.hpp"

namespace softkv::detail {

/// Upper bound on the softmax mass outside k of n entries when every omitted score is <= kth_score:
/// (n-k) e^{s_k} / (Z_k + (n-k) e^{s_k}) with lse_k = log Z_k, computed in log space (DESIGN.md).
double tail_bound(std::size_t n, std::size_t k, double kth_score, double lse_k);

/// Rows (positions in the scanned span) of up to k of the best keys for the query.
using CandidateFinder = std::function<std::vector<std::size_t>(std::size_t k)>;

/// A soft answer over a candidate set.
struct PrunedSoft {
  SoftScan scan;             ///< softmax state over the candidates (and their top_m rows)
  std::vector<float> value;  ///< the blended value over the candidates (blended_value)
  std::size_t k = 0;         ///< number of candidates (span.rows when the exact scan ran)
  double tail_bound = 0;     ///< bound on the mass outside the candidates (0 for the exact scan)
};

/// The exact scan over all of span, as a PrunedSoft with nothing omitted.
PrunedSoft exact_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                      std::size_t top_m, std::size_t parts);

/// Softmax over the rows find(k) returns (scores recomputed with kernels), or the exact scan if k >= rows.
PrunedSoft pruned_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                       std::size_t k, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find);

/// k = 16, 32, ... until tail_bound <= epsilon; the exact scan once k would pass a quarter of the rows.
PrunedSoft adaptive_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                         double epsilon, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find);

}  // namespace softkv::detail
