// Estimated soft retrieval (estimate.hpp): Poisson sampling of blocks of rows and the Horvitz-Thompson
// ratio estimate of the blend, with its linearised variance.
//
// Every block b is drawn with probability pi. With W_b = sum over its rows of e^{s_j - M} and
// T_b = sum e^{s_j - M} v_j (what one soft_scan of the block leaves, shifted to a common M), Z = sum_b W_b
// is estimated by sum over the sample of W_b / pi, Y likewise, and the answer by v^ = Y^ / Z^. Its error
// is, to first order, (1 / Z) sum_sample (T_b - v^ W_b) / pi minus its expectation, whose variance under
// Poisson sampling is estimated without bias by sum_sample (1 - pi) ((T_b - v^ W_b) / pi)^2 / Z^2, per
// coordinate. The rows of a block are in storage order, which the data do not rank: a block is a small
// random sample of its own, and whatever correlation its rows have is in the block totals the variance uses.
#include "estimate.hpp"

#include "mask.hpp"
#include "thread_pool.hpp"
#include "top_scores.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace softkv::detail {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// A round grows the sample to (error / target)^2 times the blocks drawn, aimed at the target itself, and
// by at least a tenth. Measured (1M Gaussian rows, d = 128, T = 1, error_target 1e-2, 40 queries, Zen 5):
// the median query scored 1.73% of the rows, against 1.95% with a 5% margin and growth of at least 1.25
// (more rounds that just miss, each overshooting less); the time a query the same (~1.2 ms).
constexpr double kAimedGrowth = 1.0;
constexpr double kLeastGrowth = 1.1;

// Offers a block's scores to one TopScores over every sampled block (its rows' ids from the block's start).
struct BlockSink final : ScoreSink {
  TopScores* top = nullptr;
  const std::uint64_t* ids = nullptr;
  void offer(const float* scores, std::size_t first_row, std::size_t count) override { top->offer_ids(scores, ids + first_row, count); }
};

}  // namespace

double simultaneous_z(std::size_t dv) {
  // Two-sided tail 1 - kCheckConfidence shared by dv coordinates: solve erfc(z / sqrt 2) = alpha by bisection.
  const double alpha = (1 - kCheckConfidence) / static_cast<double>(std::max<std::size_t>(dv, 1));
  double lo = 0, hi = 40;
  for (int i = 0; i < 100; ++i) {
    const double mid = (lo + hi) / 2;
    (std::erfc(mid / std::sqrt(2.0)) > alpha ? lo : hi) = mid;
  }
  return hi;
}

std::vector<std::optional<PrunedSoft>> estimated_soft_batch(const KernelTable& kernels, const float* queries, const float* scales,
                                                            std::size_t n, const RowSpan& span, const EstimateTarget& target,
                                                            const EligibleRows* eligible,
                                                            const std::vector<std::vector<std::size_t>>* strata) {
  std::vector<std::optional<PrunedSoft>> out(n);
  // The rows the sample draws from, as runs in storage order (every row of span without a mask), and
  // where each run starts in the sequence of eligible rows: block b holds eligible rows [32 b, 32 b + 32).
  const EligibleRows all{{RowRun{0, span.rows}}, span.rows};
  const EligibleRows& rows_in = eligible != nullptr ? *eligible : all;
  std::vector<std::size_t> run_start(rows_in.runs.size() + 1, 0);
  for (std::size_t i = 0; i < rows_in.runs.size(); ++i) run_start[i + 1] = run_start[i] + rows_in.runs[i].count;
  const std::size_t total = run_start.back();
  const std::size_t dv = span.value_dim, d = span.dim, blocks = (total + kEstimateBlockRows - 1) / kEstimateBlockRows;
  if (blocks == 0 || n == 0) return out;
  const double z = simultaneous_z(dv);
  std::mt19937_64 rng(target.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // The sample so far, shared by the batch: every block drawn in any round. Each round draws every block
  // with its own probability, independently; a block is in the union of the rounds with probability
  // pi = 1 - prod (1 - pi_r), independently of the others: the union is a Poisson sample of its own, and
  // every query's estimate uses all of it (a round only scans the blocks it adds). A drawn block is read
  // from memory once and scanned by every query still estimating (it stays in cache between them).
  std::vector<std::uint8_t> taken(blocks, 0);
  std::size_t read = 0;  // rows read, shared by the queries (the budget's measure)
  double miss = 1;       // prod over the rounds of (1 - pi_r)
  // Each query's scan state per drawn block (max, sum, acc), its contributors and whether it still estimates.
  // With a stratum (rows scored exactly, left out of the blocks), its totals at its own shift.
  // The drawn blocks' totals are folded, as they come, into running sums at the shift ref (the largest
  // block score so far): sum W_b, sum W_b^2, and per coordinate sum T_b, sum T_b^2, sum T_b W_b, from which
  // each round's estimate and variance take O(dv) instead of a pass over every block drawn.
  struct Query {
    std::vector<float> maxes, sums, accs;
    std::vector<std::uint8_t> empty;  // per drawn block: every row of it in the stratum (nothing scanned)
    TopScores top;
    bool active = true;
    std::vector<std::size_t> stratum;  // ascending
    double stratum_max = -kInfinity, stratum_sum = 0;
    std::vector<double> stratum_acc;
    std::size_t folded = 0;  // the drawn blocks in the sums below
    double ref = -kInfinity, w = 0, w2 = 0;
    std::vector<double> t, t2, tw;
  };
  std::vector<Query> state;
  state.reserve(n);
  for (std::size_t j = 0; j < n; ++j) {
    state.push_back({{}, {}, {}, {}, TopScores(target.top_m, nullptr), true, {}, -kInfinity, 0, {}, 0, -kInfinity, 0, 0, {}, {}, {}});
    state.back().t.assign(dv, 0.0), state.back().t2.assign(dv, 0.0), state.back().tw.assign(dv, 0.0);
  }
  // Folds query s's blocks drawn since the last call into its running sums.
  const auto fold = [dv](Query& s) {
    for (std::size_t i = s.folded; i < s.maxes.size(); ++i) {
      if (s.sums[i] == 0) continue;  // (a block all in the stratum, or its weight underflowed: adds nothing)
      const double m = s.maxes[i];
      if (m > s.ref) {  // a new largest score: the sums so far move to it (their terms only shrink)
        const double f = s.ref == -kInfinity ? 0.0 : std::exp(s.ref - m), f2 = f * f;
        s.w *= f, s.w2 *= f2;
        for (std::size_t k = 0; k < dv; ++k) s.t[k] *= f, s.t2[k] *= f2, s.tw[k] *= f2;
        s.ref = m;
      }
      const double f = std::exp(m - s.ref), w = static_cast<double>(s.sums[i]) * f;
      s.w += w, s.w2 += w * w;
      const float* acc = s.accs.data() + i * dv;
      double* t = s.t.data();
      double* t2 = s.t2.data();
      double* tw = s.tw.data();
      for (std::size_t k = 0; k < dv; ++k) {
        const double a = static_cast<double>(acc[k]) * f;
        t[k] += a, t2[k] += a * a, tw[k] += a * w;
      }
    }
    s.folded = s.maxes.size();
  };
  for (std::size_t j = 0; strata != nullptr && j < n && j < strata->size(); ++j) {
    Query& s = state[j];
    s.stratum = (*strata)[j];
    if (s.stratum.empty()) continue;
    std::sort(s.stratum.begin(), s.stratum.end());
    s.stratum.erase(std::unique(s.stratum.begin(), s.stratum.end()), s.stratum.end());
    const PrunedSoft exact = soft_over_rows(kernels, queries + j * d, scales[j], span, s.stratum, target.top_m);
    const SoftmaxState& h = exact.scan.state;
    if (!std::isfinite(h.max) || !std::isfinite(h.sum) || !std::all_of(h.acc.begin(), h.acc.end(), [](float a) { return std::isfinite(a); })) {
      s.active = false;  // (the exact path reports what left the float range)
      continue;
    }
    s.stratum_max = h.max;
    s.stratum_sum = h.sum;
    s.stratum_acc.assign(h.acc.begin(), h.acc.end());
    for (const TopScores::Item& item : exact.scan.top) s.top.offer_ids(&item.score, &item.id, 1);
  }
  std::vector<double> y(dv);
  // Scans block b for query j into its slot (max, sum, acc at slot), folding the block's eligible rows,
  // piece by piece over the runs they fall in, into one state; sink (if any) gets their scores.
  // A query's stratum rows are left out (the pieces between them scanned).
  const auto scan_block = [&](std::size_t b, std::size_t j, std::size_t slot, BlockSink* sink) {
    Query& s = state[j];
    s.empty[slot] = 1;
    const auto scan_rows = [&](std::size_t first, std::size_t count) {
      if (count == 0) return;
      s.empty[slot] = 0;
      if (sink != nullptr) sink->ids = span.ids + first;
      kernels.soft_scan(queries + j * d, scales[j], span.sub(first, count), s.maxes[slot], s.sums[slot], s.accs.data() + slot * dv, sink);
    };
    std::size_t row = b * kEstimateBlockRows;
    const std::size_t end = std::min(row + kEstimateBlockRows, total);
    std::size_t run = static_cast<std::size_t>(std::upper_bound(run_start.begin(), run_start.end(), row) - run_start.begin()) - 1;
    while (row < end) {
      const std::size_t offset = row - run_start[run], count = std::min(end, run_start[run + 1]) - row;
      std::size_t first = rows_in.runs[run].begin + offset;
      const std::size_t stop = first + count;
      for (auto h = std::lower_bound(s.stratum.begin(), s.stratum.end(), first); h != s.stratum.end() && *h < stop; ++h) {
        scan_rows(first, *h - first);
        first = *h + 1;
      }
      scan_rows(first, stop - first);
      row += count;
      ++run;
    }
  };
  // Scans the blocks a round drew (ascending) for every query still estimating, on the shared pool's
  // threads: each part takes a run of them, each block's state goes to its own slot (the same answer
  // whatever the split), contributors to a part's own TopScores, merged after. A query whose block state
  // left the float range stops (the exact path reports it).
  ThreadPool& pool = ThreadPool::shared();
  const auto scan_fresh = [&](const std::vector<std::size_t>& fresh) {
    if (fresh.empty()) return;
    std::vector<std::size_t> base(n, 0);
    for (std::size_t j = 0; j < n; ++j) {
      Query& s = state[j];
      if (!s.active) continue;
      base[j] = s.maxes.size();
      s.maxes.resize(base[j] + fresh.size(), -std::numeric_limits<float>::infinity());
      s.empty.resize(base[j] + fresh.size(), 0);
      s.sums.resize(base[j] + fresh.size(), 0.0f);
      s.accs.resize((base[j] + fresh.size()) * dv, 0.0f);
    }
    for (const std::size_t b : fresh) {
      taken[b] = 1;
      read += std::min(kEstimateBlockRows, total - b * kEstimateBlockRows);
    }
    const std::size_t parts = std::clamp<std::size_t>(fresh.size() / 16, 1, pool.concurrency());
    std::vector<std::vector<TopScores>> tops(parts);
    pool.run(parts, [&](std::size_t part) {
      BlockSink sink;
      if (target.top_m > 0)
        for (std::size_t j = 0; j < n; ++j) tops[part].emplace_back(target.top_m, nullptr);
      for (std::size_t i = fresh.size() * part / parts; i < fresh.size() * (part + 1) / parts; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          if (!state[j].active) continue;
          sink.top = target.top_m > 0 ? &tops[part][j] : nullptr;
          scan_block(fresh[i], j, base[j] + i, target.top_m > 0 ? &sink : nullptr);
        }
    });
    for (std::size_t j = 0; j < n; ++j) {
      Query& s = state[j];
      if (!s.active) continue;
      if (target.top_m > 0)
        for (std::size_t part = 0; part < parts; ++part) s.top.absorb(tops[part][j]);
      for (std::size_t i = base[j]; i < s.maxes.size(); ++i)  // (a block all in the stratum weighs 0: max -inf, sum 0)
        if (s.empty[i] == 0 && (!std::isfinite(s.maxes[i]) || !std::isfinite(s.sums[i]))) s.active = false;
    }
  };
  // Rounds: the first draws 32 to 64 blocks; each later one as many as the neediest query's last error
  // says it needs ((error / target)^2 times the blocks drawn, at least 1.1 and at most 16 times the last
  // round's expected count), until every
  // query's target is met by a sample whose weight is spread over enough blocks for the normal approximation.
  double m = std::min(static_cast<double>(blocks), std::clamp(static_cast<double>(blocks) / 32, 32.0, 64.0));
  for (;;) {
    const double want = std::min(1.0, m / static_cast<double>(blocks));  // the union's probability after this round
    if (read + static_cast<std::size_t>(std::max(0.0, want - (1 - miss)) * static_cast<double>(total)) > target.budget_rows)
      return out;  // every query still estimating: the exact scan is cheaper
    const double pi_round = want >= 1 ? 1.0 : 1 - (1 - want) / miss;
    std::vector<std::size_t> fresh;  // the blocks this round adds, ascending
    if (pi_round >= 1) {
      for (std::size_t b = 0; b < blocks; ++b)
        if (taken[b] == 0) fresh.push_back(b);
    } else if (pi_round > 0) {  // each block with probability pi_round: geometric gaps between successive draws
      const double log_miss = std::log1p(-pi_round);
      for (double b = std::floor(std::log(1 - unit(rng)) / log_miss); b < static_cast<double>(blocks);
           b += 1 + std::floor(std::log(1 - unit(rng)) / log_miss))
        if (taken[static_cast<std::size_t>(b)] == 0) fresh.push_back(static_cast<std::size_t>(b));
    }
    scan_fresh(fresh);
    miss *= 1 - std::max(0.0, pi_round);
    double grow = 0;  // the neediest active query's
    for (std::size_t j = 0; j < n; ++j) {
      Query& s = state[j];
      if (!s.active) continue;
      const std::size_t drawn = s.maxes.size();
      const double pi = drawn == blocks ? 1.0 : 1 - miss;  // every block read: the exact answer, whatever the draws
      if (drawn == 0) {
        grow = std::max(grow, 2.0);
        continue;
      }
      fold(s);
      const double best = std::max(s.ref, s.stratum_max);
      // The totals shifted to the largest score: W_b = sum_b e^{m_b - best}, T_b = acc_b e^{m_b - best};
      // with a stratum (Z_S, Y_S, exact), Z^ = Z_S + zsum / pi and Y^ = Y_S + y / pi. All below are pi Z^
      // and pi Y^ (zall, yall), so that without a stratum they are the sample's sums.
      const double g = s.ref == -kInfinity ? 0.0 : std::exp(s.ref - best), g2 = g * g;
      const double zsum = s.w * g, w2 = s.w2 * g2;
      const double stratum_f = s.stratum.empty() ? 0.0 : std::exp(s.stratum_max - best);
      const double zall = zsum + pi * s.stratum_sum * stratum_f;
      for (std::size_t k = 0; k < dv; ++k) y[k] = s.t[k] * g + (s.stratum.empty() ? 0.0 : pi * s.stratum_acc[k] * stratum_f);
      // Var_k = (1 - pi) sum_b (T_bk - r_k W_b)^2 / (Z^ pi)^2 over the sampled blocks (the stratum has none),
      // r_k = v^_k, expanded as sum T^2 - 2 r sum T W + r^2 sum W^2. The expansion's rounding, at most about
      // (blocks + 4) 2^-52 (sqrt(sum T^2) + |r| sqrt(sum W^2))^2 (sum |T W| <= sqrt(sum T^2 sum W^2)), is
      // added to it: the variance is never understated by cancellation (values almost equal everywhere).
      const double rounding = static_cast<double>(drawn + 4) * 0x1p-52;
      double worst_var = 0;
      for (std::size_t k = 0; k < dv; ++k) {
        const double r = y[k] / zall, a2 = s.t2[k] * g2, aw = s.tw[k] * g2;
        const double spread_k = std::sqrt(a2) + std::fabs(r) * std::sqrt(w2);
        const double tk = std::max(0.0, a2 - 2 * r * aw + r * r * w2) + rounding * spread_k * spread_k;
        worst_var = std::max(worst_var, (1 - pi) * tk / (zall * zall));
      }
      const double error = target.value_max > 0 ? z * std::sqrt(worst_var) / target.value_max : 0.0;
      // The effective number of blocks, (sum W)^2 / sum W^2: when a few blocks hold most of the sampled
      // weight (peaked attention: a handful of rows outweigh the rest), the sample's variance says nothing
      // of the rows it missed, and a larger sample (or the scan) must answer.
      const bool spread = zsum > 0 && zsum * zsum >= kMinEffectiveBlocks * w2;  // (zsum 0: every drawn block in the stratum)
      if ((error <= target.error_target && spread) || pi >= 1) {
        PrunedSoft result{SoftScan{SoftmaxState(dv), {}}, {}, 0, 0.0};
        result.scan.state.max = static_cast<float>(best);
        result.scan.state.sum = static_cast<float>(zall / pi);
        result.value.resize(dv);
        for (std::size_t k = 0; k < dv; ++k) result.value[k] = static_cast<float>(y[k] / zall);
        std::size_t scored = s.stratum.size() + read;  // this query's rows: its stratum, and every block drawn while it estimated
        for (const std::size_t row : s.stratum) {  // (less the stratum's rows inside drawn blocks: left out of their scans)
          const auto at = std::upper_bound(rows_in.runs.begin(), rows_in.runs.end(), row, [](std::size_t r, const RowRun& run) { return r < run.begin; });
          if (at == rows_in.runs.begin()) continue;
          const std::size_t run = static_cast<std::size_t>(at - rows_in.runs.begin()) - 1;
          if (row >= rows_in.runs[run].begin + rows_in.runs[run].count) continue;
          if (taken[(run_start[run] + row - rows_in.runs[run].begin) / kEstimateBlockRows] != 0) --scored;
        }
        result.k = scored;
        result.rows_scored = scored;
        result.error_estimate = pi >= 1 ? 0.0 : error;
        result.scan.top = s.top.sorted();
        out[j] = std::move(result);
        s.active = false;
        continue;
      }
      // Weight that stays on a few blocks in a sample of 256 (8,192 rows) will not spread in a larger one soon
      // enough to pay (heavy-tailed or peaked attention without lists): the scan answers at once. Nor does a
      // sample whose effective size, grown in proportion to the blocks drawn, would need more blocks than
      // the budget allows (peaked attention: one or two blocks hold the weight): it gives up after one round.
      const double effective = w2 > 0 ? zsum * zsum / w2 : 0.0;
      const double needed = effective > 0 ? static_cast<double>(drawn) * kMinEffectiveBlocks / effective : kInfinity;
      if (!spread && (drawn >= kGiveUpBlocks || needed * static_cast<double>(kEstimateBlockRows) > static_cast<double>(target.budget_rows))) {
        s.active = false;
        continue;
      }
      // (Projected from the blocks drawn, not the expected count: a Poisson round may draw a fifth fewer.)
      grow = std::max(grow, spread ? std::clamp(static_cast<double>(drawn) * error * error / (target.error_target * target.error_target) *
                                                    kAimedGrowth / m, kLeastGrowth, 16.0)
                                   : std::clamp(needed / static_cast<double>(drawn) * 1.1, 1.5, 16.0));
    }
    if (grow == 0) return out;  // no query still estimating
    m = std::min(m * grow, static_cast<double>(blocks));
  }
}

std::optional<PrunedSoft> estimated_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                                         const EstimateTarget& target, const EligibleRows* eligible,
                                         const std::vector<std::size_t>* stratum) {
  if (stratum == nullptr) return std::move(estimated_soft_batch(kernels, query, &scale, 1, span, target, eligible).front());
  const std::vector<std::vector<std::size_t>> strata{*stratum};
  return std::move(estimated_soft_batch(kernels, query, &scale, 1, span, target, eligible, &strata).front());
}

}  // namespace softkv::detail
