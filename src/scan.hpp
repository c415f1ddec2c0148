// Splits one scan over threads and merges the parts: (m, l, acc) by log-sum-exp, argmax by (score, id).
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "simd/kernel_table.hpp"
#include "softmax_state.hpp"
#include "top_scores.hpp"

namespace softkv::detail {

/// Key row r of span as float32 (exact for every precision: what the kernels score).
void key_row(const RowSpan& span, std::size_t r, float* out);
/// Value row r of span as float32.
void value_row(const RowSpan& span, std::size_t r, float* out);
/// Asks for key row r of span (keys: true) and value row r (values: true) ahead of a gather: rows read
/// out of storage order each miss the caches, and a gather that asks a few rows ahead overlaps the misses.
void prefetch_row(const RowSpan& span, std::size_t r, bool keys, bool values);
/// Rows a gather asks for ahead of the one it reads (prefetch_row).
inline constexpr std::size_t kGatherAhead = 8;
/// Value row r of span as a vector of value_dim floats.
std::vector<float> value_vector(const RowSpan& span, std::size_t r);

/// A softmax-weighted sum of value rows in double, folded one (score, value) at a time in any order
/// with its own running max: the slow path of a blend whose float accumulator overflowed. It keeps its
/// own max (not the scan's) because the scores it is given may round differently from those the scan
/// saw (a batch kernel sums in another order), and exp(s - max) of a max from elsewhere can be 0 or inf.
class DoubleBlend {
 public:
  explicit DoubleBlend(std::size_t n) : acc_(n, 0.0) {}
  /// Folds in value (n floats) with score s; a score of -inf has weight 0.
  void add(float s, const float* value);
  /// acc / sum as floats (within the values' range: a convex combination of them).
  [[nodiscard]] std::vector<float> value() const;

 private:
  double max_ = -std::numeric_limits<double>::infinity();
  double sum_ = 0.0;
  std::vector<double> acc_;
};

/// How many parts a scan of rows x floats_per_row should use: requested if non-zero, otherwise
/// enough that each part streams at least ~1 MiB, at most max_parts; never more than rows.
std::size_t choose_parts(std::size_t rows, std::size_t floats_per_row, std::size_t requested,
                         std::size_t max_parts);

/// The one rule for how a score s = scale * (q . k) is computed on every path (single, batch, hard,
/// top-k): the query is multiplied in place by a power of two 2^-e chosen so that its largest |q_i|
/// is near 1, and the returned factor is scale * 2^e, a normal float; every kernel then computes
/// s = factor * (q' . k). Both multiplications by 2^e are exact, so s carries only the rounding of the
/// float sum q' . k (relative to sum |q'_i k_i|) and of the last product; neither q . k (huge keys and
/// queries, tiny scale) nor scale * q (huge scale and query) can overflow on the way, and a sum q' . k
/// that does is redone in double (score_in_double). e is clamped so that factor stays a normal float.
float split_scale(std::span<float> query, float scale);

/// A run of consecutive rows [begin, begin + count).
struct RowRun {
  std::size_t begin = 0;  ///< first row
  std::size_t count = 0;  ///< rows in the run
};

/// The rows a scan visits, as runs in storage order: a mask's eligible rows (mask.hpp). Every scan
/// below takes one as `only`; null means every row of the span. Long runs are scanned in place, short
/// ones gathered into a block first (row_walk.hpp), and parts hold about equally many rows; a scan of
/// every row is the same scan over one run.
struct EligibleRows {
  std::vector<RowRun> runs;  ///< ascending, disjoint, non-adjacent
  std::size_t count = 0;     ///< rows in all runs: the N of the tail bound
};

/// The index in rows.runs of the run holding row, or rows.runs.size() when no run holds it (binary search).
std::size_t run_holding(const EligibleRows& rows, std::size_t row);

/// The merged softmax over span, its blended value and, if top_m > 0, its top_m rows (best first).
struct SoftScan {
  SoftmaxState state;                    ///< merged (m, l, acc)
  std::vector<TopScores::Item> top;      ///< best rows, empty unless requested
};

/// One query over span (or its rows `only`) in parts pieces (run on the shared pool), merged exactly.
/// top_m is clamped to the row count (nothing is reserved for contributors that cannot exist).
SoftScan soft_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                         std::size_t parts, std::size_t top_m, const EligibleRows* only = nullptr);

/// The blended value acc / sum of a merged state over span, dv floats. The float accumulator
/// overflows when values approach FLT_MAX / N although the answer, a convex combination of values,
/// is representable: then (and only then, it costs a second pass) the blend is redone over span in
/// double with the same scores. A state with a non-finite lse is returned as is (the caller reports
/// numeric_overflow). `only`: the rows the state was scanned over (the double pass reads only them).
std::vector<float> blended_value(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                 const SoftmaxState& state, const EligibleRows* only = nullptr);

/// Argmax over span (or its rows `only`) in parts pieces; the returned row is absolute within span.
ArgMax hard_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span, std::size_t parts,
                       const EligibleRows* only = nullptr);

/// nq queries (query b scaled by scales[b]) over span (or its rows `only`) in parts pieces; one merged
/// state per query.
std::vector<SoftmaxState> soft_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                                const float* scales, const RowSpan& span, std::size_t parts,
                                                const EligibleRows* only = nullptr);

/// nq queries as nq single queries (soft_scan_split with no top_m, bit for bit, query by query) that
/// read the rows from memory once: each chunk of rows (about 256 KiB, whole 256-row blocks) is scanned
/// by the single-query kernel for every query while it is in cache. One memory pass plus nq - 1 passes
/// over cached rows: for a few queries cheaper than the batch kernel, which pads them to 16 lanes.
std::vector<SoftmaxState> soft_scan_each_split(const KernelTable& k, const float* queries, std::size_t nq,
                                               const float* scales, const RowSpan& span, std::size_t parts,
                                               const EligibleRows* only = nullptr);

/// The same for argmaxes: hard_scan_split per query, bit for bit, the keys read from memory once.
std::vector<ArgMax> hard_scan_each_split(const KernelTable& k, const float* queries, std::size_t nq, const float* scales,
                                         const RowSpan& span, std::size_t parts, const EligibleRows* only = nullptr);

/// nq argmaxes over span (or its rows `only`) in parts pieces; rows are absolute within span.
std::vector<ArgMax> hard_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                          const float* scales, const RowSpan& span, std::size_t parts,
                                          const EligibleRows* only = nullptr);

/// The top k rows of span (or of its rows `only`) by score (higher score, then smaller id), from a
/// fused score + top-k pass over parts pieces; best first. Scores are bit-identical to the soft scan's.
std::vector<TopScores::Item> top_k_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                        std::size_t top_k, std::size_t parts, const EligibleRows* only = nullptr);

/// Merges two argmaxes of the same span by (score, smaller id); an overflow in either carries over.
void merge_argmax(const ArgMax& part, const std::uint64_t* ids, ArgMax& best);

}  // namespace softkv::detail
