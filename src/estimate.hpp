// Estimated soft retrieval (QueryOptions::error_target): the softmax-weighted blend estimated from a
// sample of the rows, with an error estimate at 95% confidence (docs/PRUNING.md, "Estimated answers").
// Collections with certified lists first try a walk whose guaranteed bound meets the target (src/query/single.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "mask.hpp"
#include "pruning.hpp"
#include "value_moments.hpp"

namespace softkv::detail {

/// What an estimated query asks for.
struct EstimateTarget {
  double error_target = 0;      ///< the error allowed, relative to value_max (> 0)
  double value_max = 0;         ///< an upper bound on max_i ||v_i||_inf over the live rows
  std::size_t budget_rows = 0;  ///< most rows to score, all rounds together, before the exact scan is cheaper
  std::uint64_t seed = 0;       ///< the sample's seed (the same query and seed draw the same rows)
  std::size_t top_m = 0;        ///< contributors to report: the sampled rows with the largest scores
  /// estimate_over_lists: where drawn lists are scored (a batch's shared reads); null: the lists' own.
  ListScorer* scorer = nullptr;
  /// The block sample: the totals of the rows it draws from (every row of span, or a mask's eligible
  /// rows: value sums only) for its control variates and unseen spread, or null. The caller passes the
  /// totals of exactly those rows; the sample checks only their count (another count: used as null).
  const MomentTotals* moments = nullptr;
};

/// z of a two-sided normal interval holding dv coordinates at once with probability kCheckConfidence
/// (Bonferroni: each coordinate at 1 - (1 - confidence) / dv).
double simultaneous_z(std::size_t dv);

/// Rows of a block, the unit of the sample: blocks are contiguous in storage, so a sampled block is
/// read at the scan's bandwidth (a row drawn alone costs a cache miss or two per row instead).
inline constexpr std::size_t kEstimateBlockRows = 32;

/// A sample is trusted only when its weight is spread over at least this many blocks' worth
/// ((sum W_b)^2 / sum W_b^2, the effective sample size): below it a few heavy rows dominate, and the
/// rows the sample missed may hold more (peaked attention is answered by the lists or the scan).
inline constexpr double kMinEffectiveBlocks = 32;

/// A sample of this many blocks whose weight is still not spread gives up: the exact scan answers.
inline constexpr std::size_t kGiveUpBlocks = 256;

/// Estimates the soft answer from a sample of blocks of span: each block of kEstimateBlockRows rows is
/// scanned (the kernels' soft_scan) with the same probability pi, and the blend is the Horvitz-Thompson
/// ratio of the sampled blocks' totals. Rounds grow the sample until the estimated error (simultaneous_z
/// x the linearised standard error of the largest coordinate, over value_max) is at most the target on a
/// sample spread over kMinEffectiveBlocks or more; nullopt once the rounds would score more than
/// budget_rows rows: the exact scan is cheaper, or (without a stratum) once the drawn blocks' scores vary
/// between blocks far more than within them (rows stored in an order that follows the keys). The
/// result's k is the rows scored in the last round, rows_scored those of every round, error_estimate
/// the estimate; its top rows are the top_m sampled rows with the largest scores. A sample that came
/// to hold every block is the exact answer (error_estimate 0).
/// With eligible (a mask), only its rows are sampled: blocks are 32 consecutive eligible rows, which may
/// lie in several runs. With a stratum (rows of span, eligible ones, e.g. a walk's rows of the lists of
/// largest bound), those rows are scored exactly and left out of the blocks: Z^ = Z_S + sum W_b / pi and
/// Y^ likewise, the variance the blocks' alone. Rows that may hold much of the mass then cannot be missed
/// by a sample in storage order that follows the keys (rows stored cluster by cluster); rows_scored
/// counts the stratum once.
std::optional<PrunedSoft> estimated_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                                         const EstimateTarget& target, const EligibleRows* eligible = nullptr,
                                         const std::vector<std::size_t>* stratum = nullptr);

/// An estimated answer over certified lists after a walk that left a head (pruning.hpp, ListHead with
/// rows; src/list_estimate.cpp): the head's rows scored exactly, every other list drawn whole with a
/// probability proportional to its bounded mass live_c e^{ub_c} (capped at 1), in rounds that grow until
/// the error meets target.error_target; the rest's totals are Horvitz-Thompson estimates over the drawn
/// lists. The error: z x the estimated standard error plus a Bernstein range term, (7/3) ln(2 dv / 0.05)
/// x 2 max_c (live_c e^{ub_c} / pi_c) / Z^, which holds whatever an undrawn list's rows score below its
/// bound; lists bounded 40 nats below the largest score are dropped and their bounded share (twice) added.
/// rows_scored counts the head and the drawn lists. nullopt when the target cannot be met within
/// target.budget_rows rows (the head's included), a bound is not finite or a total left the float range:
/// the exact scan answers.
std::optional<PrunedSoft> estimate_over_lists(const KernelTable& kernels, const CertifiedLists& lists, const float* query, float scale,
                                              const RowSpan& span, const std::function<std::size_t(std::uint64_t)>& row_of,
                                              const ListHead& head, const EstimateTarget& target);

/// estimated_soft for n queries (row-major, prepared, one scale each) over one shared sample: each round's
/// blocks are read once and scanned by every query still estimating, a query leaves the rounds when its
/// target is met (or it gives up), and the rounds grow as the (lower) median query still estimating asks. The budget counts the
/// rows read, once for the batch. nullopt for a query the exact scan must answer. A query's answer is what
/// estimated_soft gives it alone when the batch draws the same blocks (the same seed, one query).
/// strata: null, or each query's stratum (as estimated_soft's; empty: none).
std::vector<std::optional<PrunedSoft>> estimated_soft_batch(const KernelTable& kernels, const float* queries, const float* scales,
                                                            std::size_t n, const RowSpan& span, const EstimateTarget& target,
                                                            const EligibleRows* eligible = nullptr,
                                                            const std::vector<std::vector<std::size_t>>* strata = nullptr);

}  // namespace softkv::detail
