// Sums of the values per chunk of rows, kept lazily: the known totals of a masked block sample (the sum v_j
// and sum v_j^2 over the eligible rows), which a mask made of long runs (a causal range of tags over rows
// stored in order) covers mostly with whole chunks (estimate.hpp; docs/PRUNING.md, "Masks").
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "scan.hpp"
#include "value_moments.hpp"

namespace softkv::detail {

/// The totals of a set of eligible rows, owning their sums: view() is the MomentTotals a masked block
/// sample reads (sum v_j and sum v_j^2 with their rounding bounds; sum k_j v_j^T and sum k_j with theirs
/// where every part kept them: the per-tag sums of small d x dv).
struct EligibleTotals {
  std::vector<double> value_sum, value_square;  ///< dv each
  std::size_t rows = 0;                         ///< the eligible rows (0: no totals)
  double value_error = 0, value_square_error = 0;
  std::vector<double> key_value;  ///< d x dv, row i: sum of k_ji v_j (empty: no key totals)
  std::vector<double> key_sum;    ///< d: sum of k_j (with key_value)
  double key_value_error = 0;     ///< >= |key_value[e] - the exact sum| for every element
  double key_value_abs = 0;       ///< >= |key_value[e]| and the exact sum, for every element
  double key_sum_error = 0;       ///< >= |key_sum[i] - the exact sum| for every i
  double key_norm_max = 0;        ///< >= max ||k_j||_2 over the rows
  /// The totals as the sample reads them (valid while this object lives).
  [[nodiscard]] MomentTotals view() const;
};

/// Largest d x dv whose sums of k_j v_j^T a chunk or a tag keeps ((d x dv + d) doubles: at most 16 KiB).
inline constexpr std::size_t kKeySumElements = 1024;

/// Whether chunks and tags keep KeySums for rows of d x dv: d x dv <= kKeySumElements and at most 4 (d + dv)
/// (a row's products cost at most four multiply-adds per element read), so for few value coordinates,
/// where the y_b control variate matters most (one coordinate: docs/PRUNING.md).
[[nodiscard]] constexpr bool keeps_key_sums(std::size_t d, std::size_t dv) noexcept {
  return d > 0 && d * dv <= kKeySumElements && d * dv <= 4 * (d + dv);
}

/// Whether KeySums over `rows` rows summed at a query (a mask's rows outside whole chunks, or excluded rows)
/// fit its budget: their products at most what reading `limit` whole rows reads, rows x d x dv <= limit x (d + dv).
[[nodiscard]] constexpr bool key_sums_fit(std::size_t rows, std::size_t limit, std::size_t d, std::size_t dv) noexcept {
  return rows * d * dv <= limit * (d + dv);
}

/// Sums over some rows of k_j v_j^T and k_j in double (products of floats, exact in double), with what
/// bounds their rounding: kv_mass >= sum over the rows of |k_ji v_jc| for every (i, c), k_mass >= sum of
/// |k_ji| for every i (each sum's error is at most rows x 2^-53 x its mass), and the rows' largest ||k_j||.
struct KeySums {
  std::vector<double> key_value, key_sum;  ///< d x dv, d (empty: not kept)
  double rows = 0, kv_mass = 0, k_mass = 0, norm_max = 0;
  /// Whether these sums are kept.
  [[nodiscard]] bool kept() const noexcept { return !key_sum.empty(); }
  /// Starts the sums of d x dv at zero, kept if keep (keeps_key_sums by default).
  void reset(std::size_t d, std::size_t dv, bool keep);
  /// The same, kept as keeps_key_sums(d, dv) says.
  void reset(std::size_t d, std::size_t dv) { reset(d, dv, keeps_key_sums(d, dv)); }
  /// Adds one row (key of d floats, value of dv floats).
  void add(const float* key, const float* value);
  /// Adds rows [begin, end) of span, as stored (if kept). key, value: scratch.
  void add_rows(const RowSpan& span, std::size_t begin, std::size_t end, std::vector<float>& key, std::vector<float>& value);
};

/// Adds rows [begin, end) of span, as stored, into sum and square (dv each, in double); returns their
/// largest |v_j|. row: scratch of dv floats.
double add_rows(const RowSpan& span, std::size_t begin, std::size_t end, double* sum, double* square, std::vector<float>& row);

/// EligibleTotals added up from parts (a chunk's, a tag's or loose rows' double sums of v_j and v_j^2), each
/// with its rows and largest |v_j|, with a bound on every rounding: each part's own and their adding together.
class TotalsSum {
 public:
  explicit TotalsSum(std::size_t dv);
  /// Adds a part: sum and square (dv each) over `rows` rows whose largest |v_j| is abs_max.
  void add(const double* sum, const double* square, double rows, double abs_max);
  /// With the part just added, its key sums (KeySums of the same rows); the totals keep key sums only if
  /// every part gave them.
  void add_keys(const KeySums& keys);
  /// The totals over `rows` rows (the parts' together), or empty ones if a bound left the double range
  /// (values near FLT_MAX squared).
  [[nodiscard]] EligibleTotals finish(std::size_t rows);

 private:
  EligibleTotals out_;
  double abs_max_ = 0, parts_ = 0;
  double key_parts_ = 0, kv_mass_ = 0, k_mass_ = 0;  // parts with key sums; their masses (KeySums)
};

/// Per chunk of kRows rows in storage order, sum v_j and sum v_j^2 per coordinate in double, with the
/// chunk's largest |v_j| (and KeySums where keeps_key_sums); a write marks its rows' chunks stale (touch, under the collection's exclusive
/// lock) and a query sums the stale chunks it needs again (under the collection's shared lock and a mutex
/// of its own).
class ValueChunks {
 public:
  /// Rows per chunk (a chunk's sums take 16 dv bytes, 2 MiB at 1M rows of dv = 128; and 8 (d x dv + d)
  /// more where keeps_key_sums).
  static constexpr std::size_t kRows = 1024;
  /// Row `row` was written, moved or removed: its chunk's sums are stale.
  void touch(std::size_t row) noexcept;
  /// Every chunk is stale (a restore replaced the rows).
  void clear() noexcept;
  /// The totals over the eligible rows of span: whole chunks from their sums (summed again where stale),
  /// the other eligible rows summed now. Empty (rows 0) when those other rows number more than
  /// loose_limit (summing them would cost a share of the sample it serves), or when the stale chunks it
  /// covers hold more than stale_limit rows: it then sums stale chunks up to that many rows (a mask's
  /// first queries warm its chunks a share at a time, each query's cost bounded) and returns none.
  [[nodiscard]] EligibleTotals totals(const RowSpan& span, const EligibleRows& eligible, std::size_t loose_limit,
                                      std::size_t stale_limit) const;

 private:
  struct Chunk {
    std::vector<double> sum, square;  // dv each (empty: never summed)
    KeySums keys;                     // sum k v^T and sum k (where keeps_key_sums)
    double abs_max = 0;               // the chunk's largest |v_j|
    bool fresh = false;               // sums match the rows
  };
  mutable std::mutex mutex_;
  mutable std::vector<Chunk> chunks_;
  mutable bool all_stale_ = false;  // a touch could not grow chunks_: every chunk is stale
};

}  // namespace softkv::detail
