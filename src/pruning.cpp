// Pruned soft retrieval over an index's candidates or certified lists, with the tail bounds of docs/PRUNING.md.
#include "pruning.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <limits>

namespace softkv::detail {

std::uint64_t seed_of(const float* query, std::size_t d, std::size_t rows) {
  std::uint64_t h = 0x9E3779B97F4A7C15ull ^ rows;
  for (std::size_t i = 0; i < d; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, query + i, sizeof bits);
    h = (h ^ bits) * 0x100000001B3ull;
  }
  return h;
}


// The flat index ranks by the very scores used here, so no omitted score exceeds the k-th and the
// bound holds without the slack; it covers the float rounding of lse_k, and for the approximate
// indexes (whose bound is an estimate anyway) their own rounding of the ranking.
double with_rounding_slack(double score) {
  if (std::isinf(score)) return score;  // -inf: every omitted score is -inf too (weight 0), and inf - inf would be NaN
  return score + 1e-5 * std::max(1.0, std::fabs(score));
}

double tail_bound(std::size_t n, std::size_t k, double kth_score, double lse_k) {
  if (k >= n) return 0.0;
  const double log_rest = std::log(static_cast<double>(n - k)) + kth_score;  // log((n-k) e^{s_k})
  const double m = std::max(log_rest, lse_k);
  const double log_total = m + std::log(std::exp(log_rest - m) + std::exp(lse_k - m));
  return std::exp(log_rest - log_total);
}

namespace {

// log(e^a + e^b) without overflow.
double log_add(double a, double b) {
  if (a == -std::numeric_limits<double>::infinity()) return b;
  if (b == -std::numeric_limits<double>::infinity()) return a;
  const double m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

}  // namespace

double sampled_tail(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                    const std::vector<std::size_t>& sorted_candidates, double kth, double lse_k, std::size_t sample,
                    const PruneScope* scope) {
  const std::size_t eligible = scope != nullptr ? scope->n : span.rows;
  const std::size_t omitted = eligible - sorted_candidates.size();
  if (omitted == 0 || sample == 0) return 0.0;
  const bool every_row = omitted <= sample;  // then the check is exact
  std::vector<std::size_t> rows;
  if (scope != nullptr) {  // masked: the omitted rows are the eligible non-candidates, listed, then drawn from
    std::vector<std::size_t> pool;
    pool.reserve(omitted);
    for (std::size_t r = 0, c = 0; r < span.rows; ++r) {
      if (c < sorted_candidates.size() && sorted_candidates[c] == r) ++c;
      else if ((*scope->flags)[r] != 0) pool.push_back(r);
    }
    if (every_row) {
      rows = std::move(pool);
    } else {
      std::mt19937_64 rng(seed_of(query, span.dim, eligible));
      std::uniform_int_distribution<std::size_t> pick(0, pool.size() - 1);
      while (rows.size() < sample) rows.push_back(pool[pick(rng)]);
    }
  } else if (every_row) {
    for (std::size_t r = 0, c = 0; r < span.rows; ++r) {
      if (c < sorted_candidates.size() && sorted_candidates[c] == r) ++c;
      else rows.push_back(r);
    }
  } else {
    std::mt19937_64 rng(seed_of(query, span.dim, span.rows));
    std::uniform_int_distribution<std::size_t> pick(0, span.rows - 1);
    while (rows.size() < sample) {  // rejection: at least a quarter of the rows are omitted when epsilon drives k
      const std::size_t r = pick(rng);
      if (!std::binary_search(sorted_candidates.begin(), sorted_candidates.end(), r)) rows.push_back(r);
    }
  }
  std::vector<float> keys(rows.size() * span.dim), scores(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) key_row(span, rows[i], keys.data() + i * span.dim);
  const RowSpan sampled{keys.data(), nullptr, nullptr, rows.size(), span.dim, 0};
  kernels.scores(query, scale, sampled, scores.data());
  const double top = *std::max_element(scores.begin(), scores.end());
  const double c = std::max(kth, top);  // the assumed ceiling of the omitted scores: x = e^{s - c} in [0, 1]
  double mean = 0, sq = 0;
  for (float s : scores) {
    const double x = std::exp(static_cast<double>(s) - c);
    mean += x;
    sq += x * x;
  }
  const double n = static_cast<double>(rows.size());
  mean /= n;
  double upper = mean;  // the omitted rows' mean of e^{s - c}
  if (!every_row) {
    // Maurer & Pontil (2009), empirical Bernstein: mu <= mean + sqrt(2 V L / n) + 7 L / (3 (n - 1)).
    const double log_term = std::log(2.0 / (1.0 - kCheckConfidence));
    const double variance = n > 1 ? std::max(0.0, (sq - n * mean * mean) / (n - 1)) : 1.0;
    upper = std::min(1.0, mean + std::sqrt(2 * variance * log_term / n) + 7 * log_term / (3 * std::max(1.0, n - 1)));
  }
  if (!(upper > 0)) return 0.0;
  const double log_omitted = std::log(static_cast<double>(omitted)) + c + std::log(upper);
  return std::exp(log_omitted - log_add(log_omitted, lse_k));
}

PrunedSoft exact_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                      std::size_t top_m, std::size_t parts) {
  PrunedSoft result{soft_scan_split(kernels, query, scale, span, parts, top_m), {}, span.rows, 0.0};
  result.value = blended_value(kernels, query, scale, span, result.scan.state);
  return result;
}

PrunedSoft soft_over_rows(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                          const std::vector<std::size_t>& rows, std::size_t top_m, std::vector<float>* scores) {
  // Gather the candidates into one small contiguous span and run the same kernel as the exact path;
  // compact rows are widened exactly, so their scores are the bits the exact scan computes.
  const std::size_t d = span.dim, dv = span.value_dim;
  std::vector<float> keys(rows.size() * d), values(rows.size() * dv);
  std::vector<std::uint64_t> ids(rows.size());
  for (std::size_t i = 0; i < std::min(kGatherAhead, rows.size()); ++i) prefetch_row(span, rows[i], true, true);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (i + kGatherAhead < rows.size()) prefetch_row(span, rows[i + kGatherAhead], true, true);
    key_row(span, rows[i], keys.data() + i * d);
    value_row(span, rows[i], values.data() + i * dv);
    ids[i] = span.ids[rows[i]];
  }
  const RowSpan candidates{keys.data(), values.data(), ids.data(), rows.size(), d, dv};
  if (scores != nullptr) {
    scores->resize(rows.size());
    kernels.scores(query, scale, candidates, scores->data());
  }
  PrunedSoft result{soft_scan_split(kernels, query, scale, candidates, 1, top_m), {}, rows.size(), 0.0};
  result.value = blended_value(kernels, query, scale, candidates, result.scan.state);
  return result;
}

PrunedSoft pruned_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                       std::size_t k, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find,
                       std::size_t check_sample, const PruneScope* scope) {
  const std::size_t n = scope != nullptr ? scope->n : span.rows;
  auto exact = [&] { return scope != nullptr ? scope->exact() : exact_soft(kernels, query, scale, span, top_m, exact_parts); };
  if (k >= n) return exact();
  const std::vector<std::size_t> rows = find(k);
  if (rows.empty()) return exact();
  // The candidates' scores come from the kernel's one scoring routine, bit-identical to the exact
  // scan's and (flat) to the top-k pass that chose them: the k-th of them bounds every omitted score.
  std::vector<float> scores;
  PrunedSoft result = soft_over_rows(kernels, query, scale, span, rows, top_m, &scores);
  const double kth = *std::min_element(scores.begin(), scores.end());
  result.tail_bound = tail_bound(n, rows.size(), with_rounding_slack(kth), result.scan.state.lse());
  if (check_sample > 0) {
    std::vector<std::size_t> sorted = rows;
    std::sort(sorted.begin(), sorted.end());
    result.tail_bound = std::max(result.tail_bound, sampled_tail(kernels, query, scale, span, sorted, kth,
                                                                 result.scan.state.lse(), check_sample, scope));
  }
  return result;
}

std::size_t prune_budget(std::size_t rows, std::size_t row_bytes) {
  if (rows * row_bytes < kPlannerMinBytes) return std::numeric_limits<std::size_t>::max();
  return rows / kBudgetDivisor;
}

PrunedSoft adaptive_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                         double epsilon, std::size_t top_m, std::size_t exact_parts, const CandidateFinder& find,
                         std::size_t check_sample, const PruneScope* scope, const RoundCost& cost) {
  return adaptive_rounds<PrunedSoft>(
      scope != nullptr ? scope->n : span.rows, epsilon,
      [&](std::size_t k) { return pruned_soft(kernels, query, scale, span, k, top_m, exact_parts, find, check_sample, scope); },
      [&] { return scope != nullptr ? scope->exact() : exact_soft(kernels, query, scale, span, top_m, exact_parts); }, cost);
}

}  // namespace softkv::detail

namespace softkv::detail {

namespace {

// Running log sum of e^s over scores, in double.
struct LogSum {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;
  void add(double s) {
    if (s == -std::numeric_limits<double>::infinity()) return;
    if (s > max) {
      sum = sum * std::exp(max - s) + 1;
      max = s;
    } else {
      sum += std::exp(s - max);
    }
  }
  [[nodiscard]] double log() const { return sum > 0 ? max + std::log(sum) : -std::numeric_limits<double>::infinity(); }
};

// rest / (visited + rest) from their logs; 1 when nothing was visited.
double share_of_rest(double log_rest, double log_visited) {
  if (log_rest == -std::numeric_limits<double>::infinity()) return 0.0;
  if (log_visited == -std::numeric_limits<double>::infinity() || std::isinf(log_rest)) return 1.0;
  return std::exp(log_rest - log_add(log_rest, log_visited));
}


}  // namespace

std::optional<PrunedSoft> certified_soft(const KernelTable& kernels, const CertifiedLists& lists, const float* query, float scale,
                                         const RowSpan& span, const std::function<std::size_t(std::uint64_t)>& row_of,
                                         const ListTarget& target, std::size_t top_m, ListHead* head) {
  constexpr double kUnit = 1.0 / 16777216.0;
  ListWalk walk = target.bounds != nullptr ? ListWalk(target.bounds, target.live, lists.list_count(), target.summary)
                                           : ListWalk(lists, query, scale);
  std::vector<std::uint64_t> ids;
  std::vector<float> scores;
  std::vector<double> error;  // per visited row: |kernel score - true score| <= error[i] (its list's bound + u |s|)
  double worst_error = 0;
  TopScores best(target.top_k, nullptr);
  LogSum visited;  // of the visited rows' true scores, bounded below: the mass the bound divides by
  // A double sum of n terms is within (n + 2) 2^-52 of its value, relatively: its log moves by at most that.
  auto low_log = [](const LogSum& sum, std::size_t n) { return sum.log() - static_cast<double>(n + 2) * 0x1p-52; };
  auto high_log = [](const LogSum& sum, std::size_t n) { return sum.log() + static_cast<double>(n + 2) * 0x1p-52; };
  // A mask: once every eligible row is visited, the lists left hold none (their bounds count ineligible rows).
  auto all_eligible = [&] { return target.eligible != nullptr && ids.size() >= target.eligible_rows; };
  auto finished = [&] {
    if (ids.empty()) return false;
    if (all_eligible()) return true;
    if (target.top_k > 0) return best.full() && static_cast<double>(best.worst().score) > walk.next_bound();
    return share_of_rest(walk.log_rest(), low_log(visited, ids.size())) <= target.epsilon;
  };
  // Peaked attention finishes within a few lists; a walk that has not after an eighth of its budget asks
  // the bounds whether the rest of the budget can do it, and gives up at once if not (spread attention).
  bool judged = false;
  double known_max = -std::numeric_limits<double>::infinity();
  // With head: each visited list's mass, and whether the later half of them holds a quarter of it or more.
  std::vector<LogSum> list_mass;
  const auto spread = [&] {
    LogSum all, later;
    for (std::size_t i = 0; i < list_mass.size(); ++i) {
      const double m = list_mass[i].log();
      if (m == -std::numeric_limits<double>::infinity()) continue;
      all.add(m);
      if (2 * i >= list_mass.size()) later.add(m);
    }
    return later.log() >= all.log() + std::log(0.25);
  };
  std::size_t scored = 0;  // rows scored: the visited rows, and with a mask the ineligible ones among them
  // The mass the visited rows suggest for every row (log): theirs, and the rows not visited at the mean of
  // the visited ones less the largest (one row far above the rest says nothing of the others); never
  // above what the bounds allow (the visited lists, of largest bound, may outweigh the others row by row).
  const auto log_all_mass = [&] {
    const double seen = static_cast<double>(ids.size()), left = static_cast<double>(walk.rows_left());
    const double others = seen > 1 ? std::max(0.0, visited.sum - 1) / (seen - 1) : 0.0;  // (relative to e^max)
    return std::min(visited.max + std::log(visited.sum + others * left), log_add(visited.log(), walk.log_rest()));
  };
  // Whether one row of the lists not visited could hold more than epsilon of the mass. A block sample
  // would not see such a row (a query close to one stored key, over keys without clusters: its list
  // comes late in bound order), so the walk goes on to its budget before it hands its rows on; of the
  // rows past that point, only those that could matter (above epsilon / 16 of the mass) join the stratum.
  const auto spike_possible = [&] { return !ids.empty() && walk.next_bound() > log_all_mass() + std::log(target.epsilon); };
  std::size_t spike_walk = std::numeric_limits<std::size_t>::max();  // ids.size() when the walk went on for a spike
  // A head walk that ends short of epsilon: its rows, and the lists not visited unless the mass looked
  // spread (then the rows alone, for a block sample to leave out and add exactly).
  const auto leave_head = [&](bool spread_seen) -> std::optional<PrunedSoft> {
    head->rows.clear();
    head->apart = 0;
    // (Only a stratum may leave rows out: a head's lists must be whole.)
    const double keep_above = spread_seen && spike_walk < ids.size() ? log_all_mass() + std::log(target.epsilon / 16)
                                                                     : -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i < spike_walk || static_cast<double>(scores[i]) + error[i] >= keep_above) head->rows.push_back(row_of(ids[i]));
      else ++head->apart;
    }
    head->spread = spread_seen;
    if (!spread_seen) {
      std::vector<std::pair<double, std::uint32_t>> rest;
      walk.unvisited(rest);
      for (const auto& [ub, c] : rest) head->rest.push_back({ub, c, walk.live(c)});
    }
    return std::nullopt;
  };
  while (!walk.done() && !finished()) {
    if (scored > target.budget_rows) return head != nullptr ? leave_head(spread()) : std::nullopt;  // the exact scan is cheaper from here
    if (head != nullptr && list_mass.size() >= 8 && (list_mass.size() & (list_mass.size() - 1)) == 0 && spread()) {
      if (!spike_possible()) return leave_head(true);
      spike_walk = std::min(spike_walk, ids.size());
    }
    if (head == nullptr && !judged && scored > target.budget_rows / 8) {
      judged = true;
      if (!walk.can_meet(target.top_k, target.epsilon, target.budget_rows - scored, known_max, low_log(visited, ids.size())))
        return std::nullopt;
    }
    const std::size_t first = ids.size();
    const std::size_t c = walk.next();
    const double list_error = target.scorer != nullptr ? target.scorer->score_list(c, ids, scores) : lists.score_list(c, query, scale, ids, scores);
    scored += ids.size() - first;
    if (target.eligible != nullptr) {  // a mask: keep the list's eligible rows only
      std::size_t kept = first;
      for (std::size_t i = first; i < ids.size(); ++i)
        if ((*target.eligible)[row_of(ids[i])] != 0) ids[kept] = ids[i], scores[kept++] = scores[i];
      ids.resize(kept);
      scores.resize(kept);
    }
    best.offer_ids(scores.data() + first, ids.data() + first, ids.size() - first);
    if (head != nullptr) list_mass.emplace_back();
    for (std::size_t i = first; i < ids.size(); ++i) {
      const double s = scores[i];
      error.push_back(list_error + kUnit * std::fabs(s));
      worst_error = std::max(worst_error, error.back());
      visited.add(s - error.back());
      known_max = std::max(known_max, s);
      if (head != nullptr) list_mass.back().add(s);
    }
  }
  if (ids.empty()) return std::nullopt;
  if (target.top_k == 0) {  // epsilon: every visited row is a candidate; the bound is the one the stop tested
    const double tail = all_eligible() ? 0.0 : share_of_rest(walk.log_rest(), low_log(visited, ids.size()));
    std::vector<std::size_t> rows(ids.size());
    std::transform(ids.begin(), ids.end(), rows.begin(), row_of);
    PrunedSoft result = soft_over_rows(kernels, query, scale, span, rows, top_m);
    result.tail_bound = tail;
    result.rows_scored = scored;
    return result;
  }
  std::vector<std::uint64_t> chosen;
  for (const TopScores::Item& item : best.sorted()) chosen.push_back(item.id);
  std::vector<std::size_t> rows(chosen.size());
  std::transform(chosen.begin(), chosen.end(), rows.begin(), row_of);
  std::vector<float> chosen_scores;
  PrunedSoft result = soft_over_rows(kernels, query, scale, span, rows, top_m, &chosen_scores);
  // The omitted mass: the unvisited lists' bound, plus the visited non-candidates at their scores
  // raised by their error; the kept mass: the candidates at their scores lowered by theirs.
  std::sort(chosen.begin(), chosen.end());
  LogSum kept, others;
  std::size_t n_kept = 0, n_others = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (std::binary_search(chosen.begin(), chosen.end(), ids[i])) kept.add(scores[i] - error[i]), ++n_kept;
    else others.add(scores[i] + error[i]), ++n_others;
  }
  const double log_kept = low_log(kept, n_kept);
  const double log_omitted = log_add(all_eligible() ? -std::numeric_limits<double>::infinity() : walk.log_rest(),
                                     n_others > 0 ? high_log(others, n_others) : -std::numeric_limits<double>::infinity());
  // And never above the classic bound from the k-th score: the top-k is exact in kernel scores, so every
  // omitted row's true score is at most the k-th kernel score plus the largest error visited (an
  // unvisited row's is below the next bound, itself below the k-th).
  const double kth = *std::min_element(chosen_scores.begin(), chosen_scores.end());
  const double kth_high = std::isinf(kth) ? kth : kth + worst_error + kUnit * std::fabs(kth);
  const std::size_t n = target.eligible != nullptr ? target.eligible_rows : span.rows;
  result.tail_bound = std::min(share_of_rest(log_omitted, log_kept), tail_bound(n, rows.size(), kth_high, log_kept));
  result.rows_scored = scored;
  return result;
}

}  // namespace softkv::detail
