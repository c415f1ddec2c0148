// Estimated answers for a batch (paths.hpp, soft_estimated): the certified walk per query, one shared
// sample of row blocks for the rest, one fused pass for what the sample could not answer
// (docs/PRUNING.md, "Estimated answers").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "collection_impl.hpp"
#include "estimate.hpp"
#include "index/shared_scores.hpp"
#include "mask.hpp"
#include "pruning.hpp"
#include "query/paths.hpp"
#include "simd/kernel_table.hpp"

namespace softkv::detail {

std::vector<SoftResult> soft_estimated(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                       const QueryOptions& options, std::vector<std::exception_ptr>& errors) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const KernelTable& kernels = detail::kernels();
  const std::size_t d = impl.dim();
  std::optional<EligibleRows> mask;
  if (has_mask(options)) mask = impl.eligible(options);
  const std::size_t rows = mask ? mask->count : span.rows;
  const double target = *options.error_target;
  const PruningIndex* index = impl.index();
  std::vector<SoftResult> out(n);
  errors.assign(n, nullptr);
  std::vector<std::optional<PrunedSoft>> answers(n);
  std::vector<std::uint8_t> walked(n, 0);
  // Per query: kHanded, its walk handed its rows to the sample (judged by the sample's answer); kSkipped,
  // its group's walks were skipped (the exact pass answers it: a sample without the walk's stratum is
  // not trusted on lists whose walks keep failing, as for a query alone).
  constexpr std::uint8_t kHanded = 1, kSkipped = 2;
  std::vector<std::uint8_t> handed(n, 0);
  // Each query's share of what the planner times (ns): its walk with its share of the group's bounds
  // pass, and its share of the batch's sample (the sample's time over the queries it served).
  std::vector<double> walk_ns(n, 0.0);
  double sample_share = 0;
  // 1. Certified lists: each query's walk, and the estimate over its head where it left one, as a query
  // alone takes them (soft_one); a walk that does not answer leaves its rows to the sample (2.).
  std::vector<std::vector<std::size_t>> strata(n);  // each query's walk rows: the sample's exact stratum
  std::vector<std::size_t> apart(n, 0);             // and the rows each walk scored that are not in it
  // The planner's memory of attempts that handed their queries on (PlannerCalibration::skip), as for a
  // query alone: a group of walks or the batch's sample is skipped when such attempts keep missing.
  using Attempt = PlannerCalibration::Attempt;
  PlannerCalibration& memory = impl.calibration();
  const bool remembered = !mask && prune_budget(span.rows, impl.row_bytes()) != std::numeric_limits<std::size_t>::max();
  if (!mask && impl.use_index(options) && index->lists() != nullptr) {
    // The list bounds of kBoundsQueries queries at a time from one pass over the centroids (at 1M rows,
    // ~55,000 of them): the centroids are read once per group, and the group's bounds (12 bytes a list and
    // query: 21 MiB for 32 queries at 1M rows) stay bounded however large the batch.
    constexpr std::size_t kBoundsQueries = 32;
    const CertifiedLists& lists = *index->lists();
    const std::size_t count = lists.list_count();
    // Each group's walks share their list reads (SharedListScores): a list read for one query is scored
    // for the group's later queries likely to visit it, and their walks take those scores.
    std::vector<double> bounds;
    std::vector<BoundsSummary> summaries;  // each query's walk start, gathered in the group's pass
    std::optional<SharedListScores> shared;
    bool walk_group = true;
    double group_share = 0;  // the group's bounds pass, per query of the group (ns)
    for (std::size_t b = 0; b < n; ++b) {
      if (b % kBoundsQueries == 0) {
        const std::size_t group = std::min(kBoundsQueries, n - b);
        shared.reset();
        walk_group = !(remembered && memory.skip(Attempt::estimate_walk));
        if (!walk_group) {
          std::fill(handed.begin() + static_cast<std::ptrdiff_t>(b), handed.begin() + static_cast<std::ptrdiff_t>(b + group), kSkipped);
          continue;
        }
        const auto t0 = std::chrono::steady_clock::now();
        lists.bounds_batch(q + b * d, factors + b, group, d, bounds, summaries);
        shared.emplace(lists, q + b * d, factors + b, group, d, bounds.data(), summaries.data());
        group_share = elapsed_ns(t0) / static_cast<double>(group);
      }
      if (!walk_group) continue;
      try {
        const auto t0 = std::chrono::steady_clock::now();
        answers[b] = estimate_through_lists(impl, q + b * d, factors[b], target, options.top_m, strata[b],
                                            bounds.data() + (b % kBoundsQueries) * count, lists.live_counts(),
                                            &shared->for_query(b % kBoundsQueries), &summaries[b % kBoundsQueries], &apart[b]);
        walked[b] = answers[b] ? 1 : 0;
        walk_ns[b] = group_share + elapsed_ns(t0);
        // (a walk that leaves its rows to the sample is judged by the sample's answer, and charged its share)
        if (remembered && !answers[b] && !strata[b].empty()) handed[b] = kHanded;
        else if (remembered) memory.note(Attempt::estimate_walk, answers[b].has_value(), walk_ns[b], span.rows);
      } catch (...) {
        errors[b] = std::current_exception();
      }
    }
  }
  // 2. One sample for the rest, seeded by the first of them: its blocks are read once for all of them.
  std::vector<std::size_t> rest;
  for (std::size_t b = 0; b < n; ++b)
    if (!answers[b] && !errors[b] && handed[b] != kSkipped) rest.push_back(b);
  // The queries at the given positions side by side, with their factors.
  const auto gather = [&](const std::vector<std::size_t>& which, std::vector<float>& qs, std::vector<float>& fs) {
    qs.resize(which.size() * d);
    fs.resize(which.size());
    for (std::size_t i = 0; i < which.size(); ++i) {
      std::copy_n(q + which[i] * d, d, qs.begin() + static_cast<std::ptrdiff_t>(i * d));
      fs[i] = factors[which[i]];
    }
  };
  // (A walk that handed its rows on is judged by the sample, which then runs whatever its own memory says.)
  const bool judging = std::any_of(rest.begin(), rest.end(), [&](std::size_t b) { return handed[b] == kHanded; });
  if (!rest.empty() && (judging || !(remembered && memory.skip(Attempt::sample)))) {
    std::vector<float> rq, rf;
    gather(rest, rq, rf);
    std::vector<std::vector<std::size_t>> rest_strata(rest.size());
    for (std::size_t i = 0; i < rest.size(); ++i) rest_strata[i] = std::move(strata[rest[i]]);
    EstimateTarget sample{target, impl.value_max(), rows / 8, seed_of(rq.data(), d, rows), std::min(options.top_m, rows)};
    const EligibleTotals eligible = mask ? masked_totals(impl, *mask, options) : EligibleTotals{};  // (control variates)
    const MomentTotals totals = mask ? eligible.view() : impl.moment_totals();
    if (totals.rows > 0) sample.moments = &totals;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::optional<PrunedSoft>> sampled = estimated_soft_batch(kernels, rq.data(), rf.data(), rest.size(), span, sample,
                                                                          mask ? &*mask : nullptr, &rest_strata);
    sample_share = elapsed_ns(t0) / static_cast<double>(rest.size());
    for (std::size_t i = 0; i < rest.size(); ++i) {
      if (remembered) memory.note(Attempt::sample, sampled[i].has_value(), sample_share, span.rows);
      if (sampled[i]) sampled[i]->rows_scored += apart[rest[i]];  // (a row the walk scored and the sample drew again counts twice)
      answers[rest[i]] = std::move(sampled[i]);
    }
  }
  for (std::size_t b = 0; b < n; ++b)  // (a sample skipped or failed: the walk's rows were of no use)
    if (handed[b] == kHanded) memory.note(Attempt::estimate_walk, answers[b].has_value(), walk_ns[b] + sample_share, span.rows);
  // 3. One fused pass over every eligible row for the queries no estimate answered: their exact answers.
  std::vector<std::size_t> exact;
  for (std::size_t b = 0; b < n; ++b)
    if (!answers[b] && !errors[b]) exact.push_back(b);
  if (!exact.empty()) {
    std::vector<float> eq, ef;
    gather(exact, eq, ef);
    std::vector<std::exception_ptr> exact_errors;
    std::vector<SoftResult> scanned = soft_fused_locked(impl, eq.data(), ef.data(), exact.size(), options, {}, exact_errors);
    for (std::size_t i = 0; i < exact.size(); ++i) {
      if (exact_errors[i]) errors[exact[i]] = exact_errors[i];
      else out[exact[i]] = std::move(scanned[i]);
    }
  }
  // The estimated answers in the shape soft_one gives them.
  for (std::size_t b = 0; b < n; ++b) {
    if (!answers[b] || errors[b]) continue;
    try {
      PrunedSoft& p = *answers[b];
      const bool walked_here = walked[b] != 0 && p.k != rows;
      SoftResult& r = out[b] = soft_result(std::move(p));
      r.searched_with = walked_here ? IndexKind::ivf : IndexKind::exact;
      r.tail_bound_guaranteed = true;
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

}  // namespace softkv::detail
