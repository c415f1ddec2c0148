// The kernel interface every instruction-set path implements: one table of plain function pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

#include "softkv/precision.hpp"

namespace softkv::detail {

/// Rows a scan streams through in one block: keys and values of a block stay in L2 between passes.
inline constexpr std::size_t kScanBlockRows = 256;

/// Batched kernels keep B queries side by side in "lanes" (query b is lane b); the lane count is B
/// rounded up to a multiple of this, so every instruction set's vectors tile it exactly.
inline constexpr std::size_t kBatchLanes = 16;

/// Lanes used for nq queries.
constexpr std::size_t batch_lanes(std::size_t nq) { return (nq + kBatchLanes - 1) / kBatchLanes * kBatchLanes; }

/// Floats of scratch a batched kernel needs for nq queries of dimension d: the transposed queries
/// (d x lanes), one block of scores (kScanBlockRows x lanes) and three per-lane vectors.
constexpr std::size_t batch_scratch_floats(std::size_t nq, std::size_t d) { return batch_lanes(nq) * (d + kScanBlockRows + 3); }

/// A contiguous slice of a collection's storage (row-major keys and values, each at its precision).
/// Single-query kernels convert compact elements to float32 in registers inside their dot products
/// and blends; batched kernels widen a chunk of rows into L1 scratch and run their float32 tiles on it.
/// Both are exact (every f16, bf16 and power-of-two-scaled i8 element is a float32).
struct RowSpan {
  const void* keys = nullptr;      ///< rows x dim elements of key_precision
  const void* values = nullptr;    ///< rows x value_dim elements of value_precision (may be null for key-only scans)
  const std::uint64_t* ids = nullptr;  ///< rows ids, for tie-breaking and contributors
  std::size_t rows = 0;            ///< number of rows
  std::size_t dim = 0;             ///< d
  std::size_t value_dim = 0;       ///< dv
  Precision key_precision = Precision::f32;    ///< element type of keys
  Precision value_precision = Precision::f32;  ///< element type of values
  const float* key_scales = nullptr;           ///< i8 keys: one scale per row (key = q * scale)

  /// Bytes of one key row.
  [[nodiscard]] std::size_t key_row_bytes() const noexcept { return dim * bytes_of(key_precision); }
  /// Bytes of one value row.
  [[nodiscard]] std::size_t value_row_bytes() const noexcept { return value_dim * bytes_of(value_precision); }
  /// Rows [begin, begin + count) as a span of their own.
  [[nodiscard]] RowSpan sub(std::size_t begin, std::size_t count) const noexcept {
    RowSpan s = *this;
    s.keys = static_cast<const char*>(keys) + begin * key_row_bytes();
    s.values = values != nullptr ? static_cast<const char*>(values) + begin * value_row_bytes() : nullptr;
    s.ids = ids != nullptr ? ids + begin : nullptr;
    s.key_scales = key_scales != nullptr ? key_scales + begin : nullptr;
    s.rows = count;
    return s;
  }
  /// The float32 keys of an f32 span (null otherwise).
  [[nodiscard]] const float* f32_keys() const noexcept { return key_precision == Precision::f32 ? static_cast<const float*>(keys) : nullptr; }
  /// Bytes per element at precision p.
  static constexpr std::size_t bytes_of(Precision p) noexcept { return p == Precision::f32 ? 4 : p == Precision::i8 ? 1 : 2; }
};

/// Receives each block's scores during a soft scan (used to collect the top-m contributors).
class ScoreSink {
 public:
  /// scores[i] belongs to row first_row + i of the scanned span.
  virtual void offer(const float* scores, std::size_t first_row, std::size_t count) = 0;

 protected:
  ~ScoreSink() = default;
};

/// Best score seen so far and its row; row == kNoRow before any row with a score above -inf is seen.
/// A score of +inf or NaN (the true score left the float range) sets overflow instead: it has no
/// place in the ranking, and the query must fail as a soft query would (numeric_overflow).
struct ArgMax {
  static constexpr std::size_t kNoRow = std::numeric_limits<std::size_t>::max();
  float score = -std::numeric_limits<float>::infinity();  ///< s = scale * (q . k), as the soft scan computes it
  std::size_t row = kNoRow;                               ///< row within the scanned span
  bool overflow = false;                                  ///< some score was +inf or NaN
};

/// The two products of a batch block, lane-major (query b is lane b; primitives_scalar.hpp states
/// them): where a batch pass spends its flops. Each kernel path has its own (register tiles); a JIT
/// GEMM may stand in for either on the CPU's native path where it measured faster (tile_gemm.hpp).
struct TileProducts {
  /// s[r * lanes + b] = sum_i k[r * d + i] * qt[i * lanes + b] for rows x lanes (s overwritten).
  void (*scores)(const float* qt, std::size_t lanes, const float* k, std::size_t rows, std::size_t d, float* s);
  /// acc[q * dv + c] += sum_r w[r * lanes + q] * v[r * dv + c] for q < nq and c < dv.
  void (*blend)(const float* w, std::size_t lanes, std::size_t nq, const float* v, std::size_t rows, std::size_t dv,
                float* acc);
};

/// One drawn block folded into an estimate's running sums (estimate.cpp, control variates): per coordinate
/// k < dv, x = u[k] - rows ubar[k], y = (sv[k] - sigma ubar[k] - rows sbar[k]) sv_on and a = acc[k] fa,
/// then su += x, ss += y, suu += x x, sus += x y, sss += y y, sut += x a, suw += x w, sst += y a,
/// ssw += y w (each [k]; the ten arrays distinct).
struct MomentFold {
  std::size_t dv = 0;                                    ///< coordinates
  double rows = 0, sigma = 0, sv_on = 0, fa = 0, w = 0;  ///< the block's rows, sum of scores, whether y counts, acc's factor, weight
  const float *u = nullptr, *sv = nullptr, *acc = nullptr;  ///< the block's U_b, S_b and blend accumulator
  const double *ubar = nullptr, *sbar = nullptr;            ///< the known means per row
  double *su = nullptr, *ss = nullptr, *suu = nullptr, *sus = nullptr, *sss = nullptr;  ///< running sums
  double *sut = nullptr, *suw = nullptr, *sst = nullptr, *ssw = nullptr;               ///< running sums with the weights
};

/// One drawn block's residuals under each coordinate's model, weighted by leverage (estimate.cpp's
/// leverage check): per k < dv, with x, y as in MomentFold (x = y = 0 where u is null), a = acc[k] fa,
/// e = a - r[k] w - beta1[k] x - beta2[k] y and h = hw + i11[k] x x + 2 i12[k] x y + i22[k] y y capped at
/// cap, out[k] += e e / (1 - h)^2.
struct LeverageFold {
  std::size_t dv = 0;                                             ///< coordinates
  double rows = 0, sigma = 0, sv_on = 0, fa = 0, w = 0, hw = 0, cap = 0;  ///< as MomentFold; hw: the weight's own leverage; cap: h's largest
  const float *u = nullptr, *sv = nullptr, *acc = nullptr;       ///< the block's U_b, S_b (null: no control variates) and accumulator
  const double *ubar = nullptr, *sbar = nullptr;                 ///< the known means per row (with u)
  const double *r = nullptr, *beta1 = nullptr, *beta2 = nullptr;  ///< each coordinate's ratio and coefficients
  const double *i11 = nullptr, *i12 = nullptr, *i22 = nullptr;     ///< each coordinate's inverse Gram matrix
  double* out = nullptr;                                          ///< the leverage-weighted sums
};

/// Where KernelTable::value_sums adds a block's sums (each dv floats, added to what is there).
struct ValueSums {
  float *u = nullptr, *sv = nullptr, *a = nullptr;  ///< sum v, sum s v, sum |v|
  const float* centre = nullptr;                    ///< dv: the centre of sq
  float* sq = nullptr;                              ///< sum (v - centre)^2
  float shift = 0;                                  ///< value_sums returns sum exp(2 (s - shift)); shift >= every score
};

/// One instruction set's kernels. All pointers are non-null.
///
/// Every single-query kernel computes a row's score the same way, s = scale * dot(q, k) in one
/// shared routine, so soft, hard, top-k and rescoring see bit-identical scores (the flat index's
/// tail bound rests on this). Callers pass the query and scale split by split_scale (scan.hpp).
struct KernelTable {
  std::string_view name;  ///< "scalar", "sse2", "avx2", "avx512"

  /// Inner product of two n-float vectors.
  float (*dot)(const float* a, const float* b, std::size_t n);

  /// scores[r] = scale * dot(query, key r) for the span's rows (keys only), as every scan scores them.
  void (*scores)(const float* query, float scale, const RowSpan& span, float* scores);

  /// scores(queries + i * dim, scales[i], span, out + i * stride) for i < nq, the same bits, each row
  /// read and widened once for several queries (register tiles of queries x rows): batched bounds.
  void (*scores_multi)(const float* queries, std::size_t nq, const float* scales, const RowSpan& span, float* out,
                       std::size_t stride);

  /// One streaming pass with an online softmax over span; updates the partial state
  /// (max, sum, acc[value_dim]) in place. sink may be null.
  void (*soft_scan)(const float* query, float scale, const RowSpan& span, float& max, float& sum,
                    float* acc, ScoreSink* sink);

  /// The same for nq row-major queries at once, query b with its own scales[b]; max, sum have nq
  /// entries, acc nq x value_dim. scratch holds batch_scratch_floats(nq, dim) floats. The two tile
  /// products go through `tiles` (this path's own, or tiles_for's choice).
  void (*soft_scan_batch)(const float* queries, std::size_t nq, const float* scales, const RowSpan& span,
                          float* max, float* sum, float* acc, float* scratch, const TileProducts& tiles);

  /// Argmax of s = scale * (q . k) over span (keys only); ties go to the smaller id. Updates best in place.
  void (*hard_scan)(const float* query, float scale, const RowSpan& span, ArgMax& best);

  /// The same for nq queries with scales[b] each; best has nq entries; scratch holds
  /// batch_scratch_floats(nq, dim) floats; the scores through tiles.scores.
  void (*hard_scan_batch)(const float* queries, std::size_t nq, const float* scales, const RowSpan& span,
                          ArgMax* best, float* scratch, const TileProducts& tiles);

  /// A pass over the keys only that offers every block's scores to sink (a fused score + top-k pass).
  void (*top_scan)(const float* query, float scale, const RowSpan& span, ScoreSink& sink);

  /// Multi-head soft scan, each row read once for all heads: head j scores query slice j
  /// (dim / heads floats at j * dim / heads, split with scales[j]) against key slice j exactly as
  /// soft_scan scores a row, and blends value slice j into acc[j * dv/heads ..] with its own online
  /// softmax (max[j], sum[j]). sinks is null or holds heads sinks (each may be null).
  void (*soft_scan_heads)(const float* query, const float* scales, std::size_t heads, const RowSpan& span,
                          float* max, float* sum, float* acc, ScoreSink* const* sinks);

  /// Multi-head argmax (keys only): best[j] is head j's, scored like soft_scan_heads.
  void (*hard_scan_heads)(const float* query, const float* scales, std::size_t heads, const RowSpan& span, ArgMax* best);

  /// u[c] += sum_r v_r[c], sv[c] += sum_r s[r] v_r[c], a[c] += sum_r |v_r[c]| and sq[c] += sum_r
  /// (v_r[c] - centre[c])^2 over span's rows in order (values at their precision; each sum rounds once a
  /// row); returns sum_r exp(2 (s[r] - shift)), the squared weights: the
  /// block sample's control-variate sums, what bounds their rounding and its unseen-spread term (estimate.cpp).
  float (*value_sums)(const float* s, const RowSpan& span, const ValueSums& out);

  /// Folds one drawn block into the running sums (MomentFold), in double, in this path's vectors.
  void (*fold_moments)(const MomentFold& fold);

  /// Adds one drawn block's leverage-weighted squared residuals (LeverageFold), in this path's vectors.
  void (*fold_leverage)(const LeverageFold& fold);

  /// This path's own tile products (P::scores_block, P::blend_block).
  TileProducts tiles;
};

/// scale * (q . k) over key elements [first, first + count) of row `row` of span, the products and
/// their sum in double, rounded once to float: what every kernel puts in place of a score that came
/// out non-finite. A float sum q'.k can leave the float range (keys near FLT_MAX / d) where the score
/// itself, scaled down, is representable; in double it cannot (|q'.k| <= d * FLT_MAX^2 < DBL_MAX), so
/// the result is +-inf only where the true score is beyond FLT_MAX. Out of line (generic code), so
/// that every kernel path calls the same instructions.
float score_in_double(const float* q, float scale, const RowSpan& span, std::size_t row, std::size_t first,
                      std::size_t count);

/// Tables of the compiled paths; each exists in every build, callable only if the CPU supports it.
const KernelTable& scalar_kernels();
const KernelTable& sse2_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

/// The active table: the widest the CPU supports, or the one forced by SOFTKV_SIMD / force_simd_path.
const KernelTable& kernels();

/// The widest table the CPU supports, whatever SOFTKV_SIMD or force_simd_path chose.
const KernelTable& native_kernels();

/// The table named name if this CPU can run it, else null.
const KernelTable* kernels_named(std::string_view name);

}  // namespace softkv::detail
