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
//
// Control variates (with the collection's totals, value_moments.hpp, and no mask): each drawn block also
// gives U_b = sum v_j and S_b = sum s_j v_j over its rows, whose totals over every row are known (sum v and
// q^T (sum k v^T) scale, less the stratum's). Centred by their known means per row (u_b = U_b - n_b U / N,
// likewise s_b), they have known total 0 and move with the block's residual e_b = T_b - v^ W_b: to first
// order e^s is linear in s. Per coordinate, the residuals are regressed on (u_b, s_b) over the sample and
// the answer is the regression estimate v^ - beta . (sum u_b, sum s_b) / Z^, whose variance is that of the
// regression's residuals: on spread attention (s ~ N(0, 1)) about a third of the plain estimate's, so the
// sample needs about a third of the rows. What the known totals may be off by (the totals' rounding, the
// kernel's float scores against exact ones, the blocks' float sums) is bounded and added to the error,
// times |beta| / Z^.
#include "estimate.hpp"

#include "mask.hpp"
#include "scan.hpp"
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

// Rounds a block's float sums U_b, S_b of at most kEstimateBlockRows rows (a multiply and an add a row,
// each rounding once) by at most this share of their terms' magnitudes.
constexpr double kBlockSumGamma = (2 * kEstimateBlockRows + 2) * 0x1p-24 * 1.01;

// A round grows the sample to (error / target)^2 times the blocks drawn, aimed at the target itself, and
// by at least a tenth. Measured (1M Gaussian rows, d = 128, T = 1, error_target 1e-2, 40 queries, Zen 5):
// the median query scored 1.73% of the rows, against 1.95% with a 5% margin and growth of at least 1.25
// (more rounds that just miss, each overshooting less); the time a query the same (~1.2 ms).
constexpr double kAimedGrowth = 1.0;
constexpr double kLeastGrowth = 1.1;

// The storage-order check (below) looks at samples of at least this many blocks with rows, and sends to
// the scan those whose scores vary between blocks more than kMaxOrderRatio times what they vary within
// them (one-way F ratio; about 1 +- 0.3 for 32 to 64 blocks drawn from rows in random order) when the
// blocks' own spread, the standard deviation of their mean scores less what the rows within explain, is
// also above kOrderNats (blocks whose weights differ by less than e^0.25 cannot hide the mass).
constexpr std::size_t kOrderCheckBlocks = 16;
constexpr double kMaxOrderRatio = 4.0;
constexpr double kOrderNats = 0.25;
// The leverage check's largest h_b: a block that alone decides its fit (h_b -> 1) counts 400 times its
// squared residual, not infinitely many.
constexpr double kMaxLeverage = 0.95;

// What one coordinate's error adds to its sum of squared residuals (spread: the rounding term's scale;
// offset; unseen), and the error as estimated. (Its model, the ratio and regression coefficients, is in
// Models.)
struct ErrorTerms {
  double spread = 0, offset = 0, unseen = 0, error = 0;
};

// Each coordinate's model: the ratio r, the regression's coefficients on (u_b, s_b) and the inverse of
// their Gram matrix (zeros for the plain ratio), by coordinate (the layout KernelTable::fold_leverage reads).
struct Models {
  explicit Models(std::size_t dv) : r(dv), beta1(dv), beta2(dv), i11(dv), i12(dv), i22(dv) {}
  void set(std::size_t k, double r_k, double b1, double b2, double g11, double g12, double g22) {
    r[k] = r_k, beta1[k] = b1, beta2[k] = b2, i11[k] = g11, i12[k] = g12, i22[k] = g22;
  }
  std::vector<double> r, beta1, beta2, i11, i12, i22;
};

// Offers a block's scores to one TopScores over every sampled block (its rows' ids from the block's
// start), and with control variates adds the rows to the block's sums U_b = sum v_j, S_b = sum s_j v_j,
// sum |v_j| and sum (v_j - centre)^2 (aux, float, the rows in order) and their squared weights sum e^{2 s_j}
// (at the shift square_shift: the block's largest score so far); with or without, counts the rows and sums
// their scores and squared scores (the storage-order check).
struct BlockSink final : ScoreSink {
  TopScores* top = nullptr;
  const std::uint64_t* ids = nullptr;
  const KernelTable* kernels = nullptr;  // with control variates: whose blend sums the values
  RowSpan rows;                          // the scanned piece (its values)
  float* aux = nullptr;                  // 4 dv floats: U_b, S_b, sum |v_j| and sum (v_j - centre)^2
  const float* centre = nullptr;         // dv
  std::uint32_t* count = nullptr;
  double* score_sum = nullptr;           // the rows' scores summed
  double* score_square = nullptr;        // and their squares
  double* squares = nullptr;             // sum e^{2 (s_j - *square_shift)}
  double* square_shift = nullptr;
  void offer(const float* scores, std::size_t first_row, std::size_t n) override {
    if (top != nullptr) top->offer_ids(scores, ids + first_row, n);
    *count += static_cast<std::uint32_t>(n);
    for (std::size_t r = 0; r < n; ++r) {
      const double x = scores[r];
      *score_sum += x, *score_square += x * x;
    }
    if (aux == nullptr || n == 0) return;
    const std::size_t dv = rows.value_dim;
    const float m = *std::max_element(scores, scores + n);
    const double piece = kernels->value_sums(scores, rows.sub(first_row, n), {aux, aux + dv, aux + 2 * dv, centre, aux + 3 * dv, m});
    if (m > *square_shift) *squares *= std::exp(2 * (*square_shift - static_cast<double>(m))), *square_shift = m;
    *squares += piece * std::exp(2 * (static_cast<double>(m) - *square_shift));
  }
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
    TopScores top{0, nullptr};
    bool active = true;
    std::vector<std::size_t> stratum;  // ascending
    double stratum_max = -kInfinity, stratum_sum = 0;
    std::vector<double> stratum_acc;
    std::size_t folded = 0;  // the drawn blocks in the sums below
    double ref = -kInfinity, w = 0, w2 = 0;
    std::vector<double> t, t2, tw;
    // Control variates (cv): per drawn block U_b, S_b (aux, with sum |v|, sum (v - centre)^2) and its rows scanned; the known
    // means per row (ubar, sbar: the frame's totals over its rows), what the sums may be off by (below),
    // and running sums of the centred u_b, s_b: sum u, sum s, sum u^2, sum u s, sum s^2, and
    // with the weights at ref, sum u T, sum u W, sum s T, sum s W (per coordinate).
    bool cv = false, cv_s = false;
    std::vector<float> aux;  // per drawn block: U_b, S_b, sum |v_j| and sum (v_j - centre)^2 (4 dv floats)
    std::vector<std::uint32_t> counts;  // per drawn block: its rows scanned
    std::vector<double> score_sums, score_squares;  // per drawn block: its rows' scores summed, and their squares
    // The storage-order check over the drawn blocks (every query): sum of scores, of squared scores, and of
    // each block's (sum of scores)^2 / rows.
    double order_sum = 0, order_square = 0, order_between = 0;
    std::vector<double> squares, square_shifts;  // per drawn block: sum e^{2 (s_j - shift)} and its shift
    double stratum_scores = 0;       // the stratum's
    std::vector<double> ubar, sbar;
    // What the sums may be off by: a row's score within ds of the exact one, |s_j| <= smax; the known
    // totals' own rounding (known_u, known_s, taken in the share the sample holds).
    double ds = 0, smax = 0, known_u = 0, known_s = 0;
    std::size_t frame = 0, rows_drawn = 0, nonempty = 0;  // the frame's rows; the drawn blocks' rows and blocks with any
    std::vector<double> su, ss, suu, sus, sss, sut, suw, sst, ssw, sa;  // sa: sum |v_j| over the drawn rows
    // The unseen spread (see unseen below): centre = ubar in float; seen_sq: sum over the drawn rows of
    // (v - centre)^2; known_sq: the frame's sum (v - ubar)^2 raised by its rounding bound (until then the
    // stratum's sum v^2); ww: sum over the drawn rows of e^{2 (s_j - ref)}; squares_fit: whether a block's
    // float sum of squares stays in the float range (values up to ~1e18).
    bool squares_fit = false;
    std::vector<float> centre;
    std::vector<double> seen_sq, known_sq;
    double ww = 0;
  };
  // (The totals of the rows the sample draws from: every row of span, or with a mask its eligible rows.)
  const MomentTotals* moments = target.moments != nullptr && target.moments->rows == total ? target.moments : nullptr;
  std::vector<Query> state(n);
  for (std::size_t j = 0; j < n; ++j) {
    Query& s = state[j];
    s.top = TopScores(target.top_m, nullptr);
    s.t.assign(dv, 0.0), s.t2.assign(dv, 0.0), s.tw.assign(dv, 0.0);
    if (moments == nullptr) continue;
    s.cv = true;
    s.cv_s = moments->key_value != nullptr;
    for (auto* v : {&s.su, &s.ss, &s.suu, &s.sus, &s.sss, &s.sut, &s.suw, &s.sst, &s.ssw, &s.sa, &s.seen_sq, &s.known_sq}) v->assign(dv, 0.0);
  }
  // Folds query s's blocks drawn since the last call into its running sums.
  const auto fold = [dv, &kernels](Query& s) {
    for (std::size_t i = s.folded; i < s.maxes.size(); ++i) {
      const bool weighs = s.sums[i] != 0;  // (not: a block all in the stratum, or its weight underflowed)
      const double m = s.maxes[i];
      if (weighs && m > s.ref) {  // a new largest score: the sums so far move to it (their terms only shrink)
        const double f = s.ref == -kInfinity ? 0.0 : std::exp(s.ref - m), f2 = f * f;
        s.w *= f, s.w2 *= f2;
        for (std::size_t k = 0; k < dv; ++k) s.t[k] *= f, s.t2[k] *= f2, s.tw[k] *= f2;
        if (s.cv) {
          for (std::size_t k = 0; k < dv; ++k) s.sut[k] *= f, s.suw[k] *= f, s.sst[k] *= f, s.ssw[k] *= f;
          s.ww *= f2;
        }
        s.ref = m;
      }
      const double f = weighs ? std::exp(m - s.ref) : 0.0, w = static_cast<double>(s.sums[i]) * f;
      const float* acc = s.accs.data() + i * dv;
      if (weighs) {
        s.w += w, s.w2 += w * w;
        double* t = s.t.data();
        double* t2 = s.t2.data();
        double* tw = s.tw.data();
        for (std::size_t k = 0; k < dv; ++k) {
          const double a = static_cast<double>(acc[k]) * f;
          t[k] += a, t2[k] += a * a, tw[k] += a * w;
        }
      }
      // (every drawn block counts here, weighing or not: the centred sums' known total is over all of them)
      s.rows_drawn += s.counts[i];
      s.nonempty += s.counts[i] > 0 ? 1 : 0;
      s.order_sum += s.score_sums[i], s.order_square += s.score_squares[i];
      if (s.counts[i] > 0) s.order_between += s.score_sums[i] * s.score_sums[i] / static_cast<double>(s.counts[i]);
      if (!s.cv) continue;
      const float* u = s.aux.data() + i * 4 * dv;
      for (std::size_t k = 0; k < dv; ++k) s.sa[k] += u[2 * dv + k], s.seen_sq[k] += u[3 * dv + k];
      if (s.counts[i] > 0 && s.ref > -kInfinity) s.ww += s.squares[i] * std::exp(2 * (s.square_shifts[i] - s.ref));
      kernels.fold_moments({dv, static_cast<double>(s.counts[i]), s.score_sums[i], s.cv_s ? 1.0 : 0.0, weighs ? f : 0.0, w, u, u + dv, acc,
                            s.ubar.data(), s.sbar.data(), s.su.data(), s.ss.data(), s.suu.data(), s.sus.data(), s.sss.data(),
                            s.sut.data(), s.suw.data(), s.sst.data(), s.ssw.data()});
    }
    s.folded = s.maxes.size();
  };
  for (std::size_t j = 0; strata != nullptr && j < n && j < strata->size(); ++j) {
    Query& s = state[j];
    s.stratum = (*strata)[j];
    if (s.stratum.empty()) continue;
    std::sort(s.stratum.begin(), s.stratum.end());
    s.stratum.erase(std::unique(s.stratum.begin(), s.stratum.end()), s.stratum.end());
    std::vector<float> scores;
    const PrunedSoft exact = soft_over_rows(kernels, queries + j * d, scales[j], span, s.stratum, target.top_m, s.cv ? &scores : nullptr);
    const SoftmaxState& h = exact.scan.state;
    if (s.cv) {  // the stratum's own sums U_S, S_S (in ubar, sbar until the frame's means below)
      s.ubar.assign(dv, 0.0), s.sbar.assign(dv, 0.0);
      std::vector<float> v(dv);
      for (std::size_t i = 0; i < s.stratum.size(); ++i) {
        value_row(span, s.stratum[i], v.data());
        for (std::size_t k = 0; k < dv; ++k)
          s.ubar[k] += v[k], s.sbar[k] += static_cast<double>(scores[i]) * v[k], s.known_sq[k] += static_cast<double>(v[k]) * v[k];
        s.stratum_scores += scores[i];
      }
    }
    if (!std::isfinite(h.max) || !std::isfinite(h.sum) || !std::all_of(h.acc.begin(), h.acc.end(), [](float a) { return std::isfinite(a); })) {
      s.active = false;  // (the exact path reports what left the float range)
      continue;
    }
    s.stratum_max = h.max;
    s.stratum_sum = h.sum;
    s.stratum_acc.assign(h.acc.begin(), h.acc.end());
    for (const TopScores::Item& item : exact.scan.top) s.top.offer_ids(&item.score, &item.id, 1);
  }
  // The frame (the rows the blocks hold: every row of span but the stratum's): the known means per row of
  // U_b and S_b, and what their totals may be off by (the rounding bounds of the header comment).
  for (std::size_t j = 0; moments != nullptr && j < n; ++j) {
    Query& s = state[j];
    const std::size_t frame = total - s.stratum.size();
    s.frame = frame;
    if (!s.active || frame == 0) {
      s.cv = false;
      continue;
    }
    const float* q = queries + j * d;
    const double scale = scales[j];
    double q1 = 0, q2 = 0;
    for (std::size_t i = 0; i < d; ++i) q1 += std::fabs(static_cast<double>(q[i])), q2 += static_cast<double>(q[i]) * q[i];
    q2 = std::sqrt(q2) * (1 + 0x1p-50);
    s.ubar.resize(dv, 0.0), s.sbar.resize(dv, 0.0);  // (the stratum's sums, or zeros)
    std::vector<double> qc(dv, 0.0);  // q^T (sum k v^T)
    double qk = 0;                    // q . sum k
    for (std::size_t i = 0; s.cv_s && i < d; ++i) {
      const double qi = q[i];
      const double* row = moments->key_value + i * dv;
      for (std::size_t k = 0; k < dv; ++k) qc[k] += qi * row[k];
      qk += qi * moments->key_sum[i];
    }
    // The frame's totals: U = sum v, S = sum s v and sum s (less the stratum's); ubar = U / rows, and sbar
    // the mean of s (v - ubar): (S - ubar sum s) / rows.
    const double scores_total = scale * qk - s.stratum_scores;
    s.centre.resize(dv);
    for (std::size_t k = 0; k < dv; ++k) {
      s.ubar[k] = (moments->value_sum[k] - s.ubar[k]) / static_cast<double>(frame);
      s.sbar[k] = s.cv_s ? (scale * qc[k] - s.sbar[k] - s.ubar[k] * scores_total) / static_cast<double>(frame) : 0.0;
      s.centre[k] = static_cast<float>(s.ubar[k]);
      // The frame's sum (v - ubar)^2 = sum v^2 - frame ubar^2, raised by what its rounding may hide.
      const double square = moments->value_square[k] - s.known_sq[k], lost = static_cast<double>(frame) * s.ubar[k] * s.ubar[k];
      s.known_sq[k] = std::max(0.0, square - lost) + moments->value_square_error + 0x1p-50 * (std::fabs(square) + lost);
    }
    const double rows = static_cast<double>(span.rows), vmax = target.value_max;
    // The kernel's scores: |s_j| <= smax, and within ds of scale q.k_j (the dot's rounding, then the scale's).
    s.smax = scale * q2 * moments->key_norm_max * (1 + 0x1p-20);
    s.ds = static_cast<double>(d + 2) * 0x1p-24 * 1.01 * scale * q2 * moments->key_norm_max + 0x1p-23 * s.smax;
    // The known totals' rounding (kept sums; the double products with q; the means' divisions).
    s.known_u = moments->value_error + rows * vmax * 0x1p-50;
    s.known_s = scale * q1 * (moments->key_value_error + static_cast<double>(d + 2) * 0x1p-53 * moments->key_value_abs) +
                vmax * scale * q1 * moments->key_sum_error + rows * vmax * s.smax * 0x1p-48;
    // Totals or bounds past the double range, or blocks whose float sums could pass the float range
    // (values or scores near FLT_MAX): the plain ratio answers.
    const bool finite = std::isfinite(s.known_u) && std::isfinite(s.known_s) && std::isfinite(s.ds) &&
                        std::all_of(s.ubar.begin(), s.ubar.end(), [](double x) { return std::isfinite(x); }) &&
                        std::all_of(s.sbar.begin(), s.sbar.end(), [](double x) { return std::isfinite(x); }) &&
                        static_cast<double>(kEstimateBlockRows) * vmax * std::max(1.0, s.smax) < 0x1p120;
    if (!finite) s.cv = false;
    s.squares_fit = static_cast<double>(kEstimateBlockRows) * 4 * vmax * vmax < 0x1p126;
  }
  std::vector<double> y(dv), value(dv);
  Models model(dv);                 // per coordinate: the estimate's model, for the leverage check
  std::vector<ErrorTerms> terms(dv);  // per coordinate: its error's terms
  std::vector<double> levered(dv);  // per coordinate: the leverage-weighted sum of squared residuals
  // Scans block b for query j into its slot (max, sum, acc at slot), folding the block's eligible rows,
  // piece by piece over the runs they fall in, into one state; sink (if any) gets their scores.
  // A query's stratum rows are left out (the pieces between them scanned).
  const auto scan_block = [&](std::size_t b, std::size_t j, std::size_t slot, BlockSink* sink) {
    Query& s = state[j];
    s.empty[slot] = 1;
    sink->aux = s.cv ? s.aux.data() + slot * 4 * dv : nullptr;
    sink->count = s.counts.data() + slot;
    sink->score_sum = s.score_sums.data() + slot;
    sink->score_square = s.score_squares.data() + slot;
    sink->squares = s.cv ? s.squares.data() + slot : nullptr;
    sink->square_shift = s.cv ? s.square_shifts.data() + slot : nullptr;
    sink->centre = s.cv ? s.centre.data() : nullptr;
    const auto scan_rows = [&](std::size_t first, std::size_t count) {
      if (count == 0) return;
      s.empty[slot] = 0;
      sink->ids = span.ids + first;
      sink->rows = span.sub(first, count);
      kernels.soft_scan(queries + j * d, scales[j], sink->rows, s.maxes[slot], s.sums[slot], s.accs.data() + slot * dv,
                        sink);
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
      s.counts.resize(base[j] + fresh.size(), 0);
      s.score_sums.resize(base[j] + fresh.size(), 0.0);
      s.score_squares.resize(base[j] + fresh.size(), 0.0);
      if (s.cv) {
        s.aux.resize((base[j] + fresh.size()) * 4 * dv, 0.0f);
        s.squares.resize(base[j] + fresh.size(), 0.0);
        s.square_shifts.resize(base[j] + fresh.size(), -kInfinity);
      }
    }
    for (const std::size_t b : fresh) {
      taken[b] = 1;
      read += std::min(kEstimateBlockRows, total - b * kEstimateBlockRows);
    }
    const std::size_t parts = std::clamp<std::size_t>(fresh.size() / 16, 1, pool.concurrency());
    std::vector<std::vector<TopScores>> tops(parts);
    pool.run(parts, [&](std::size_t part) {
      BlockSink sink;
      sink.kernels = &kernels;
      if (target.top_m > 0)
        for (std::size_t j = 0; j < n; ++j) tops[part].emplace_back(target.top_m, nullptr);
      for (std::size_t i = fresh.size() * part / parts; i < fresh.size() * (part + 1) / parts; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          if (!state[j].active) continue;
          sink.top = target.top_m > 0 ? &tops[part][j] : nullptr;
          scan_block(fresh[i], j, base[j] + i, &sink);
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
  // Rounds: the first draws 32 to 64 blocks; each later one as many as the (lower) median query still
  // estimating says it needs from its last error ((error / target)^2 times the blocks drawn, at least 1.1
  // and at most 16 times the last round's expected count), until every query's target is met by a sample
  // whose weight is spread over enough blocks for the normal approximation (or the budget stops them).
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
    // Each active query folds its blocks of this round into its running sums (on the pool's threads when
    // several queries estimate: a batch's folds are its longest serial part otherwise).
    {
      std::vector<std::size_t> folding;
      for (std::size_t j = 0; j < n; ++j)
        if (state[j].active && state[j].folded < state[j].maxes.size()) folding.push_back(j);
      const std::size_t fold_parts = std::min(folding.size(), pool.concurrency());
      if (fold_parts > 1)
        pool.run(fold_parts, [&](std::size_t part) {
          for (std::size_t i = part; i < folding.size(); i += fold_parts) fold(state[folding[i]]);
        });
    }
    // What each query still estimating asks the next round to grow by; the round grows by the lower median
    // ask (the neediest query's would make every other overshoot: they leave as soon as their target is met).
    std::vector<double> asks;
    for (std::size_t j = 0; j < n; ++j) {
      Query& s = state[j];
      if (!s.active) continue;
      const std::size_t drawn = s.maxes.size();
      const double pi = drawn == blocks ? 1.0 : 1 - miss;  // every block read: the exact answer, whatever the draws
      if (drawn == 0) {
        asks.push_back(2.0);
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
      //
      // With control variates, the residuals e_b = T_b - r W_b are regressed on the centred (u_b, s_b):
      // beta solves G beta = b (G: their sums of squares and products; b = sum u e, sum s e), the answer
      // moves by beta . (sum u, sum s) / (pi Z^), and the variance sums (e_b - beta . x_b)^2 = sum e^2 -
      // 2 beta . b + beta^T G beta instead, times blocks / (blocks - regressors) (blocks: those with
      // rows); what sum x_b and sum y_b may be off by (off_u, off_s: the drawn rows' own mismatches and
      // the known totals' rounding in the share the sample holds) times |beta| / (pi Z^) is added to the
      // error as it stands. Per coordinate the answer is the one of the plain ratio and the regressions
      // on x, on y and on both whose z standard errors plus offset are smallest (a regressor whose offset
      // outweighs what it explains is left out: the kernel's float scores weigh more in y as d grows).
      // A sample that meets the target is then checked by leverage (below).
      const bool regress = s.cv && pi < 1 && s.nonempty > 8;
      const double rounding = static_cast<double>(drawn + 8) * 0x1p-52;
      const double held = s.cv ? static_cast<double>(s.rows_drawn) / static_cast<double>(s.frame) : 0.0;
      double worst = 0;  // the largest coordinate's z standard errors plus offset
      for (std::size_t k = 0; k < dv; ++k) {
        const double r = y[k] / zall, a2 = s.t2[k] * g2, aw = s.tw[k] * g2;
        const double spread_k = std::sqrt(a2) + std::fabs(r) * std::sqrt(w2);
        const double sum_e2 = a2 - 2 * r * aw + r * r * w2;
        // The unseen spread: a sample that missed the rows whose values lie far out (values with heavy
        // tails) understates the variance as it understates the error. With the known sum of squares, the
        // frame's sum (v - r)^2 is known, and the drawn rows' sum should be their share of it (held, the
        // rows drawn over the frame's: mean squares per row compared); what the sample lacks of it, times
        // the drawn rows' mean squared weight, is what those rows would add to sum e_b^2 if weights and
        // values were independent and rows within a block too. (Values past ~1e18, whose squares a
        // block's float sum could not hold: no such term.)
        double unseen = 0;
        if (s.cv && s.squares_fit && s.rows_drawn > 0) {
          const double drawn_rows = static_cast<double>(s.rows_drawn), off = r - s.centre[k];
          const double around = s.su[k] + drawn_rows * (s.ubar[k] - s.centre[k]);  // sum over the drawn rows of v - centre
          const double seen = std::max(0.0, s.seen_sq[k] - 2 * off * around + drawn_rows * off * off);
          const double all = s.known_sq[k] + static_cast<double>(s.frame) * (r - s.ubar[k]) * (r - s.ubar[k]);
          unseen = std::max(0.0, s.ww * g2 / drawn_rows * (held * all - seen));
          if (!std::isfinite(unseen)) unseen = 0;
        }
        const auto error_of = [&](double sum, double spread_sum, double offset, double used) {
          const double tk = std::max(0.0, sum) + unseen + rounding * spread_sum * spread_sum;
          const double blocks = static_cast<double>(std::max<std::size_t>(s.nonempty, 1));
          return z * std::sqrt((1 - pi) * tk * blocks / std::max(1.0, blocks - used)) / zall + offset;
        };
        double best_error = error_of(sum_e2, spread_k, 0.0, 0.0);
        value[k] = r;
        model.set(k, r, 0, 0, 0, 0, 0);
        terms[k] = ErrorTerms{spread_k, 0, unseen, 0};
        if (regress) {
          // What sum x_b and sum y_b may be off by: each drawn row's float sums and score mismatch (|v_jk|
          // from the blocks' sums of |v|), and the known totals' rounding in the share the sample holds.
          const double ua = std::fabs(s.ubar[k]);
          const double off_u = s.sa[k] * (kBlockSumGamma + 0x1p-50) + held * s.known_u;
          const double off_s = s.sa[k] * (s.ds + s.smax * (kBlockSumGamma + 0x1p-50)) +
                               ua * static_cast<double>(s.rows_drawn) * (s.ds + s.smax * 0x1p-48) + held * s.known_s;
          const double b1 = (s.sut[k] - r * s.suw[k]) * g, b2 = (s.sst[k] - r * s.ssw[k]) * g;
          const double g11 = s.suu[k], g12 = s.sus[k], g22 = s.sss[k], det = g11 * g22 - g12 * g12;
          const auto consider = [&](double beta1, double beta2, double used, double i11, double i12, double i22) {
            if (!std::isfinite(beta1) || !std::isfinite(beta2)) return;
            const double sum = sum_e2 - 2 * (beta1 * b1 + beta2 * b2) + beta1 * beta1 * g11 + 2 * beta1 * beta2 * g12 + beta2 * beta2 * g22;
            const double spread_sum = spread_k + std::fabs(beta1) * std::sqrt(g11) + std::fabs(beta2) * std::sqrt(g22);
            const double offset = (std::fabs(beta1) * off_u + std::fabs(beta2) * off_s) / zall;
            const double e = error_of(sum, spread_sum, offset, used);
            if (std::isfinite(e) && e < best_error) {
              best_error = e, value[k] = r - (beta1 * s.su[k] + beta2 * s.ss[k]) / zall;
              model.set(k, r, beta1, beta2, i11, i12, i22);
              terms[k] = ErrorTerms{spread_sum, offset, unseen, 0};
            }
          };
          if (g11 > 0) consider(b1 / g11, 0.0, 1, 1 / g11, 0, 0);
          if (s.cv_s && g22 > 0) consider(0.0, b2 / g22, 1, 0, 0, 1 / g22);
          if (s.cv_s && g11 > 0 && g22 > 0 && det > 1e-9 * g11 * g22)
            consider((g22 * b1 - g12 * b2) / det, (g11 * b2 - g12 * b1) / det, 2, g22 / det, -g12 / det, g11 / det);
        }
        terms[k].error = best_error;
        worst = std::max(worst, best_error);
      }
      // The effective number of blocks, (sum W)^2 / sum W^2: when a few blocks hold most of the sampled
      // weight (peaked attention: a handful of rows outweigh the rest), the sample's variance says nothing
      // of the rows it missed, and a larger sample (or the scan) must answer.
      const bool spread = zsum > 0 && zsum * zsum >= kMinEffectiveBlocks * w2;  // (zsum 0: every drawn block in the stratum)
      // The storage-order check: the scores' variance between the drawn blocks against within them (the
      // one-way analysis of variance's F ratio, about 1 when the storage order says nothing of the scores).
      // Far above it, the blocks are runs of rows alike for this query (rows stored by similarity) and the
      // few that hold the mass may all have been missed while the weight looks spread: the scan answers.
      // (Not with a stratum: the walk's lists hold such rows.)
      if (s.stratum.empty() && s.nonempty >= kOrderCheckBlocks && pi < 1) {
        const double rows = static_cast<double>(s.rows_drawn), groups = static_cast<double>(s.nonempty);
        const double mean_part = s.order_sum * s.order_sum / rows;
        const double between = (s.order_between - mean_part) / (groups - 1), within = std::max(0.0, s.order_square - s.order_between) / (rows - groups);
        const double block_spread = (between - within) * groups / rows;  // (between ~ rows per block x var of block means + within)
        if (between > kMaxOrderRatio * within && block_spread > kOrderNats * kOrderNats) {
          s.active = false;
          continue;
        }
      }
      // The leverage check, where the sample would answer (its weight spread, the storage order not against
      // it): each block's residual under the chosen model, divided by 1 - h_b (h_b its leverage), squared
      // and summed (HC3: about the jackknife's variance); the error is the larger of the two. Blocks of far
      // out weights or values are fitted by the model (the ratio's own weight, a regression's coefficient)
      // and leave small residuals, so the plain sum of squares understates the variance exactly when a few
      // such blocks were drawn (heavy tails); the division restores what each would leave if it had not
      // been drawn.
      if (spread && target.value_max > 0 && worst <= target.error_target * target.value_max && pi < 1 && w2 > 0) {
        std::fill(levered.begin(), levered.end(), 0.0);
        for (std::size_t i = 0; i < s.maxes.size(); ++i) {
          const double f = s.sums[i] != 0 ? std::exp(static_cast<double>(s.maxes[i]) - best) : 0.0;
          const double w = static_cast<double>(s.sums[i]) * f;
          const float* u = s.cv ? s.aux.data() + i * 4 * dv : nullptr;  // U_b, then S_b
          kernels.fold_leverage({dv, static_cast<double>(s.counts[i]), s.score_sums[i], s.cv_s ? 1.0 : 0.0, f, w, w / zall, kMaxLeverage, u,
                                 u == nullptr ? nullptr : u + dv, s.accs.data() + i * dv, s.ubar.data(), s.sbar.data(), model.r.data(),
                                 model.beta1.data(), model.beta2.data(), model.i11.data(), model.i12.data(), model.i22.data(), levered.data()});
        }
        worst = 0;
        for (std::size_t k = 0; k < dv; ++k) {
          const ErrorTerms& m = terms[k];
          const double tk = levered[k] + m.unseen + rounding * m.spread * m.spread;
          const double e = z * std::sqrt((1 - pi) * tk) / zall + m.offset;
          worst = std::max(worst, std::isfinite(e) ? std::max(m.error, e) : m.error);
        }
      }
      const double error = target.value_max > 0 ? worst / target.value_max : 0.0;
      if ((error <= target.error_target && spread) || pi >= 1) {
        PrunedSoft result{SoftScan{SoftmaxState(dv), {}}, {}, 0, 0.0};
        result.scan.state.max = static_cast<float>(best);
        result.scan.state.sum = static_cast<float>(zall / pi);
        result.value.resize(dv);
        for (std::size_t k = 0; k < dv; ++k) result.value[k] = static_cast<float>(value[k]);
        std::size_t scored = s.stratum.size() + read;  // this query's rows: its stratum, and every block drawn while it estimated
        for (const std::size_t row : s.stratum) {  // (less the stratum's rows inside drawn blocks: left out of their scans)
          const std::size_t run = run_holding(rows_in, row);
          if (run == rows_in.runs.size()) continue;
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
      asks.push_back(spread ? std::clamp(static_cast<double>(drawn) * error * error / (target.error_target * target.error_target) *
                                             kAimedGrowth / m, kLeastGrowth, 16.0)
                            : std::clamp(needed / static_cast<double>(drawn) * 1.1, 1.5, 16.0));
    }
    if (asks.empty()) return out;  // no query still estimating
    std::nth_element(asks.begin(), asks.begin() + static_cast<std::ptrdiff_t>((asks.size() - 1) / 2), asks.end());
    m = std::min(m * asks[(asks.size() - 1) / 2], static_cast<double>(blocks));
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
