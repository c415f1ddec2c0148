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
#include "top_scores.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace softkv::detail {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

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

std::optional<PrunedSoft> estimated_soft(const KernelTable& kernels, const float* query, float scale, const RowSpan& span,
                                         const EstimateTarget& target, const EligibleRows* eligible) {
  // The rows the sample draws from, as runs in storage order (every row of span without a mask), and
  // where each run starts in the sequence of eligible rows: block b holds eligible rows [32 b, 32 b + 32).
  const EligibleRows all{{RowRun{0, span.rows}}, span.rows};
  const EligibleRows& rows_in = eligible != nullptr ? *eligible : all;
  std::vector<std::size_t> run_start(rows_in.runs.size() + 1, 0);
  for (std::size_t i = 0; i < rows_in.runs.size(); ++i) run_start[i + 1] = run_start[i] + rows_in.runs[i].count;
  const std::size_t total = run_start.back();
  const std::size_t dv = span.value_dim, blocks = (total + kEstimateBlockRows - 1) / kEstimateBlockRows;
  if (blocks == 0) return std::nullopt;
  const double z = simultaneous_z(dv);
  std::mt19937_64 rng(target.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // The sample so far: every block drawn in any round, with its scan state (max, sum, acc). Each round
  // draws every block with its own probability, independently; a block is in the union of the rounds
  // with probability pi = 1 - prod (1 - pi_r), independently of the others: the union is a Poisson
  // sample of its own, and the estimate uses all of it (a round only scans the blocks it adds).
  std::vector<std::uint8_t> taken(blocks, 0);
  std::vector<float> maxes, sums, accs;
  std::vector<double> y(dv), t(dv), shift;  // shift[i] = e^{max_i - best}, block i's factor to the common shift
  std::size_t scored = 0;
  double miss = 1;  // prod over the rounds of (1 - pi_r)
  TopScores top(target.top_m, nullptr);
  BlockSink sink;
  sink.top = &top;
  // Rounds: the first draws about 64 blocks; each later one as many as the last round's error says are
  // needed (1.1 x (error / target)^2 times as many, at least 1.5 and at most 16 times), until the target is met by a sample whose weight
  // is spread over enough blocks for the normal approximation.
  // A first round of 64 blocks, fewer (down to 32, the spread rule's minimum) where 64 would be more
  // than 1/32 of the blocks: what a sample that gives up has cost stays a small share of the scan.
  double m = std::min(static_cast<double>(blocks), std::clamp(static_cast<double>(blocks) / 32, 32.0, 64.0));
  for (;;) {
    const double want = std::min(1.0, m / static_cast<double>(blocks));  // the union's probability after this round
    if (scored + static_cast<std::size_t>(std::max(0.0, want - (1 - miss)) * static_cast<double>(total)) > target.budget_rows)
      return std::nullopt;
    const double pi_round = want >= 1 ? 1.0 : 1 - (1 - want) / miss;
    const auto scan_block = [&](std::size_t b) {
      if (taken[b] != 0) return true;
      taken[b] = 1;
      maxes.push_back(-std::numeric_limits<float>::infinity());
      sums.push_back(0.0f);
      accs.resize(accs.size() + dv, 0.0f);
      // The block's eligible rows, piece by piece over the runs they fall in, folded into one state.
      std::size_t at = b * kEstimateBlockRows;
      const std::size_t end = std::min(at + kEstimateBlockRows, total);
      std::size_t run = static_cast<std::size_t>(std::upper_bound(run_start.begin(), run_start.end(), at) - run_start.begin()) - 1;
      while (at < end) {
        const std::size_t offset = at - run_start[run], count = std::min(end, run_start[run + 1]) - at;
        const std::size_t first = rows_in.runs[run].begin + offset;
        sink.ids = span.ids + first;
        kernels.soft_scan(query, scale, span.sub(first, count), maxes.back(), sums.back(), accs.data() + accs.size() - dv,
                          target.top_m > 0 ? &sink : nullptr);
        scored += count;
        at += count;
        ++run;
      }
      return std::isfinite(maxes.back()) && std::isfinite(sums.back());  // out of range: the exact path reports it
    };
    if (pi_round >= 1) {
      for (std::size_t b = 0; b < blocks; ++b)
        if (!scan_block(b)) return std::nullopt;
    } else if (pi_round > 0) {  // each block with probability pi_round: geometric gaps between successive draws
      const double log_miss = std::log1p(-pi_round);
      for (double b = std::floor(std::log(1 - unit(rng)) / log_miss); b < static_cast<double>(blocks);
           b += 1 + std::floor(std::log(1 - unit(rng)) / log_miss))
        if (!scan_block(static_cast<std::size_t>(b))) return std::nullopt;
    }
    miss *= 1 - std::max(0.0, pi_round);
    const std::size_t n = maxes.size();
    const double pi = n == blocks ? 1.0 : 1 - miss;  // every block read: the exact answer, whatever the draws
    if (n == 0) {
      m = std::min(m * 2, static_cast<double>(blocks));
      continue;
    }
    const float best = *std::max_element(maxes.begin(), maxes.end());
    // The totals shifted to the largest score: W_b = sum_b e^{m_b - best}, T_b = acc_b e^{m_b - best}.
    double zsum = 0;
    std::fill(y.begin(), y.end(), 0.0);
    shift.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const double f = shift[i] = std::exp(static_cast<double>(maxes[i]) - static_cast<double>(best));
      zsum += static_cast<double>(sums[i]) * f;
      for (std::size_t k = 0; k < dv; ++k) y[k] += static_cast<double>(accs[i * dv + k]) * f;
    }
    std::vector<float> value(dv);
    for (std::size_t k = 0; k < dv; ++k) value[k] = static_cast<float>(y[k] / zsum);
    // Var_k = (1 - pi) sum_b (T_bk - v^_k W_b)^2 / (Z^ pi)^2 with Z^ = zsum / pi: the pi cancel.
    std::fill(t.begin(), t.end(), 0.0);
    double w2 = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double f = shift[i];
      const double w = static_cast<double>(sums[i]) * f;
      w2 += w * w;
      for (std::size_t k = 0; k < dv; ++k) {
        const double u = static_cast<double>(accs[i * dv + k]) * f - y[k] / zsum * w;
        t[k] += u * u;
      }
    }
    double worst_var = 0;
    for (std::size_t k = 0; k < dv; ++k) worst_var = std::max(worst_var, (1 - pi) * t[k] / (zsum * zsum));
    const double error = target.value_max > 0 ? z * std::sqrt(worst_var) / target.value_max : 0.0;
    // The effective number of blocks, (sum W)^2 / sum W^2: when a few blocks hold most of the sampled
    // weight (peaked attention: a handful of rows outweigh the rest), the sample's variance says nothing
    // of the rows it missed, and a larger sample (or the scan) must answer.
    const bool spread = zsum * zsum >= kMinEffectiveBlocks * w2;
    if ((error <= target.error_target && spread) || pi >= 1) {
      PrunedSoft result{SoftScan{SoftmaxState(dv), {}}, {}, 0, 0.0};
      result.scan.state.max = best;
      result.scan.state.sum = static_cast<float>(zsum / pi);
      result.value = std::move(value);
      result.k = scored;
      result.rows_scored = scored;
      result.error_estimate = pi >= 1 ? 0.0 : error;
      result.scan.top = top.sorted();
      return result;
    }
    // Weight that stays on a few blocks in a sample of 256 (8,192 rows) will not spread in a larger one soon
    // enough to pay (heavy-tailed or peaked attention without lists): the scan answers at once. Nor does a
    // sample whose effective size, grown in proportion to the blocks drawn, would need more blocks than
    // the budget allows (peaked attention: one or two blocks hold the weight): it gives up after one round.
    if (!spread && n >= kGiveUpBlocks) return std::nullopt;
    const double effective = w2 > 0 ? zsum * zsum / w2 : 0.0;
    const double needed = effective > 0 ? static_cast<double>(n) * kMinEffectiveBlocks / effective : kInfinity;
    if (!spread && needed * static_cast<double>(kEstimateBlockRows) > static_cast<double>(target.budget_rows)) return std::nullopt;
    const double grow = spread ? std::clamp(error * error / (target.error_target * target.error_target) * 1.1, 1.5, 16.0)
                               : std::clamp(needed / static_cast<double>(n) * 1.1, 1.5, 16.0);
    m = std::min(m * grow, static_cast<double>(blocks));
  }
}

}  // namespace softkv::detail
