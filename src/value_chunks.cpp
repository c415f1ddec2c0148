// ValueChunks (value_chunks.hpp): per-chunk sums of the values in double, summed again when a write made
// them stale, combined into the totals over a mask's eligible rows with a bound on every rounding.
#include "value_chunks.hpp"

#include <algorithm>
#include <cmath>

namespace softkv::detail {
namespace {

constexpr double kUnit = 0x1p-53;  // double rounding

// What a sum of n terms of magnitude at most m, added one by one in double, may be off by: each addition
// rounds by at most kUnit of the partial sum, itself at most n m. (A float's square is exact in double: the
// extra n kUnit m^2 TotalsSum adds for the squares is slack.)
double sum_error(double n, double m) { return 1.01 * n * n * kUnit * m; }

}  // namespace

double add_rows(const RowSpan& span, std::size_t begin, std::size_t end, double* sum, double* square, std::vector<float>& row) {
  const std::size_t dv = span.value_dim;
  double abs_max = 0;
  for (std::size_t r = begin; r < end; ++r) {
    value_row(span, r, row.data());
    for (std::size_t k = 0; k < dv; ++k) {
      const double x = row[k];
      sum[k] += x;
      square[k] += x * x;
      abs_max = std::max(abs_max, std::fabs(x));
    }
  }
  return abs_max;
}

TotalsSum::TotalsSum(std::size_t dv) {
  out_.value_sum.assign(dv, 0.0);
  out_.value_square.assign(dv, 0.0);
}

void TotalsSum::add(const double* sum, const double* square, double rows, double abs_max) {
  for (std::size_t k = 0; k < out_.value_sum.size(); ++k) out_.value_sum[k] += sum[k], out_.value_square[k] += square[k];
  out_.value_error += sum_error(rows, abs_max);
  out_.value_square_error += sum_error(rows, abs_max * abs_max) + 1.01 * rows * kUnit * abs_max * abs_max;
  abs_max_ = std::max(abs_max_, abs_max);
  parts_ += 1;
}

EligibleTotals TotalsSum::finish(std::size_t rows) {
  // Adding the parts together: each addition rounds by at most kUnit of the partial total, itself at most
  // rows x abs_max.
  const double all = static_cast<double>(rows);
  out_.value_error += 1.01 * parts_ * kUnit * all * abs_max_;
  out_.value_square_error += 1.01 * parts_ * kUnit * all * abs_max_ * abs_max_;
  out_.rows = rows;
  if (!std::isfinite(out_.value_error) || !std::isfinite(out_.value_square_error)) return {};
  return std::move(out_);
}

MomentTotals EligibleTotals::view() const {
  // (No key totals: key_value null keeps the sample to the x_b regressor, and key_norm_max 0 only enters
  // the y_b regressor's bounds.)
  MomentTotals t;
  if (rows == 0) return t;
  t.value_sum = value_sum.data();
  t.value_square = value_square.data();
  t.rows = rows;
  t.value_error = value_error;
  t.value_square_error = value_square_error;
  return t;
}

void ValueChunks::touch(std::size_t row) noexcept {
  const std::size_t c = row / kRows;
  if (c >= chunks_.size()) {
    try {
      chunks_.resize(c + 1);
    } catch (...) {  // (out of memory: no chunk is trusted until the next query sums them again)
      all_stale_ = true;
      return;
    }
  }
  chunks_[c].fresh = false;
}

void ValueChunks::clear() noexcept {
  for (Chunk& c : chunks_) c.fresh = false;
}

EligibleTotals ValueChunks::totals(const RowSpan& span, const EligibleRows& eligible, std::size_t loose_limit,
                                   std::size_t stale_limit) const {
  const std::size_t dv = span.value_dim;
  if (eligible.count == 0 || dv == 0) return {};
  // The whole chunks the runs cover, and the eligible rows outside them.
  std::vector<std::size_t> whole;
  std::vector<RowRun> loose;
  std::size_t loose_rows = 0;
  for (const RowRun& run : eligible.runs) {
    const std::size_t end = std::min(run.begin + run.count, span.rows);
    for (std::size_t r = run.begin; r < end;) {
      const std::size_t first = r / kRows * kRows, last = std::min(first + kRows, span.rows);
      if (r == first && end >= last) {
        whole.push_back(r / kRows);
        r = last;
      } else {
        const std::size_t stop = std::min(end, last);
        loose.push_back({r, stop - r});
        loose_rows += stop - r;
        if (loose_rows > loose_limit) return {};  // (a mask of many short runs: no totals)
        r = stop;
      }
    }
  }
  TotalsSum total(dv);
  std::vector<float> row(dv);
  {
    const std::lock_guard lock(mutex_);
    if (chunks_.size() * kRows < span.rows) chunks_.resize((span.rows + kRows - 1) / kRows);
    if (all_stale_) {
      for (Chunk& c : chunks_) c.fresh = false;
      all_stale_ = false;
    }
    // Stale chunks first, up to stale_limit rows; any left stale: no totals this time.
    std::size_t summed = 0;
    bool complete = true;
    for (const std::size_t c : whole) {
      Chunk& chunk = chunks_[c];
      if (chunk.fresh) continue;
      const std::size_t first = c * kRows, last = std::min(first + kRows, span.rows);
      if (summed + (last - first) > stale_limit) {
        complete = false;
        break;
      }
      chunk.sum.assign(dv, 0.0);
      chunk.square.assign(dv, 0.0);
      chunk.abs_max = add_rows(span, first, last, chunk.sum.data(), chunk.square.data(), row);
      chunk.fresh = true;
      summed += last - first;
    }
    if (!complete) return {};
    for (const std::size_t c : whole) {
      const Chunk& chunk = chunks_[c];
      const std::size_t first = c * kRows, last = std::min(first + kRows, span.rows);
      total.add(chunk.sum.data(), chunk.square.data(), static_cast<double>(last - first), chunk.abs_max);
    }
  }
  // The loose rows, one by one into their own sums (then added like one more chunk).
  std::vector<double> sum(dv, 0.0), square(dv, 0.0);
  double loose_max = 0;
  for (const RowRun& run : loose) loose_max = std::max(loose_max, add_rows(span, run.begin, run.begin + run.count, sum.data(), square.data(), row));
  total.add(sum.data(), square.data(), static_cast<double>(loose_rows), loose_max);
  return total.finish(eligible.count);
}

}  // namespace softkv::detail
