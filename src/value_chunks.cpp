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

void KeySums::reset(std::size_t d, std::size_t dv, bool keep) {
  key_value.clear(), key_sum.clear();
  rows = kv_mass = k_mass = norm_max = 0;
  if (!keep || d == 0) return;
  key_value.assign(d * dv, 0.0);
  key_sum.assign(d, 0.0);
}

void KeySums::add(const float* key, const float* value) {
  const std::size_t d = key_sum.size(), dv = d == 0 ? 0 : key_value.size() / d;
  double kmax = 0, vmax = 0, norm = 0;
  for (std::size_t c = 0; c < dv; ++c) vmax = std::max(vmax, std::fabs(static_cast<double>(value[c])));
  for (std::size_t i = 0; i < d; ++i) {
    const double k = key[i];
    double* row = key_value.data() + i * dv;
    for (std::size_t c = 0; c < dv; ++c) row[c] += k * value[c];
    key_sum[i] += k;
    kmax = std::max(kmax, std::fabs(k));
    norm += k * k;
  }
  rows += 1;
  kv_mass += kmax * vmax;
  k_mass += kmax;
  norm_max = std::max(norm_max, std::sqrt(norm) * (1 + 0x1p-30));  // (d exact squares summed in double, a root)
}

void KeySums::add_rows(const RowSpan& span, std::size_t begin, std::size_t end, std::vector<float>& key, std::vector<float>& value) {
  if (!kept()) return;
  key.resize(span.dim), value.resize(span.value_dim);
  for (std::size_t r = begin; r < end; ++r) {
    key_row(span, r, key.data());
    value_row(span, r, value.data());
    add(key.data(), value.data());
  }
}

void TotalsSum::add_keys(const KeySums& keys) {
  if (!keys.kept() || (out_.key_sum.size() != 0 && out_.key_sum.size() != keys.key_sum.size())) return;
  if (out_.key_sum.empty()) out_.key_value.assign(keys.key_value.size(), 0.0), out_.key_sum.assign(keys.key_sum.size(), 0.0);
  for (std::size_t e = 0; e < keys.key_value.size(); ++e) out_.key_value[e] += keys.key_value[e];
  for (std::size_t i = 0; i < keys.key_sum.size(); ++i) out_.key_sum[i] += keys.key_sum[i];
  out_.key_value_error += 1.01 * keys.rows * kUnit * keys.kv_mass;
  out_.key_sum_error += 1.01 * keys.rows * kUnit * keys.k_mass;
  out_.key_norm_max = std::max(out_.key_norm_max, keys.norm_max);
  kv_mass_ += keys.kv_mass, k_mass_ += keys.k_mass;
  key_parts_ += 1;
}

EligibleTotals TotalsSum::finish(std::size_t rows) {
  // Adding the parts together: each addition rounds by at most kUnit of the partial total, itself at most
  // rows x abs_max (the key sums: at most their parts' masses together).
  const double all = static_cast<double>(rows);
  out_.value_error += 1.01 * parts_ * kUnit * all * abs_max_;
  out_.value_square_error += 1.01 * parts_ * kUnit * all * abs_max_ * abs_max_;
  out_.rows = rows;
  if (!std::isfinite(out_.value_error) || !std::isfinite(out_.value_square_error)) return {};
  out_.key_value_error += 1.01 * key_parts_ * kUnit * kv_mass_;
  out_.key_sum_error += 1.01 * key_parts_ * kUnit * k_mass_;
  out_.key_value_abs = kv_mass_ + out_.key_value_error;
  // Key sums from only some parts, or bounds past the double range: the totals without them.
  if (key_parts_ != parts_ || !std::isfinite(out_.key_value_abs) || !std::isfinite(out_.key_sum_error)) {
    out_.key_value.clear(), out_.key_sum.clear();
    out_.key_value_error = out_.key_value_abs = out_.key_sum_error = out_.key_norm_max = 0;
  }
  return std::move(out_);
}

MomentTotals EligibleTotals::view() const {
  // (Without key totals: key_value null keeps the sample to the x_b regressor, and key_norm_max 0 only
  // enters the y_b regressor's bounds.)
  MomentTotals t;
  if (rows == 0) return t;
  t.value_sum = value_sum.data();
  t.value_square = value_square.data();
  t.rows = rows;
  t.value_error = value_error;
  t.value_square_error = value_square_error;
  if (!key_value.empty()) {
    t.key_value = key_value.data();
    t.key_sum = key_sum.data();
    t.key_value_error = key_value_error;
    t.key_value_abs = key_value_abs;
    t.key_sum_error = key_sum_error;
    t.key_norm_max = key_norm_max;
  }
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
  std::vector<float> row(dv), key, value;
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
      chunk.keys.reset(span.dim, dv);
      chunk.keys.add_rows(span, first, last, key, value);
      chunk.fresh = true;
      summed += last - first;
    }
    if (!complete) return {};
    for (const std::size_t c : whole) {
      const Chunk& chunk = chunks_[c];
      const std::size_t first = c * kRows, last = std::min(first + kRows, span.rows);
      total.add(chunk.sum.data(), chunk.square.data(), static_cast<double>(last - first), chunk.abs_max);
      total.add_keys(chunk.keys);
    }
  }
  // The loose rows, one by one into their own sums (then added like one more chunk).
  std::vector<double> sum(dv, 0.0), square(dv, 0.0);
  KeySums loose_keys;
  // (Summed at every query: only within its budget; else the totals have no key sums.)
  loose_keys.reset(span.dim, dv, keeps_key_sums(span.dim, dv) && key_sums_fit(loose_rows, loose_limit, span.dim, dv));
  double loose_max = 0;
  for (const RowRun& run : loose) {
    loose_max = std::max(loose_max, add_rows(span, run.begin, run.begin + run.count, sum.data(), square.data(), row));
    loose_keys.add_rows(span, run.begin, run.begin + run.count, key, value);
  }
  total.add(sum.data(), square.data(), static_cast<double>(loose_rows), loose_max);
  total.add_keys(loose_keys);
  return total.finish(eligible.count);
}

}  // namespace softkv::detail
