// Estimated answers over certified lists (estimate.hpp, estimate_over_lists; docs/PRUNING.md, "Estimated
// answers"): the head a walk visited is scored exactly, and every other list is drawn whole with a
// probability proportional to its bounded mass (probability proportional to size, with the size an upper
// bound): a list that may weigh much is read for sure, one that cannot matter almost never.
//
// With Z_H, Y_H the head's totals and W_c = sum over list c of e^{s_j - M}, T_c = sum e^{s_j - M} v_j, the
// rest is estimated by Horvitz-Thompson over the drawn lists: Z^ = Z_H + sum W_c / pi_c, Y^ likewise,
// v^ = Y^ / Z^. Its error, to first order, is (1 / Z) sum_c (I_c / pi_c - 1) (T_c - v W_c), a sum of
// independent terms of mean 0 and variance estimated by sum_drawn (1 - pi_c) ((T_c - v^ W_c) / pi_c)^2 / Z^2
// per coordinate. Each term is bounded whatever the rows of an undrawn list score: they score below its
// bound ub_c, so |T_ck - v_k W_c| <= 2 max|v| B_c with B_c = live_c e^{ub_c - M}, and the term is at most
// 2 max|v| B_c / (pi_c Z). The error reported adds to z x the standard error Bernstein's range term for
// that bound, (7/3) ln(2 dv / (1 - confidence)) x 2 max_c (B_c / pi_c) / Z^ (relative to max|v|; 7/3 for an
// estimated variance, as in Maurer and Pontil's empirical Bernstein bound). Drawing with pi_c proportional
// to B_c makes B_c / pi_c the same for every list not drawn for sure: the range term then falls as 1 / m
// with m the lists expected in the sample, and a walk that bounded the rest to a share tau of the mass
// needs about (7/3) ln(...) x 2 tau / target lists. Lists bounded kTailNats below the largest score are
// the tail: never drawn, their bounded mass (at most e^-40 a row) added to the error whole.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "estimate.hpp"
#include "index/certified_lists.hpp"
#include "scan.hpp"  // value_row
#include "top_scores.hpp"

namespace softkv::detail {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// A drawn list's totals at its own shift (its largest score) and its probability of being drawn.
struct DrawnList {
  double max = -kInfinity, sum = 0, pi = 1;
  std::vector<double> acc;
};

// Lists whose bound is this many nats below the largest score or bound are the tail: left out of the
// sample and their bounded mass added to the error whole (at most live e^-40 each, relative to it).
constexpr double kTailNats = 40;

// Inclusion probabilities proportional to size: pi_c = min(1, lambda B_c) with sum pi_c = m (every list
// once m reaches their count). lambda by capping: the lists that lambda B would take past 1 are taken for
// sure and the rest of m spread over the others, until none is added (a few passes: few lists are heavy).
void proportional_to_size(const std::vector<double>& bound, double m, std::vector<double>& pi) {
  const std::size_t n = bound.size();
  pi.assign(n, 1.0);
  if (m >= static_cast<double>(n)) return;
  std::vector<std::uint8_t> sure(n, 0);
  double taken = 0;
  for (;;) {
    // The mass of the lists not taken for sure, summed afresh each pass (subtracting the heavy ones
    // from the total would cancel to nothing when they dominate: bounds span 40 nats).
    double free_mass = 0;
    for (std::size_t c = 0; c < n; ++c)
      if (sure[c] == 0) free_mass += bound[c];
    const double lambda = free_mass > 0 ? (m - taken) / free_mass : 0.0;
    bool more = false;
    for (std::size_t c = 0; c < n; ++c)
      if (sure[c] == 0 && lambda * bound[c] >= 1) sure[c] = 1, taken += 1, more = true;
    if (!more || taken >= m) {
      for (std::size_t c = 0; c < n; ++c) pi[c] = sure[c] != 0 ? 1.0 : std::min(1.0, lambda * bound[c]);
      return;
    }
  }
}

// A uniform number in [0, 1) from a 64-bit state (splitmix64): one per list and round, cheaply.
double next_unit(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

}  // namespace

std::optional<PrunedSoft> estimate_over_lists(const KernelTable& kernels, const CertifiedLists& lists, const float* query, float scale,
                                              const RowSpan& span, const std::function<std::size_t(std::uint64_t)>& row_of,
                                              const ListHead& head, const EstimateTarget& target) {
  const std::size_t dv = span.value_dim;
  PrunedSoft answer = soft_over_rows(kernels, query, scale, span, head.rows, target.top_m);
  const SoftmaxState& h = answer.scan.state;
  if (!std::isfinite(h.max) || !std::isfinite(h.sum) || !std::all_of(h.acc.begin(), h.acc.end(), [](float a) { return std::isfinite(a); }))
    return std::nullopt;  // the exact scan reports what left the float range
  answer.rows_scored = head.rows.size();
  if (head.rest.empty()) {  // the head is every row: the exact answer
    answer.error_estimate = 0.0;
    return answer;
  }
  // The rest's bounded masses B_c = live_c e^{ub_c - shift}, shift at least every bound and the head's largest score.
  double shift = h.max;
  for (const ListHead::Rest& r : head.rest) {
    if (!std::isfinite(r.ub)) return std::nullopt;  // no bound on that list's rows: nothing to size the sample by
    shift = std::max(shift, r.ub);
  }
  // The tail: lists bounded kTailNats below the shift, left out (rest_of lists the others in head.rest).
  std::vector<std::size_t> rest_of;
  std::vector<double> bound;
  double tail_rows = 0;
  for (std::size_t i = 0; i < head.rest.size(); ++i) {
    if (head.rest[i].ub < shift - kTailNats) {
      tail_rows += head.rest[i].live;
      continue;
    }
    rest_of.push_back(i);
    bound.push_back(head.rest[i].live * std::exp(head.rest[i].ub - shift));
  }
  const std::size_t lists_left = rest_of.size();

  // Bernstein's form: sqrt(2 L) x the standard error plus (7/3) L x the range, L = ln(2 dv / (1 - confidence))
  // (sqrt(2 L) is a little above the normal quantile simultaneous_z gives the block sample).
  const double log_term = std::log(2.0 * static_cast<double>(std::max<std::size_t>(dv, 1)) / (1 - kCheckConfidence));
  const double z = std::max(simultaneous_z(dv), std::sqrt(2 * log_term));
  const double range_factor = 7.0 / 3.0 * log_term * 2;
  std::uint64_t rng = target.seed;
  TopScores top(target.top_m, nullptr);
  for (const TopScores::Item& item : answer.scan.top) top.offer_ids(&item.score, &item.id, 1);
  std::vector<double> pi(lists_left, 0.0), want;  // each list's probability of being in the sample so far, and the next round's
  std::vector<std::size_t> drawn_at(lists_left, lists_left);  // its place in drawn, lists_left: not drawn
  std::vector<DrawnList> drawn;
  std::size_t read = head.rows.size();
  std::vector<std::uint64_t> ids;
  std::vector<std::size_t> rows;
  std::vector<float> scores, value(dv);
  std::vector<double> y(dv), t(dv), vhat(dv);
  // Rounds: 32 lists expected in the first, then as many more as the error says it needs; none once the
  // projection says the budget cannot hold them.
  double m = std::min(static_cast<double>(lists_left), 32.0);
  for (;;) {
    proportional_to_size(bound, m, want);
    // The rows this round reads, expected: an undrawn list joins with probability (want - pi) / (1 - pi).
    double new_rows = 0;
    for (std::size_t i = 0; i < lists_left; ++i)
      if (drawn_at[i] == lists_left && want[i] > pi[i]) new_rows += (want[i] - pi[i]) / (1 - pi[i]) * head.rest[rest_of[i]].live;
    if (static_cast<double>(read) + new_rows > static_cast<double>(target.budget_rows)) return std::nullopt;  // the scan is cheaper
    // Each list joins the sample with the probability that brings its union over the rounds to want.
    for (std::size_t i = 0; i < lists_left; ++i) {
      if (drawn_at[i] == lists_left && want[i] > pi[i] && (want[i] >= 1 || next_unit(rng) * (1 - pi[i]) < want[i] - pi[i])) {
        ids.clear();
        scores.clear();
        const std::size_t c = head.rest[rest_of[i]].list;
        if (target.scorer != nullptr) target.scorer->score_list(c, ids, scores);
        else lists.score_list(c, query, scale, ids, scores);
        DrawnList d;
        d.acc.assign(dv, 0.0);
        for (const float s : scores) d.max = std::max(d.max, static_cast<double>(s));
        // The members' rows first, their values asked for at once (a list's rows lie anywhere in storage).
        rows.resize(ids.size());
        for (std::size_t j = 0; j < ids.size(); ++j) {
          rows[j] = row_of(ids[j]);
          prefetch_row(span, rows[j], false, true);
        }
        for (std::size_t j = 0; j < ids.size(); ++j) {
          const double w = std::exp(static_cast<double>(scores[j]) - d.max);
          d.sum += w;
          value_row(span, rows[j], value.data());
          for (std::size_t k = 0; k < dv; ++k) d.acc[k] += w * static_cast<double>(value[k]);
        }
        if (!ids.empty() && (!std::isfinite(d.max) || !std::isfinite(d.sum))) return std::nullopt;
        top.offer_ids(scores.data(), ids.data(), ids.size());
        read += ids.size();
        drawn_at[i] = drawn.size();
        drawn.push_back(std::move(d));
      }
      pi[i] = std::max(pi[i], want[i]);
    }
    for (std::size_t i = 0; i < lists_left; ++i)
      if (drawn_at[i] != lists_left) drawn[drawn_at[i]].pi = pi[i];
    // The estimate at the largest score seen.
    double best = h.max;
    for (const DrawnList& d : drawn)
      if (d.sum > 0) best = std::max(best, d.max);
    const double head_factor = std::exp(static_cast<double>(h.max) - best);
    double zhat = static_cast<double>(h.sum) * head_factor;
    for (std::size_t k = 0; k < dv; ++k) y[k] = static_cast<double>(h.acc[k]) * head_factor;
    for (const DrawnList& d : drawn) {
      if (d.sum == 0) continue;
      const double f = std::exp(d.max - best) / d.pi;
      zhat += d.sum * f;
      for (std::size_t k = 0; k < dv; ++k) y[k] += d.acc[k] * f;
    }
    for (std::size_t k = 0; k < dv; ++k) vhat[k] = y[k] / zhat;
    std::fill(t.begin(), t.end(), 0.0);
    for (const DrawnList& d : drawn) {
      if (d.sum == 0 || d.pi >= 1) continue;
      const double f = std::exp(d.max - best);
      for (std::size_t k = 0; k < dv; ++k) {
        const double u = (d.acc[k] - vhat[k] * d.sum) * f / d.pi;
        t[k] += (1 - d.pi) * u * u;
      }
    }
    double worst_var = 0;
    for (std::size_t k = 0; k < dv; ++k) worst_var = std::max(worst_var, t[k] / (zhat * zhat));
    // The range term: the largest B_c / pi_c over the lists not drawn for sure (B_c at the shift best).
    double worst_ratio = 0;
    bool everything = true;
    for (std::size_t i = 0; i < lists_left; ++i) {
      if (pi[i] >= 1) continue;
      everything = false;
      worst_ratio = std::max(worst_ratio, pi[i] > 0 ? bound[i] / pi[i] : kInfinity);
    }
    const double normal = target.value_max > 0 ? z * std::sqrt(worst_var) / target.value_max : 0.0;
    const double range = everything || target.value_max == 0 ? 0.0 : range_factor * worst_ratio * std::exp(shift - best) / zhat;
    // The tail, dropped: its mass moves the blend by at most 2 max|v| times its share.
    const double dropped = target.value_max == 0 ? 0.0 : 2 * tail_rows * std::exp(shift - kTailNats - best) / zhat;
    const double error = normal + range + dropped;
    if (everything && error > target.error_target) return std::nullopt;  // (a tail past the target: never at e^-40 a row)
    if (error <= target.error_target || everything) {
      answer.scan.state.max = static_cast<float>(best);
      answer.scan.state.sum = static_cast<float>(zhat);
      for (std::size_t k = 0; k < dv; ++k) answer.scan.state.acc[k] = static_cast<float>(y[k]);
      answer.value.assign(dv, 0.0f);
      for (std::size_t k = 0; k < dv; ++k) answer.value[k] = static_cast<float>(vhat[k]);
      answer.scan.top = top.sorted();
      answer.k = read;
      answer.rows_scored = read;
      // What was dropped for sure (the tail), over a sure lower bound of the total (the head and the lists drawn).
      double z_low = static_cast<double>(h.sum) * head_factor;
      for (const DrawnList& dl : drawn) z_low += dl.sum * std::exp(dl.max - best);
      const double tail_mass = tail_rows * std::exp(shift - kTailNats - best);
      answer.tail_bound = tail_rows == 0 ? 0.0 : std::min(1.0, tail_mass / (z_low + tail_mass));
      answer.error_estimate = everything && tail_rows == 0 ? 0.0 : error;
      return answer;
    }
    // The error with r times the lists expected: normal / sqrt(r) + range / r, to first order; r from
    // a x + b x^2 = 1 with x = 1 / sqrt(r), grown by a tenth, at least 1.5 and at most 16 times.
    const double a = normal / target.error_target, b = range / target.error_target;
    if (!std::isfinite(b)) return std::nullopt;
    const double x = 2 / (a + std::sqrt(a * a + 4 * b));  // (the root without the cancellation of -a + sqrt(...))
    // Give up at once when the lists the projection asks for would pass the budget: the scan answers
    // after one round instead of after the budget's worth of rounds.
    const double projected = std::min(static_cast<double>(lists_left), m * 1.1 / (x * x));
    proportional_to_size(bound, projected, want);
    double projected_rows = static_cast<double>(head.rows.size());
    for (std::size_t i = 0; i < lists_left; ++i) projected_rows += want[i] * head.rest[rest_of[i]].live;
    if (projected_rows > static_cast<double>(target.budget_rows)) return std::nullopt;
    m = std::min(static_cast<double>(lists_left), m * std::clamp(1.1 / (x * x), 1.5, 16.0));
  }
}

}  // namespace softkv::detail
