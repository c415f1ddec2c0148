// Pruned soft retrieval over an index's candidates, with the tail bound of DESIGN.md.
#include "pruning.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace softkv::detail {
namespace {

// Slack on the k-th score. The flat index ranks by the very scores used here, so no omitted score
// exceeds the k-th and the bound holds without it; it covers the float rounding of lse_k, and for
// the approximate indexes (whose bound is an estimate anyway) their own rounding of the ranking.
double with_rounding_slack(double score) { return score + 1e-5 * std::max(1.0, std::fabs(score)); }

}  // namespace

double tail_bound(std::size_t n, std::size_t k, double kth_score, double lse_k) {
  if (k >= n) return 0.0;
  const double log_rest = std::log(static_cast<double>(n - k)) + kth_score;  // log((n-k) e^{s_k})
  const double m = std::max(log_rest, lse_k);
  const double log_total = m + std::log(std::exp(log_rest - m) + std::exp(lse_k - m));
  return std::exp(log_rest - log_total);
}

PrunedSoft exact_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                      std::size_t top_m, std::size_t parts) {
  PrunedSoft result{soft_scan_split(kernels, query, scale, span, parts, top_m), {}, span.rows, 0.0};
  result.value = blended_value(kernels, query, scale, span, result.scan.state);
  return result;
}

PrunedSoft pruned_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                       std::size_t k, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find) {
  if (k >= span.rows) return exact_soft(kernels, query, scale, span, top_m, exact_parts);
  const std::vector<std::size_t> rows = find(k);
  if (rows.empty()) return exact_soft(kernels, query, scale, span, top_m, exact_parts);
  // Gather the candidates into one small contiguous span and run the same kernel as the exact path.
  const std::size_t d = span.dim, dv = span.value_dim;
  std::vector<float> keys(rows.size() * d), values(rows.size() * dv);
  std::vector<std::uint64_t> ids(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::copy_n(span.keys + rows[i] * d, d, keys.begin() + static_cast<std::ptrdiff_t>(i * d));
    std::copy_n(span.values + rows[i] * dv, dv, values.begin() + static_cast<std::ptrdiff_t>(i * dv));
    ids[i] = span.ids[rows[i]];
  }
  const RowSpan candidates{keys.data(), values.data(), ids.data(), rows.size(), d, dv};
  // The candidates' scores come from the kernel's one scoring routine, bit-identical to the exact
  // scan's and (flat) to the top-k pass that chose them: the k-th of them bounds every omitted score.
  std::vector<float> scores(rows.size());
  kernels.scores(query, scale, candidates, scores.data());
  const double kth = *std::min_element(scores.begin(), scores.end());
  PrunedSoft result{soft_scan_split(kernels, query, scale, candidates, 1, top_m), {}, rows.size(), 0.0};
  result.value = blended_value(kernels, query, scale, candidates, result.scan.state);
  result.tail_bound = tail_bound(span.rows, rows.size(), with_rounding_slack(kth), result.scan.state.lse());
  return result;
}

PrunedSoft adaptive_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                         double epsilon, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find) {
  for (std::size_t k = 16;; k *= 2) {
    if (k > span.rows / 4) return exact_soft(kernels, query, scale, span, top_m, exact_parts);
    PrunedSoft r = pruned_soft(kernels, query, scale, span, k, top_m, exact_parts, find);
    if (r.tail_bound <= epsilon) return r;
  }
}

}  // namespace softkv::detail
