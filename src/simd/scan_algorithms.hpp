// The scan algorithms, written once over a primitives policy P and instantiated per instruction set.
//
// P provides: dot, max, exp_shifted, scale, axpy, and for the batched scans scores_block,
// column_max, exp_columns, blend_block over lane-major blocks (see primitives_scalar.hpp for the
// reference semantics). Include this only from a kernels_*.cpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

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
    const float* keys = span.keys + start * d;
    for (std::size_t r = 0; r < rows; ++r) scores[r] = scale * P::dot(q, keys + r * d, d);
    raise_max<P>(P::max(scores, rows), max, sum, acc, dv);
    sum += P::exp_shifted(scores, rows, max, weights);
    if (sink != nullptr) sink->offer(scores, start, rows);
    const float* values = span.values + start * dv;
    for (std::size_t r = 0; r < rows; ++r) P::axpy(acc, weights[r], values + r * dv, dv);
  }
}

// qt[i * lanes + b] = factor * q_b[i]: queries side by side in lanes; lanes past nq are zero.
inline void transpose_queries(const float* q, std::size_t nq, std::size_t d, float factor, float* qt,
                              std::size_t lanes) {
  for (std::size_t i = 0; i < d; ++i) {
    float* row = qt + i * lanes;
    for (std::size_t b = 0; b < nq; ++b) row[b] = factor * q[b * d + i];
    for (std::size_t b = nq; b < lanes; ++b) row[b] = 0.0f;
  }
}

// nq queries: each block of keys and values is read once for all of them (compute-bound). The
// queries sit in lanes, so scores come out as rows x lanes: the scale is folded into the queries
// once, and the block max, the exponentials and their sums run down the columns with whole vectors.
template <class P>
void soft_scan_batch(const float* queries, std::size_t nq, float scale, const RowSpan& span, float* max,
                     float* sum, float* acc, float* scratch) {
  const std::size_t d = span.dim;
  const std::size_t dv = span.value_dim;
  const std::size_t lanes = batch_lanes(nq);
  float* qt = scratch;                                  // d x lanes
  float* scores = qt + d * lanes;                       // kScanBlockRows x lanes; exponentiated in place
  float* shift = scores + kScanBlockRows * lanes;       // per lane: the running max (0 on padding lanes)
  float* block = shift + lanes;                         // per lane: this block's max, then its sum
  transpose_queries(queries, nq, d, scale, qt, lanes);
  for (std::size_t b = 0; b < lanes; ++b) shift[b] = 0.0f;
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    P::scores_block(qt, lanes, span.keys + start * d, rows, d, scores);
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

// Keeps the better of (dot, row) by the hard-retrieval rule: higher dot, then smaller id.
inline void offer_argmax(float dot, std::size_t row, const std::uint64_t* ids, ArgMax& best) {
  if (dot > best.dot || (dot == best.dot && best.row != ArgMax::kNoRow && ids[row] < ids[best.row])) {
    best.dot = dot;
    best.row = row;
  }
}

template <class P>
void hard_scan(const float* q, const RowSpan& span, ArgMax& best) {
  const std::size_t d = span.dim;
  for (std::size_t r = 0; r < span.rows; ++r) offer_argmax(P::dot(q, span.keys + r * d, d), r, span.ids, best);
}

template <class P>
void hard_scan_batch(const float* queries, std::size_t nq, const RowSpan& span, ArgMax* best, float* scratch) {
  const std::size_t d = span.dim;
  const std::size_t lanes = batch_lanes(nq);
  float* qt = scratch;
  float* scores = qt + d * lanes;
  transpose_queries(queries, nq, d, 1.0f, qt, lanes);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    P::scores_block(qt, lanes, span.keys + start * d, rows, d, scores);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t b = 0; b < nq; ++b) offer_argmax(scores[r * lanes + b], start + r, span.ids, best[b]);
  }
}

// The table for one primitives policy; each kernels_*.cpp calls this once with its own P.
template <class P>
KernelTable make_table(std::string_view name) {
  return KernelTable{name, &P::dot, &soft_scan<P>, &soft_scan_batch<P>, &hard_scan<P>, &hard_scan_batch<P>};
}

}  // namespace softkv::detail::scan
