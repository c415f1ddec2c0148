// The multi-head scans, written once over a primitives policy P like scan_algorithms.hpp (whose
// helpers they share): one key pass scores every head of a block, one value pass blends every head's
// slice. Include this only from a kernels_*.cpp (through make_table.hpp).
#pragma once

#include "scan_algorithms.hpp"

namespace softkv::detail::scan {

// score_heads_rows where heads is a multiple of 8 and a slice is DH floats (whole vectors): each
// group of eight heads' chains is reduced together (P::reduce8) into a row of heads scores, and the
// block's rows are transposed to the head-major layout at the end. The same chains and lane pairs as
// dot_as, so the same bits as scoring the slices one at a time.
template <class P, Precision KP, std::size_t DH>
void score_heads_joint(const float* q, const float* scales, std::size_t heads, const RowSpan& span, std::size_t start,
                       std::size_t rows, float* scores) {
  constexpr std::size_t bytes = RowSpan::bytes_of(KP);
  const std::size_t row_bytes = span.key_row_bytes();
  const char* keys = static_cast<const char*>(span.keys) + start * row_bytes;
  Prefetcher pf = key_prefetcher(span, start);
  thread_local std::vector<float> by_row;  // rows x heads, row-major
  if (by_row.size() < rows * heads) by_row.resize(rows * heads);
  // i8 rows: the scales whose products are summed unscaled (P::chains_as); the whole query's window holds
  // for each head's slice (no larger maximum, no smaller minimum).
  I8Deferral deferral;
  if constexpr (KP == Precision::i8) deferral = P::i8_deferral(q, span.dim);
  for (std::size_t r = 0; r < rows; ++r) {
    const float row_scale = KP == Precision::i8 ? span.key_scales[start + r] : 1.0f;
    const bool defer = deferral.covers(row_scale);
    const char* k = keys + r * row_bytes;
    pf.upto(k + row_bytes);
    for (std::size_t g = 0; g < heads; g += 8) {
      typename P::V v[8];
      for (std::size_t h = 0; h < 8; ++h) {
        v[h] = P::template chains_as<KP>(q + (g + h) * DH, k + (g + h) * DH * bytes, DH, row_scale, defer);
        // On AVX-512 the compiler interleaved the eight heads' loads, reading a 2 KiB row's lines out
        // of address order (the first KiB scrambled, then a stall on the second); a compiler barrier
        // per head keeps them in order. Zen 5, d = 512, h = 8, 250k rows, 7 alternating process pairs:
        // the hard pass went from 1.38x to 1.17x of the single-head scan on one thread (soft 1.20x ->
        // 1.10x) and 1.26x -> 1.22x on two. Not on AVX2, where three pairs read no better.
        if constexpr (P::W == 16) asm volatile("" ::: "memory");
      }
      P::reduce8(v, scales + g, by_row.data() + r * heads + g);
    }
  }
  P::transpose_heads(by_row.data(), rows, heads, scores, kScanBlockRows);
}

// Every head's scores of rows [start, start + rows), row by row (a row's key stays in L1 while its h
// slices are scored): head j's score of row r is the same product scale * dot as score_rows, over key
// slice j (width dh at offset j * dh), so a head scores what a collection of its slices alone would,
// bit for bit. Head j's scores go to scores[j * kScanBlockRows + r]. Not inlined, like score_rows.
template <class P, Precision KP>
[[gnu::noinline]] void score_heads_rows(const float* q, const float* scales, std::size_t heads, const RowSpan& span,
                                        std::size_t start, std::size_t rows, float* scores) {
  const std::size_t dh = span.dim / heads, row_bytes = span.key_row_bytes(), slice_bytes = row_bytes / heads;
  if constexpr (P::kJointHeads) {
    if (heads % 8 == 0) {
      constexpr std::size_t W = P::W;
      switch (dh) {  // the slice widths worth a compiled loop: the usual head sizes
        case 2 * W: return score_heads_joint<P, KP, 2 * W>(q, scales, heads, span, start, rows, scores);
        case 4 * W: return score_heads_joint<P, KP, 4 * W>(q, scales, heads, span, start, rows, scores);
        case 8 * W: return score_heads_joint<P, KP, 8 * W>(q, scales, heads, span, start, rows, scores);
        default: break;
      }
    }
  }
  const char* keys = static_cast<const char*>(span.keys) + start * row_bytes;
  Prefetcher pf = key_prefetcher(span, start);
  I8Deferral deferral;  // (as in score_heads_joint)
  if constexpr (KP == Precision::i8) deferral = P::i8_deferral(q, span.dim);
  for (std::size_t r = 0; r < rows; ++r) {
    const float row_scale = KP == Precision::i8 ? span.key_scales[start + r] : 1.0f;
    const bool defer = deferral.covers(row_scale);
    const char* k = keys + r * row_bytes;
    pf.upto(k + row_bytes);
    for (std::size_t j = 0; j < heads; ++j)
      scores[j * kScanBlockRows + r] = scales[j] * P::template dot_as<KP>(q + j * dh, k + j * slice_bytes, dh, row_scale, defer);
  }
}

template <class P>
void score_heads_block(const float* q, const float* scales, std::size_t heads, const RowSpan& span, std::size_t start,
                       std::size_t rows, float* scores) {
  with_precision(span.key_precision,
                 [&](auto kp) { score_heads_rows<P, decltype(kp)::value>(q, scales, heads, span, start, rows, scores); });
  const std::size_t dh = span.dim / heads;
  for (std::size_t j = 0; j < heads; ++j)
    repair_scores<P>(q + j * dh, scales[j], span, start, rows, scores + j * kScanBlockRows, j * dh, dh);
}

// Scratch of heads x kScanBlockRows floats, kept per thread (a masked scan calls per block).
inline float* head_scratch(std::size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

// Multi-head: per block one key pass scores every head, then each head's max and exponentials, then
// one value pass blends every head's slice; each row is read once for all heads.
template <class P>
void soft_scan_heads(const float* q, const float* scales, std::size_t heads, const RowSpan& span, float* max, float* sum,
                     float* acc, ScoreSink* const* sinks) {
  const std::size_t dvh = span.value_dim / heads;
  float* scores = head_scratch(2 * heads * kScanBlockRows);  // head j's block at j * kScanBlockRows
  float* weights = scores + heads * kScanBlockRows;
  BlockSums<P> part(span.value_dim);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_heads_block<P>(q, scales, heads, span, start, rows, scores);
    for (std::size_t j = 0; j < heads; ++j) {
      float* s = scores + j * kScanBlockRows;
      raise_max<P>(P::max(s, rows), max[j], sum[j], acc + j * dvh, dvh);
      sum[j] += P::exp_shifted(s, rows, exp_shift(max[j]), weights + j * kScanBlockRows);
      if (sinks != nullptr && sinks[j] != nullptr) sinks[j]->offer(s, start, rows);
    }
    blend_block<P>(part.begin(), weights, kScanBlockRows, heads, span, start, rows);
    part.end(acc);
  }
}

template <class P>
void hard_scan_heads(const float* q, const float* scales, std::size_t heads, const RowSpan& span, ArgMax* best) {
  float* scores = head_scratch(heads * kScanBlockRows);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_heads_block<P>(q, scales, heads, span, start, rows, scores);
    for (std::size_t j = 0; j < heads; ++j) {
      const float* s = scores + j * kScanBlockRows;
      if (rows == kScanBlockRows) {
        // A full block screened as 16 x 16 lanes (as hard_scan_batch screens): a finite sum means every
        // score is finite, and a max below the best so far cannot change the answer.
        alignas(64) float top[kBatchLanes], total[kBatchLanes];
        P::column_max_sum(s, kScanBlockRows / kBatchLanes, kBatchLanes, top, total);
        float m = -std::numeric_limits<float>::infinity(), t = 0.0f;
        for (std::size_t b = 0; b < kBatchLanes; ++b) m = top[b] > m ? top[b] : m, t += total[b];
        if (std::isfinite(t) && m < best[j].score) continue;
      }
      for (std::size_t r = 0; r < rows; ++r) offer_argmax(s[r], start + r, span.ids, best[j]);
    }
  }
}

}  // namespace softkv::detail::scan
