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

/// The k-th score as tail_bound takes it: raised by a relative 1e-5 to cover float rounding (pruning.cpp).
double with_rounding_slack(double score);

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

/// The rows a masked pruned query may see. Without one, every row of the span is eligible.
struct PruneScope {
  std::size_t n = 0;                                ///< eligible rows: the tail bound's N
  std::function<PrunedSoft()> exact;                ///< the exact answer over exactly those rows
  const std::vector<std::uint8_t>* flags = nullptr; ///< one byte per span row, 1 where eligible
};

/// Confidence of the sampled check's bound (README, "Sampled check").
inline constexpr double kCheckConfidence = 0.95;

/// The sampled check of an approximate index's candidates: scores `sample` rows drawn uniformly
/// (with replacement, deterministically from the query) outside the sorted candidate rows, and
/// returns an upper bound on the softmax mass outside the candidates that holds with probability
/// kCheckConfidence if no omitted row scores above max(kth, the best sampled score): an
/// empirical-Bernstein bound on the mean of e^{s - c} over the omitted rows. When no more than
/// `sample` rows are omitted they are all scored and the result is their exact mass.
/// With scope, only its eligible rows are omitted rows (and sampled).
double sampled_tail(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                    const std::vector<std::size_t>& sorted_candidates, double kth, double lse_k, std::size_t sample,
                    const PruneScope* scope = nullptr);

/// Softmax over the rows find(k) returns (scores recomputed with kernels), or the exact scan if k >= rows.
/// check_sample > 0 (approximate indexes): the tail bound is the larger of the estimate and sampled_tail.
/// With scope (a mask), find must return eligible rows only, and N and the exact fallback are the scope's.
PrunedSoft pruned_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                       std::size_t k, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find,
                       std::size_t check_sample = 0, const PruneScope* scope = nullptr);

/// k = 16, 32, ... until tail_bound <= epsilon; the exact scan once k would pass a quarter of the rows.
PrunedSoft adaptive_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                         double epsilon, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find,
                         std::size_t check_sample = 0, const PruneScope* scope = nullptr);

}  // namespace softkv::detail
