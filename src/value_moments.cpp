// ValueMoments (value_moments.hpp): sums of v_j and k_j v_j^T in double, from float products of a few
// rows at a time (the kernel path's own blend tiles), with bounds on every rounding on the way.
#include "value_moments.hpp"

#include "scan.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <cmath>
#include <exception>

namespace softkv::detail {
namespace {

// Rows per float product: the product of n rows rounds by at most (n + 2) 2^-24 of the terms' magnitudes.
constexpr std::size_t kChunk = 64;
// Fewer rows than this (single writes) are added in double, where k_i v_c is exact and only the sum rounds.
constexpr std::size_t kDoubleRows = 8;
constexpr double kUnit = 0x1p-53;  // double rounding

// One set of sums and their bounds (a part of the first sum, or the kept totals).
struct Sums {
  std::vector<double> value_sum, value_square, key_sum, key_value;
  double value_error = 0, value_square_error = 0, key_sum_error = 0, key_value_error = 0;
  double key_abs_mass = 0;    // sum over every row ever added or taken out of ||k||_inf
  double abs_mass = 0;        // sum over every row ever added or taken out of ||k||_inf ||v||_inf
  double live_abs_mass = 0;   // the same, added for rows in and taken out for rows out (rounding aside)
  double value_abs_mass = 0;  // sum over every row ever added or taken out of ||v||_inf
  double square_mass = 0;     // sum over every row ever added or taken out of ||v||_inf^2
  double key_norm_max = 0;
  std::vector<float> product;  // one chunk's d x dv float product

  Sums(std::size_t d, std::size_t dv, bool keep_key_value)
      : value_sum(dv, 0.0), value_square(dv, 0.0), key_sum(d, 0.0), key_value(keep_key_value ? d * dv : 0, 0.0) {}

  // Adds (sign +1) or takes out (-1) rows x (d, dv) rows given as float32.
  void add(const KernelTable& kernels, const float* keys, const float* values, std::size_t rows, std::size_t d, std::size_t dv,
           double sign) {
    for (std::size_t first = 0; first < rows; first += kChunk) {
      const std::size_t n = std::min(kChunk, rows - first);
      const float* k = keys + first * d;
      const float* v = values + first * dv;
      double chunk_abs = 0;
      for (std::size_t r = 0; r < n; ++r) {
        double kmax = 0, vmax = 0, norm2 = 0;
        for (std::size_t i = 0; i < d; ++i) {
          const double x = k[r * d + i];
          kmax = std::max(kmax, std::fabs(x));
          norm2 += x * x;
          key_sum[i] += sign * x;
        }
        key_abs_mass += kmax;
        key_sum_error += kUnit * key_abs_mass;
        for (std::size_t c = 0; c < dv; ++c) {
          const double x = v[r * dv + c];
          vmax = std::max(vmax, std::fabs(x));
          value_sum[c] += sign * x;
          value_square[c] += sign * (x * x);
        }
        value_abs_mass += vmax;
        value_error += kUnit * value_abs_mass;  // each add rounds by at most 2^-53 of the sum's magnitude
        square_mass += vmax * vmax;
        value_square_error += 2 * kUnit * square_mass;  // (the square's own rounding, then the add's)
        chunk_abs += kmax * vmax;
        // (the norm in double: its own rounding, a few 2^-53, is covered by 1.01)
        key_norm_max = std::max(key_norm_max, std::sqrt(norm2) * 1.01);
      }
      abs_mass += chunk_abs;
      live_abs_mass += sign * chunk_abs;
      if (key_value.empty()) continue;
      // (Rows whose products could pass the float range, |k_i v_c| near FLT_MAX, are summed in double too.)
      if (n < kDoubleRows || chunk_abs > 0x1p100) {
        for (std::size_t r = 0; r < n; ++r)
          for (std::size_t i = 0; i < d; ++i) {
            const double ki = sign * static_cast<double>(k[r * d + i]);
            double* row = key_value.data() + i * dv;
            for (std::size_t c = 0; c < dv; ++c) row[c] += ki * static_cast<double>(v[r * dv + c]);
          }
        key_value_error += static_cast<double>(n) * kUnit * abs_mass;
        continue;
      }
      product.assign(d * dv, 0.0f);
      kernels.tiles.blend(k, d, d, v, n, dv, product.data());  // product[i dv + c] = sum_r k_ri v_rc
      for (std::size_t e = 0; e < d * dv; ++e) key_value[e] += sign * static_cast<double>(product[e]);
      key_value_error += static_cast<double>(n + 2) * 0x1p-24 * 1.01 * chunk_abs + kUnit * abs_mass;
    }
  }

  void merge(const Sums& other) {
    for (std::size_t c = 0; c < value_sum.size(); ++c) value_sum[c] += other.value_sum[c], value_square[c] += other.value_square[c];
    for (std::size_t i = 0; i < key_sum.size(); ++i) key_sum[i] += other.key_sum[i];
    key_abs_mass += other.key_abs_mass;
    key_sum_error += other.key_sum_error + kUnit * key_abs_mass;
    for (std::size_t e = 0; e < key_value.size(); ++e) key_value[e] += other.key_value[e];
    abs_mass += other.abs_mass;
    live_abs_mass += other.live_abs_mass;
    value_abs_mass += other.value_abs_mass;
    value_error += other.value_error + kUnit * value_abs_mass;
    square_mass += other.square_mass;
    value_square_error += other.value_square_error + kUnit * square_mass;
    key_value_error += other.key_value_error + kUnit * abs_mass;
    key_norm_max = std::max(key_norm_max, other.key_norm_max);
  }
};

// The float32 rows [first, first + n) of span: pointers into it (f32), or widened into buffers.
void rows_as_float(const RowSpan& span, std::size_t first, std::size_t n, std::vector<float>& kbuf, std::vector<float>& vbuf,
                   const float*& keys, const float*& values) {
  if (span.key_precision == Precision::f32) {
    keys = static_cast<const float*>(span.keys) + first * span.dim;
  } else {
    kbuf.resize(n * span.dim);
    for (std::size_t r = 0; r < n; ++r) key_row(span, first + r, kbuf.data() + r * span.dim);
    keys = kbuf.data();
  }
  if (span.value_precision == Precision::f32) {
    values = static_cast<const float*>(span.values) + first * span.value_dim;
  } else {
    vbuf.resize(n * span.value_dim);
    for (std::size_t r = 0; r < n; ++r) value_row(span, first + r, vbuf.data() + r * span.value_dim);
    values = vbuf.data();
  }
}

}  // namespace

struct ValueMoments::State : Sums {
  using Sums::Sums;
};

ValueMoments::ValueMoments() = default;
ValueMoments::~ValueMoments() = default;

MomentTotals ValueMoments::totals(const KernelTable& kernels, const RowSpan& span) const {
  if (!ready_.load(std::memory_order_acquire)) {
    std::lock_guard lock(mutex_);
    if (!ready_.load(std::memory_order_relaxed)) try {
      const std::size_t d = span.dim, dv = span.value_dim;
      const bool keep = d * dv <= kMaxMomentElements;
      // Parts of about equal rows on the shared pool, each summed apart, merged in order.
      ThreadPool& pool = ThreadPool::shared();
      const std::size_t parts = std::clamp<std::size_t>(span.rows / (16 * kChunk), 1, pool.concurrency());
      std::vector<Sums> sums(parts, Sums(d, dv, keep));
      pool.run(parts, [&](std::size_t part) {
        std::vector<float> kbuf, vbuf;
        const std::size_t begin = span.rows * part / parts, end = span.rows * (part + 1) / parts;
        for (std::size_t first = begin; first < end; first += 16 * kChunk) {
          const std::size_t n = std::min(16 * kChunk, end - first);
          const float* keys = nullptr;
          const float* values = nullptr;
          rows_as_float(span, first, n, kbuf, vbuf, keys, values);
          sums[part].add(kernels, keys, values, n, d, dv, 1.0);
        }
      });
      for (std::size_t part = 1; part < parts; ++part) sums.front().merge(sums[part]);
      state_ = std::make_unique<State>(d, dv, keep);
      static_cast<Sums&>(*state_) = std::move(sums.front());
      rows_ = span.rows;
      ready_.store(true, std::memory_order_release);
    } catch (const std::exception&) {  // (out of memory: no totals; the sample answers without them)
      return {};
    }
  }
  const State& s = *state_;
  return {s.value_sum.data(),
          s.value_square.data(),
          s.key_value.empty() ? nullptr : s.key_value.data(),
          s.key_sum.data(),
          rows_,
          s.value_error,
          s.value_square_error,
          s.key_sum_error,
          s.key_value_error,
          s.abs_mass + s.key_value_error,
          s.key_norm_max};
}

void ValueMoments::update(const KernelTable& kernels, const float* keys, const float* values, std::size_t rows, std::size_t d,
                          std::size_t dv, float sign) {
  if (!kept() || rows == 0) return;
  State& s = *state_;
  s.add(kernels, keys, values, rows, d, dv, sign);
  rows_ = sign > 0 ? rows_ + rows : rows_ - std::min(rows_, rows);
  // Rows that came and went many times over leave bounds scaled to all of them: sum afresh (next query).
  if (s.abs_mass > 16 * s.live_abs_mass && s.abs_mass > 0) clear();
}

void ValueMoments::clear() noexcept {
  ready_.store(false, std::memory_order_release);
  state_.reset();
  rows_ = 0;
}

}  // namespace softkv::detail
