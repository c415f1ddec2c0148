// A collection's totals over its rows as stored (sum v_j, sum v_j^2, sum k_j and sum k_j v_j^T): the known totals of the
// block sample's control variates (estimate.hpp; docs/PRUNING.md, "Control variates").
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>

#include "simd/kernel_table.hpp"

namespace softkv::detail {

/// The totals as a query reads them (valid while the collection's shared lock is held), each with a
/// bound on its rounding: what the sample's control variates subtract must be known to within it.
struct MomentTotals {
  const double* value_sum = nullptr;  ///< dv: sum over the rows of v_j
  const double* value_square = nullptr;  ///< dv: sum over the rows of v_j^2 (per coordinate)
  const double* key_value = nullptr;  ///< d x dv, row i for key coordinate i: sum over the rows of k_ji v_j (null: not kept)
  const double* key_sum = nullptr;    ///< d: sum over the rows of k_j
  std::size_t rows = 0;               ///< rows summed: every row of the collection
  double value_error = 0;             ///< >= |value_sum[c] - the exact sum| for every c
  double value_square_error = 0;      ///< >= |value_square[c] - the exact sum| for every c
  double key_sum_error = 0;           ///< >= |key_sum[i] - the exact sum| for every i
  double key_value_error = 0;         ///< >= |key_value[i dv + c] - the exact sum| for every element
  double key_value_abs = 0;           ///< >= |key_value[i dv + c]| and the exact sum, for every element
  double key_norm_max = 0;            ///< >= max_j ||k_j||_2 over the rows
};

/// Collections with d x dv above this keep value_sum only (key_value would take 8 d dv bytes).
inline constexpr std::size_t kMaxMomentElements = std::size_t{1} << 21;

/// The totals, summed over every row at the first query that asks (one pass, ~0.1-0.3 s per million rows
/// of d = dv = 128) and kept from then on by every write (a write's rows in one small product). Reads
/// under the collection's shared lock (a mutex of its own orders the first sum); writes under its
/// exclusive lock.
class ValueMoments {
 public:
  ValueMoments();
  ~ValueMoments();
  ValueMoments(const ValueMoments&) = delete;
  ValueMoments& operator=(const ValueMoments&) = delete;
  /// The totals of span (every row of the collection), summed now if no write has kept them; empty totals
  /// (rows 0: the estimate then uses none) when summing them ran out of memory.
  [[nodiscard]] MomentTotals totals(const KernelTable& kernels, const RowSpan& span) const;
  /// Whether writes must keep the totals (they were summed and not forgotten since).
  [[nodiscard]] bool kept() const noexcept { return ready_.load(std::memory_order_acquire); }
  /// Adds rows (sign +1) or takes them out (-1): keys rows x d and values rows x dv as stored (float32).
  /// Under the exclusive lock, only while kept(). Forgets the totals once the rounding bound has grown
  /// from rows that came and went many times over (16 times what the rows weigh): the next query sums afresh.
  void update(const KernelTable& kernels, const float* keys, const float* values, std::size_t rows, std::size_t d,
              std::size_t dv, float sign);
  /// Forgets the totals (a restore replaced the rows): the next query sums them afresh.
  void clear() noexcept;

 private:
  struct State;  // the sums and their bounds (value_moments.cpp)
  mutable std::mutex mutex_;  // orders the first sum between concurrent queries
  mutable std::atomic<bool> ready_{false};
  mutable std::unique_ptr<State> state_;
  mutable std::size_t rows_ = 0;
};

}  // namespace softkv::detail
