// The scan algorithms, written once over a primitives policy P and instantiated per instruction set.
//
// P provides: dot, max, exp_shifted, scale, axpy, and for the batched scans scores_block,
// scale_columns, column_max, exp_columns, blend_block over lane-major blocks (see primitives_scalar.hpp for the
// reference semantics). Include this only from a kernels_*.cpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernel_table.hpp"

namespace softkv::detail::scan {

// Rescales a partial state so that its running max becomes new_max (>= the old max).
template <class P>
inline void raise_max(float new_max, float& max, float& sum, float* acc, std::size_t dv) {
  if (!(new_max > max)) return;
  if (sum > 0.0f) {  // an empty state (max = -inf) has nothing to rescale
    const float factor = std::exp(max - new_max);
    P::scale(acc, factor, dv);
    sum *= factor;
  }
  max = new_max;
}

// The one place a single query's scores are computed: every kernel below calls it, so soft, hard,
// top-k and rescoring see the same bits for the same row. Not inlined, so that no caller's context
// can change how the compiler contracts it.
template <class P>
[[gnu::noinline]] void score_rows(const float* q, float scale, const float* keys, std::size_t rows, std::size_t d,
                                  float* scores) {
  for (std::size_t r = 0; r < rows; ++r) scores[r] = scale * P::dot(q, keys + r * d, d);
}

template <class P>
void score_span(const float* q, float scale, const RowSpan& span, float* out) {
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_rows<P>(q, scale, span.keys + start * span.dim, rows, span.dim, out + start);
  }
}

// Single query: per block, a key pass (scores), one exp pass, a value pass; each row read once.
template <class P>
void soft_scan(const float* q, float scale, const RowSpan& span, float& max, float& sum, float* acc,
               ScoreSink* sink) {
  alignas(64) float scores[kScanBlockRows];
  alignas(64) float weights[kScanBlockRows];
  const std::size_t d = span.dim;
  const std::size_t dv = span.value_dim;
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_rows<P>(q, scale, span.keys + start * d, rows, d, scores);
    raise_max<P>(P::max(scores, rows), max, sum, acc, dv);
    sum += P::exp_shifted(scores, rows, max, weights);
    if (sink != nullptr) sink->offer(scores, start, rows);
    const float* values = span.values + start * dv;
    for (std::size_t r = 0; r < rows; ++r) P::axpy(acc, weights[r], values + r * dv, dv);
  }
}

// Keys only: every block's scores go to the sink (the flat index keeps its top k there).
template <class P>
void top_scan(const float* q, float scale, const RowSpan& span, ScoreSink& sink) {
  alignas(64) float scores[kScanBlockRows];
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_rows<P>(q, scale, span.keys + start * span.dim, rows, span.dim, scores);
    sink.offer(scores, start, rows);
  }
}

// qt[i * lanes + b] = q_b[i]: queries side by side in lanes; lanes past nq are zero.
inline void transpose_queries(const float* q, std::size_t nq, std::size_t d, float* qt, std::size_t lanes) {
  for (std::size_t i = 0; i < d; ++i) {
    float* row = qt + i * lanes;
    for (std::size_t b = 0; b < nq; ++b) row[b] = q[b * d + i];
    for (std::size_t b = nq; b < lanes; ++b) row[b] = 0.0f;
  }
}

// nq queries: each block of keys and values is read once for all of them (compute-bound). The
// queries sit in lanes, so scores come out as rows x lanes; each lane's scale multiplies its dot
// products afterwards, as in the single-query scan (folding it into the query could overflow where
// the single path does not), and the block max, the exponentials and their sums run down the
// columns with whole vectors.
template <class P>
void soft_scan_batch(const float* queries, std::size_t nq, const float* scales, const RowSpan& span, float* max,
                     float* sum, float* acc, float* scratch) {
  const std::size_t d = span.dim;
  const std::size_t dv = span.value_dim;
  const std::size_t lanes = batch_lanes(nq);
  float* qt = scratch;                                  // d x lanes
  float* scores = qt + d * lanes;                       // kScanBlockRows x lanes; exponentiated in place
  float* shift = scores + kScanBlockRows * lanes;       // per lane: the running max (0 on padding lanes)
  float* block = shift + lanes;                         // per lane: this block's max, then its sum
  float* factor = block + lanes;                        // per lane: the scale (0 on padding lanes)
  transpose_queries(queries, nq, d, qt, lanes);
  for (std::size_t b = 0; b < lanes; ++b) {
    shift[b] = 0.0f;
    factor[b] = b < nq ? scales[b] : 0.0f;
  }
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    P::scores_block(qt, lanes, span.keys + start * d, rows, d, scores);
    P::scale_columns(scores, rows, lanes, factor);
    P::column_max(scores, rows, lanes, block);
    for (std::size_t b = 0; b < nq; ++b) {
      raise_max<P>(block[b], max[b], sum[b], acc + b * dv, dv);
      shift[b] = max[b];
    }
    P::exp_columns(scores, rows, lanes, shift, block);
    for (std::size_t b = 0; b < nq; ++b) sum[b] += block[b];
    P::blend_block(scores, lanes, nq, span.values + start * dv, rows, dv, acc);
  }
}

// Keeps the better of (score, row) by the hard-retrieval rule: higher score, then smaller id. A
// score of +inf or NaN is no answer but an overflow; -inf (a true score below -FLT_MAX) never wins.
inline void offer_argmax(float score, std::size_t row, const std::uint64_t* ids, ArgMax& best) {
  if (score >= best.score) {
    if (score == std::numeric_limits<float>::infinity()) {
      best.overflow = true;
    } else if (score > best.score || (best.row != ArgMax::kNoRow && ids[row] < ids[best.row])) {
      best.score = score;
      best.row = row;
    }
  } else if (std::isnan(score)) {
    best.overflow = true;
  }
}

template <class P>
void hard_scan(const float* q, float scale, const RowSpan& span, ArgMax& best) {
  alignas(64) float scores[kScanBlockRows];
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_rows<P>(q, scale, span.keys + start * span.dim, rows, span.dim, scores);
    for (std::size_t r = 0; r < rows; ++r) offer_argmax(scores[r], start + r, span.ids, best);
  }
}

// Scores each block for all queries, then screens it with whole vectors: per lane the block's max
// and sum. A lane whose sum is finite (so every score in it is) and whose max is below its best so
// far cannot change its answer and is skipped; only the other lanes walk their column through
// offer_argmax, which after the first blocks is rare. The scores are the same products
// scale * dot as before the screening, so the answers are bit for bit those of the row-by-row walk.
template <class P>
void hard_scan_batch(const float* queries, std::size_t nq, const float* scales, const RowSpan& span, ArgMax* best,
                     float* scratch) {
  const std::size_t d = span.dim;
  const std::size_t lanes = batch_lanes(nq);
  float* qt = scratch;                             // d x lanes
  float* scores = qt + d * lanes;                  // kScanBlockRows x lanes, scaled in place
  float* top = scores + kScanBlockRows * lanes;    // per lane: the block's max
  float* total = top + lanes;                      // per lane: the block's sum
  float* factor = total + lanes;                   // per lane: the scale (0 on padding lanes)
  transpose_queries(queries, nq, d, qt, lanes);
  for (std::size_t b = 0; b < lanes; ++b) factor[b] = b < nq ? scales[b] : 0.0f;
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    P::scores_block(qt, lanes, span.keys + start * d, rows, d, scores);
    P::scale_columns(scores, rows, lanes, factor);
    P::column_max_sum(scores, rows, lanes, top, total);
    for (std::size_t b = 0; b < nq; ++b) {
      if (std::isfinite(total[b]) && top[b] < best[b].score) continue;
      for (std::size_t r = 0; r < rows; ++r) offer_argmax(scores[r * lanes + b], start + r, span.ids, best[b]);
    }
  }
}

// The table for one primitives policy; each kernels_*.cpp calls this once with its own P.
template <class P>
KernelTable make_table(std::string_view name) {
  return KernelTable{name,         &P::dot,           &score_span<P>,       &soft_scan<P>,
                     &soft_scan_batch<P>, &hard_scan<P>, &hard_scan_batch<P>, &top_scan<P>};
}

}  // namespace softkv::detail::scan
