// Pruned soft retrieval: candidates from an index, an exact softmax over them, a tail bound on the rest.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "index/certified_lists.hpp"
#include "scan.hpp"

namespace softkv::detail {

/// Upper bound on the softmax mass outside k of n entries when every omitted score is <= kth_score:
/// (n-k) e^{s_k} / (Z_k + (n-k) e^{s_k}) with lse_k = log Z_k, computed in log space (docs/PRUNING.md).
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
  std::size_t rows_scored = 0;  ///< rows whose score was computed (0: k, as every path but a walk and an estimate)
  std::optional<double> error_estimate{};  ///< estimated answers: the estimated error relative to max ||v||_inf
};

/// The exact scan over all of span, as a PrunedSoft with nothing omitted.
PrunedSoft exact_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                      std::size_t top_m, std::size_t parts);

/// The softmax over the given rows of span (gathered, scored by the kernels as the exact scan scores
/// them), their blended value and top_m rows; k = rows.size(), tail_bound 0. scores, when given,
/// receives the rows' scores in the order of rows.
PrunedSoft soft_over_rows(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                          const std::vector<std::size_t>& rows, std::size_t top_m, std::vector<float>* scores = nullptr);

/// The rows a masked pruned query may see. Without one, every row of the span is eligible.
struct PruneScope {
  std::size_t n = 0;                                ///< eligible rows: the tail bound's N
  std::function<PrunedSoft()> exact;                ///< the exact answer over exactly those rows
  const std::vector<std::uint8_t>* flags = nullptr; ///< one byte per span row, 1 where eligible
};

/// A seed from the query's bits and the rows it is drawn over: the same query on the same rows draws
/// the same sample (the sampled check, estimated answers).
std::uint64_t seed_of(const float* query, std::size_t d, std::size_t rows);

/// Confidence of the sampled check's bound (docs/PRUNING.md, "Sampled check").
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

// ---- the planner's cost rule (docs/PRUNING.md, "The planner") ----
// Work is counted in row-equivalents: one row of the exact scan, read in order. The exact scan of a
// collection costs its rows; a pruned path may spend a budget of rows / kBudgetDivisor before it gives
// up and runs the exact scan, so a pruned query never costs much more than the scan alone.

/// The pruned path's share of the exact scan's work: 1/32 (at 1/16, a certified walk that used its budget
/// and gave up cost up to 1.2x the scan at 1M rows: a walked row costs several scanned ones).
inline constexpr std::size_t kBudgetDivisor = 32;
/// A row read out of storage order (a gathered candidate, a list member, a graph node) counts as this
/// many rows read in order: a cache miss each, where the scan streams at full bandwidth.
inline constexpr std::size_t kRandomRowCost = 4;
/// Below this many bytes a collection is scanned in microseconds: pruned queries there run as asked.
inline constexpr std::size_t kPlannerMinBytes = std::size_t{1} << 20;
/// Row-equivalents a pruned query may spend on a collection of rows rows of row_bytes bytes
/// (unbounded below kPlannerMinBytes).
std::size_t prune_budget(std::size_t rows, std::size_t row_bytes);

/// Nanoseconds since t0 on the steady clock (the planner's timings).
inline double elapsed_ns(std::chrono::steady_clock::time_point t0) noexcept {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
}

/// The planner's calibration on the machine at hand: the measured time of a row of the exact scan and of
/// a row-equivalent of the index's pruned rounds (running averages, per collection). The cost model
/// counts an index's work in row-equivalents from constants (kRandomRowCost, a graph node's neighbours);
/// factor() says how many scanned rows one of them has really cost here (1 until both were measured).
/// Concurrent updates may lose one another's sample: each is an average anyway.
class PlannerCalibration {
 public:
  /// An exact scan of rows rows took ns nanoseconds.
  void note_scan(double ns, std::size_t rows) noexcept { update(scan_ns_per_row_, ns / static_cast<double>(std::max<std::size_t>(rows, 1))); }
  /// A pruned query whose rounds the model costed at units row-equivalents took ns nanoseconds.
  void note_pruned(double ns, std::size_t units) noexcept { update(pruned_ns_per_unit_, ns / static_cast<double>(std::max<std::size_t>(units, 1))); }
  /// Measured scanned rows per modelled row-equivalent (>= 1/4: the model is never trusted to be 4x pessimistic).
  [[nodiscard]] double factor() const noexcept {
    const double scan = scan_ns_per_row_.load(std::memory_order_relaxed), pruned = pruned_ns_per_unit_.load(std::memory_order_relaxed);
    return scan > 0 && pruned > 0 ? std::max(0.25, pruned / scan) : 1.0;
  }
  /// Whether a query the calibrated model sends to the exact scan should try the pruned path anyway, to
  /// keep the calibration current (one in 16 such queries).
  [[nodiscard]] bool explore() noexcept { return skipped_.fetch_add(1, std::memory_order_relaxed) % 16 == 15; }
  /// A pruned attempt the planner remembers (on unmasked queries under its budget): it answers the query
  /// or hands it on to a costlier path, and attempts whose misses waste more than their answers save are
  /// skipped (skip).
  enum class Attempt : std::uint8_t {
    top_k_walk,     ///< a certified walk for top_k (a miss: the exact scan answers)
    epsilon_walk,   ///< a certified walk for epsilon (a miss: the exact scan answers)
    estimate_walk,  ///< error_target's walk over certified lists (a miss: the sample or the scan answers)
    sample,         ///< error_target's sample of row blocks (a miss: the exact scan answers)
  };
  /// An attempt of kind a on a collection of rows rows ended after ns nanoseconds (0: not timed): it
  /// answered the query, or handed it on (its time wasted). The kind's balance, in exact scans of the
  /// collection, gains what an answer saved (1 - its time in scans; nothing for an answer slower than the
  /// scan, not a loss: one query stalled by the machine must not stop a kind that answers) and loses what a
  /// miss wasted (its time in scans, at most kWastedScans; untimed, or before any scan was timed,
  /// kWastedScans / kMisses). After an answer the balance is at least -kWastedScans / 2: an answer ends
  /// the skipping. The balance starts at kWastedScans and is kept within [-kWastedScans, kWastedScans]: a
  /// stream of answers banks at most half a scan against later misses.
  void note(Attempt a, bool answered, double ns, std::size_t rows) noexcept {
    Memory& m = memory(a);
    const double scan = scan_ns_per_row_.load(std::memory_order_relaxed) * static_cast<double>(rows);
    const bool timed = scan > 0 && ns > 0;
    double balance = m.balance.load(std::memory_order_relaxed);
    if (answered) {
      m.misses.store(0, std::memory_order_relaxed);
      balance = std::max(timed ? balance + std::max(0.0, 1 - ns / scan) : balance, -kWastedScans / 2);
    } else {
      m.misses.store(std::min<std::uint32_t>(m.misses.load(std::memory_order_relaxed) + 1, kMisses), std::memory_order_relaxed);
      balance -= timed ? std::min(ns / scan, kWastedScans) : kWastedScans / kMisses;
    }
    m.balance.store(std::clamp(balance, -kWastedScans, kWastedScans), std::memory_order_relaxed);
  }
  /// Whether an attempt of kind a should not be made: once the misses in a row number kMisses, or the
  /// kind's balance is at -kWastedScans (its misses wasted more than its answers saved: spread attention
  /// for a walk, peaked attention for a sample, a stream the sample answers too rarely to pay for the
  /// rest, or a collection so small that a failed attempt's fixed cost is a share of the scan), every
  /// query but one in 16 skips it; that one tries, and an answer ends the skipping (note).
  [[nodiscard]] bool skip(Attempt a) noexcept {
    Memory& m = memory(a);
    const bool failing = m.misses.load(std::memory_order_relaxed) >= kMisses || m.balance.load(std::memory_order_relaxed) <= -kWastedScans;
    return failing && m.skipped.fetch_add(1, std::memory_order_relaxed) % 16 != 15;
  }
  /// Misses in a row of attempts of kind a so far (at most kMisses; 0 after an answer).
  [[nodiscard]] std::uint32_t misses(Attempt a) const noexcept {
    return memory_[static_cast<std::size_t>(a)].misses.load(std::memory_order_relaxed);
  }
  /// The balance of attempts of kind a, in exact scans (note).
  [[nodiscard]] double balance(Attempt a) const noexcept {
    return memory_[static_cast<std::size_t>(a)].balance.load(std::memory_order_relaxed);
  }
  /// The credit a kind starts with, the most it banks and the most one miss costs, in exact scans; at
  /// -kWastedScans its attempts are skipped (skip). From the start, misses costing a share c of the scan
  /// each are skipped after ceil(1 / c) of them (2 at c >= 0.5, 4 at 0.25) or kMisses, whichever comes
  /// first; where answers save 0.7 scan and one query in two misses at 0.3, they pay and are made.
  static constexpr double kWastedScans = 0.5;
  /// Misses in a row after which attempts of a kind are skipped (skip).
  static constexpr std::uint32_t kMisses = 8;

 private:
  static void update(std::atomic<double>& average, double sample) noexcept {
    const double old = average.load(std::memory_order_relaxed);
    average.store(old == 0 ? sample : 0.8 * old + 0.2 * sample, std::memory_order_relaxed);
  }
  std::atomic<double> scan_ns_per_row_{0};
  std::atomic<double> pruned_ns_per_unit_{0};
  std::atomic<std::uint32_t> skipped_{0};
  struct Memory {
    std::atomic<std::uint32_t> misses{0};   // misses in a row, up to kMisses
    std::atomic<std::uint32_t> skipped{0};  // attempts skipped or tried since (one in 16 tries)
    std::atomic<double> balance{kWastedScans};  // what the answers saved less what the misses wasted, in exact scans (from a credit)
  };
  Memory& memory(Attempt a) noexcept { return memory_[static_cast<std::size_t>(a)]; }
  std::array<Memory, 4> memory_;
};

/// The cost of one adaptive round (finding k candidates, rescoring and checking them) and the budget.
struct RoundCost {
  std::function<std::size_t(std::size_t k)> of;  ///< row-equivalents of the round for k candidates
  std::size_t budget = 0;                        ///< the most all rounds may spend together
  [[nodiscard]] explicit operator bool() const { return static_cast<bool>(of); }
  std::size_t operator()(std::size_t k) const { return of(k); }
};

/// The adaptive rule of epsilon, on any answer with a tail_bound (one collection's, or the sharded
/// collection's global one): round(k) for k = 16, 32, ... until its tail_bound <= epsilon; exact() once k
/// would pass a quarter of the n rows or, with cost, once the next round would take the rounds' work past
/// cost.budget (the scan has then cost at most the budget more than it alone).
template <class Result, class Round, class Exact>
Result adaptive_rounds(std::size_t n, double epsilon, const Round& round, const Exact& exact, const RoundCost& cost = {}) {
  std::size_t spent = 0;
  for (std::size_t k = 16;; k *= 2) {
    const std::size_t next = cost ? cost(k) : 0;
    if (k > n / 4 || (cost && spent + next > cost.budget)) return exact();
    spent += next;
    Result r = round(k);
    if (r.tail_bound <= epsilon) return r;
  }
}

/// adaptive_rounds over pruned_soft: the candidates of find(k), or the exact scan (of the scope, with one).
PrunedSoft adaptive_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                         double epsilon, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find,
                         std::size_t check_sample = 0, const PruneScope* scope = nullptr, const RoundCost& cost = {});

/// What a pruned query asks of certified lists.
struct ListTarget {
  std::size_t top_k = 0;        ///< > 0: the exact top_k rows are the candidates
  double epsilon = 0;           ///< top_k == 0: visit lists until the guaranteed tail bound is <= epsilon
  std::size_t budget_rows = 0;  ///< most rows to score before giving up (the exact scan costs less from there)
  /// A mask: one byte per span row, 1 where eligible (null: every row). A visited list's rows are scored
  /// and the ineligible ones dropped; an unvisited list's bound covers its eligible rows as it covers all.
  const std::vector<std::uint8_t>* eligible = nullptr;
  std::size_t eligible_rows = 0;  ///< with eligible: how many rows are (the tail bound's N)
  /// Every list's bound for this query computed beforehand (CertifiedLists::bounds_batch: a batch's walks
  /// share the centroid pass), with live; null: the walk computes them.
  const double* bounds = nullptr;
  const std::uint32_t* live = nullptr;  ///< with bounds: every list's live members
  const BoundsSummary* summary = nullptr;  ///< with bounds: what their pass gathered for the walk, or null
  /// Where visited lists are scored (a batch's shared reads); null: CertifiedLists::score_list.
  ListScorer* scorer = nullptr;
};

/// What a certified walk for an estimated answer leaves when it cannot meet its target (certified_soft's
/// head): the rows it visited, when their lists held the mass (the first visited lists outweigh the later
/// ones: peaked attention), and a bound on every other row.
struct ListHead {
  /// A list not visited: its bound on every live member's kernel score, its index and live members.
  struct Rest {
    double ub;
    std::uint32_t list;
    std::uint32_t live;
  };
  std::vector<std::size_t> rows;  ///< the visited rows of span (spread: those a stratum keeps)
  /// Spread: rows the walk scored and left out of rows (past its first 8, 16, ... lists, where it went on
  /// for a row that could hold much of the mass, the rows that cannot; the block sample may draw them).
  std::size_t apart = 0;
  std::vector<Rest> rest;         ///< every list not visited that has a live member (empty when spread)
  /// The mass looked spread over the lists: rows are no head to estimate the other lists around, only the
  /// rows of the lists of largest bound, which a block sample leaves out and adds exactly (estimated_soft).
  bool spread = false;
};

/// Pruned soft retrieval over certified lists (docs/PRUNING.md): visits lists by decreasing upper bound
/// until target is met; the candidates are the exact top_k, or every visited row (epsilon). The tail
/// bound is a guarantee: the unvisited lists' bounded mass (plus, for top_k, the visited non-candidates)
/// relative to the candidates'. row_of maps a live id to its row of span. nullopt when more than
/// budget_rows rows would be scored: the caller runs the exact scan.
/// With head (epsilon only: an estimated answer's walk), a walk that does not meet epsilon within the
/// budget stops there (it does not ask the bounds whether it could), and leaves its visited rows in head
/// with the lists not visited, unless the second half of the lists it visited holds a quarter or more of
/// their mass (spread attention: a head would not hold it; head->spread, the rows alone); it also stops so
/// as soon as that is seen at 8, 16, 32, ... lists.
std::optional<PrunedSoft> certified_soft(const KernelTable& kernels, const CertifiedLists& lists, const float* query, float scale,
                                         const RowSpan& span, const std::function<std::size_t(std::uint64_t)>& row_of,
                                         const ListTarget& target, std::size_t top_m, ListHead* head = nullptr);

}  // namespace softkv::detail
