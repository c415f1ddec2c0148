// The scan algorithms, written once over a primitives policy P and instantiated per instruction set.
//
// P provides: dot_as<Pr> and chains_as<Pr>, blend_rows<Pr> and blend_heads<Pr> (single-query products
// over rows stored at precision Pr, converted in registers), kJointHeads and, where it is true,
// reduce8 and transpose_heads (multi-head scoring), widen_f16, widen_bf16, widen_i8 (compact rows to
// float32, exactly, for the batched scans), dot, max, exp_shifted, scale, and for the batched scans
// scores_block, scale_columns, column_max, exp_columns, blend_block over lane-major blocks (see
// primitives_scalar.hpp for the reference semantics; scores_block and blend_block are the path's own
// TileProducts, and the batch scans call whichever TileProducts they are given: tile_gemm.hpp).
// Include this only from a kernels_*.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd/scan_tuning.hpp"
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

// The shift of a block's exponentials: the running max, or 0 while it is -inf (every score so far,
// this block's included, is below -FLT_MAX: exp(-inf - 0) = 0 weights them all 0, where exp(-inf -
// -inf) would be NaN).
inline float exp_shift(float max) { return max == -std::numeric_limits<float>::infinity() ? 0.0f : max; }

// Floats of scratch a kernel widens compact rows into: 16 KiB, so the widened rows stay in L1 between
// the conversion and the float32 loop (a whole 256-row block, 128 KiB, spilled to L2 and ran slower).
inline constexpr std::size_t kWidenFloats = 4096;

// Rows of a span as float32 for the batched scans, a chunk at a time: f32 rows are read in place,
// compact rows are widened into scratch with P's conversions (exact) and handed to the float32 tiles
// (a batch does many flops per element, so the widening is a small share of its work). A block goes to
// the tiles in chunks of at most kWidenFloats floats; float32 rows too where the tiles are not P's own: a
// GEMM's result can depend on how many rows one call gets (libxsmm's kernels add into C after their own
// k-loop), and compact rows answer bit for bit as float32 only if both take the same chunks. P's own
// tiles treat rows independently or in row order, so float32 rows reach them as one block.
template <class P>
class Widener {
 public:
  // fn(keys as float, first row of the chunk within the block, rows in the chunk)
  // (in_place: float32 rows go to fn as one block, for products whose result does not depend on the rows
  // a call gets, P's own tiles; other products get them in the compact rows' chunks.)
  template <class Fn>
  void keys(const RowSpan& s, std::size_t start, std::size_t rows, bool in_place, Fn&& fn) {
    run(s.keys, s.key_precision, s.key_scales, s.dim, start, rows, in_place, fn);
  }
  template <class Fn>
  void values(const RowSpan& s, std::size_t start, std::size_t rows, bool in_place, Fn&& fn) {
    run(s.values, s.value_precision, nullptr, s.value_dim, start, rows, in_place, fn);
  }

 private:
  template <class Fn>
  void run(const void* base, Precision p, const float* scales, std::size_t width, std::size_t start, std::size_t rows, bool in_place,
           Fn& fn) {
    if (p == Precision::f32 && in_place) {
      fn(static_cast<const float*>(base) + start * width, std::size_t{0}, rows);
      return;
    }
    std::size_t chunk = kWidenFloats / width;
    chunk = chunk < 1 ? 1 : chunk > kScanBlockRows ? kScanBlockRows : chunk;
    if (chunk > rows) chunk = rows;
    if (p == Precision::f32) {
      const float* rows_in_place = static_cast<const float*>(base) + start * width;
      for (std::size_t off = 0; off < rows; off += chunk)
        fn(rows_in_place + off * width, off, rows - off < chunk ? rows - off : chunk);
      return;
    }
    if (buffer_.size() < chunk * width) buffer_.resize(chunk * width);
    float* out = buffer_.data();
    const char* bytes = static_cast<const char*>(base) + start * width * RowSpan::bytes_of(p);
    for (std::size_t off = 0; off < rows; off += chunk) {
      const std::size_t n = rows - off < chunk ? rows - off : chunk;
      if (p == Precision::i8) {
        const auto* q = reinterpret_cast<const std::int8_t*>(bytes) + off * width;
        for (std::size_t r = 0; r < n; ++r) P::widen_i8(q + r * width, width, scales[start + off + r], out + r * width);
      } else {
        const auto* h = reinterpret_cast<const std::uint16_t*>(bytes) + off * width;
        if (p == Precision::f16) P::widen_f16(h, n * width, out);
        else P::widen_bf16(h, n * width, out);
      }
      fn(static_cast<const float*>(out), off, n);
    }
  }

  std::vector<float> buffer_;
};

// A block's blend summed on its own and then added to the running accumulator: a float sum of N rows
// chained in one accumulator rounds about N times (values with a common offset, against float64: a
// relative error of 5e-6 at 60,000 rows and 6.6e-4 at 1M, T = 0.5, before 2026-11-28); a block's own sum
// chains at most kScanBlockRows rows and the accumulator N / kScanBlockRows blocks (5e-7 and 2e-6): B + N / B
// additions for blocks of B rows handed to the kernel (shorter where a caller hands it shorter spans:
// multi-head batch pieces, a mask's short runs, the estimate's 32-row blocks). The partial sums live in
// per-thread scratch, zeroed by a plain loop. (A template on P, as every kernel helper here: one symbol
// per path.)
template <class P>
class BlockSums {
 public:
  explicit BlockSums(std::size_t floats) : floats_(floats) {}
  // Where the next block blends: the zeroed partial sum (the scratch fetched again at each block, so a
  // scan started between blocks on the same thread, e.g. from a sink, cannot leave it dangling).
  float* begin() {
    part_ = scratch(floats_);
    for (std::size_t c = 0; c < floats_; ++c) part_[c] = 0.0f;
    return part_;
  }
  // The block's partial sum joins acc.
  void end(float* __restrict acc) const {
    const float* __restrict part = part_;
    for (std::size_t c = 0; c < floats_; ++c) acc[c] += part[c];
  }

 private:
  static float* scratch(std::size_t floats) {
    thread_local std::vector<float> buffer;
    if (buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
  }

  std::size_t floats_;
  float* part_ = nullptr;
};

// Software prefetch of a stream of rows, some bytes ahead of the reads (ScanTuning::ahead) and up to the end of the part
// being scanned (not of the block: the next block's first rows are on their way when it starts). The
// hardware prefetchers stop at every 4 KiB page, and a row of d = 512 floats is half a page: without
// help a scan stalls at the start of every page. Two strides: kLine prefetches every line of the
// stream; kPage one line per 4 KiB, which starts the hardware prefetcher on each page before the reads
// reach it at 1/64 of the instructions. What each gained where: bench/analysis.md.
class Prefetcher {
 public:
  static constexpr std::size_t kLine = 64;
  static constexpr std::size_t kPage = 4096;
  // The stream [begin, end), prefetched stride bytes apart, ahead bytes ahead of the reads.
  Prefetcher(const void* begin, const void* end, std::size_t stride, std::size_t ahead)
      : base_(static_cast<const char*>(begin)),
        size_(static_cast<std::size_t>(static_cast<const char*>(end) - base_)),
        stride_(stride),
        ahead_(ahead) {}
  // Prefetches the stream up to ahead bytes past p (p within the stream or at its end).
  void upto(const void* p) {
    std::size_t target = static_cast<std::size_t>(static_cast<const char*>(p) - base_) + ahead_;
    if (target > size_) target = size_;
    // The offset may step past the end; a pointer is formed only inside the stream.
    for (; next_ < target; next_ += stride_) __builtin_prefetch(base_ + next_, 0, 3);
  }

 private:
  const char* base_;
  std::size_t size_;
  std::size_t stride_;
  std::size_t ahead_;
  std::size_t next_ = 0;
};


// Key rows of ScanTuning::page_stride_from bytes and more are prefetched a page apart: on Zen 5, from
// memory that kept the key stream at the read bandwidth (a hard scan at d = 128 went from ~80% to ~100%
// of it) where every-line prefetching spent the instructions; below it (d = 32) every line, which kept
// soft scans at the bandwidth where page strides did not. On Ice Lake every line won at every row size
// (the default there: scan_tuning.hpp). Value passes always prefetch every line (on AVX2 a page stride
// there cost ~10%).

// Key rows are scored two per load of the query (P::chains2_as) when a row is at most
// kPairedKeyRowBytes or the part's keys at most kPairedSpanBytes; otherwise one at a time, in address
// order. A pair interleaves the reads of two rows: in cache that saves a quarter of the loads (~10% a
// row at d = 128), but from memory (or L3) the hardware prefetchers lose a fifth of the bandwidth when
// the reads step back by 512 bytes and more at 1 KiB. A pair of rows up to 256 bytes spans at most
// eight lines and keeps the gain everywhere; a part of keys this small is likely in L2.
inline constexpr std::size_t kPairedKeyRowBytes = 256;
inline constexpr std::size_t kPairedSpanBytes = std::size_t{512} << 10;

// The stream of rows [start, span.rows) of rows (row_bytes each), stride bytes apart.
inline Prefetcher row_prefetcher(const void* rows, std::size_t row_bytes, const RowSpan& span, std::size_t start,
                                 std::size_t stride) {
  const char* base = static_cast<const char*>(rows);
  return Prefetcher(base + start * row_bytes, base + span.rows * row_bytes, stride, tuning().ahead.load(std::memory_order_relaxed));
}

// The key stream from row start of span, with the stride its row size takes.
inline Prefetcher key_prefetcher(const RowSpan& span, std::size_t start) {
  const std::size_t row_bytes = span.key_row_bytes();
  return row_prefetcher(span.keys, row_bytes, span, start,
                        row_bytes >= tuning().page_stride_from.load(std::memory_order_relaxed) ? Prefetcher::kPage : Prefetcher::kLine);
}

// Calls fn with p as a compile-time constant (std::integral_constant<Precision, p>).
template <class Fn>
void with_precision(Precision p, Fn&& fn) {
  switch (p) {
    case Precision::f16: fn(std::integral_constant<Precision, Precision::f16>{}); break;
    case Precision::bf16: fn(std::integral_constant<Precision, Precision::bf16>{}); break;
    case Precision::i8: fn(std::integral_constant<Precision, Precision::i8>{}); break;
    default: fn(std::integral_constant<Precision, Precision::f32>{}); break;
  }
}

// The same for a value precision (never i8).
template <class Fn>
void with_value_precision(Precision p, Fn&& fn) {
  switch (p) {
    case Precision::f16: fn(std::integral_constant<Precision, Precision::f16>{}); break;
    case Precision::bf16: fn(std::integral_constant<Precision, Precision::bf16>{}); break;
    default: fn(std::integral_constant<Precision, Precision::f32>{}); break;
  }
}

// The one place a single query's scores are computed: every kernel below calls it, so soft, hard,
// top-k and rescoring see the same bits for the same row. Rows [start, start + rows) of span, keys
// stored at KP and converted in registers; a compact row scores exactly what its float32 widening
// scores (the same products in the same order). Not inlined, so that no caller's context can change
// how the compiler contracts it.
template <class P, Precision KP>
[[gnu::noinline]] void score_rows(const float* q, float scale, const RowSpan& span, std::size_t start, std::size_t rows,
                                  float* scores) {
  const std::size_t d = span.dim, row_bytes = span.key_row_bytes();
  const char* keys = static_cast<const char*>(span.keys) + start * row_bytes;
  Prefetcher pf = key_prefetcher(span, start);
  I8Deferral deferral;  // (i8 rows: the scales whose products are summed unscaled, P::chains_as)
  if constexpr (KP == Precision::i8) deferral = P::i8_deferral(q, d);
  std::size_t r = 0;
  if constexpr (P::kJointHeads) {
    if (d % P::W == 0 && (row_bytes <= kPairedKeyRowBytes || span.rows * row_bytes <= kPairedSpanBytes)) {
      for (; r + 2 <= rows; r += 2) {
        const float s0 = KP == Precision::i8 ? span.key_scales[start + r] : 1.0f;
        const float s1 = KP == Precision::i8 ? span.key_scales[start + r + 1] : 1.0f;
        pf.upto(keys + (r + 2) * row_bytes);
        typename P::V v0, v1;
        P::template chains2_as<KP>(q, keys + r * row_bytes, keys + (r + 1) * row_bytes, d, s0, s1, v0, v1,
                                   deferral.covers(s0) && deferral.covers(s1));
        scores[r] = scale * P::reduce(v0);
        scores[r + 1] = scale * P::reduce(v1);
      }
    }
  }
  for (; r < rows; ++r) {
    const float row_scale = KP == Precision::i8 ? span.key_scales[start + r] : 1.0f;
    pf.upto(keys + (r + 1) * row_bytes);
    scores[r] = scale * P::template dot_as<KP>(q, keys + r * row_bytes, d, row_scale, deferral.covers(row_scale));
  }
}

// Register tiles of score_rows_multi: Q queries x R rows of accumulators, one chain each at a time, with
// R widened row vectors, their scales and one query vector beside them: 16 + 9 of avx512's 32 vector
// registers, 8 + 5 of avx2's 16. Q x R is a multiple of 8 (reduce8).
template <class P>
inline constexpr std::size_t kMultiQueries = 4;
template <class P>
inline constexpr std::size_t kMultiRows = P::W == 16 ? 4 : 2;

// score_rows for nq queries at once (query i split with scales[i], its scores at out + i * stride): the
// same bits as nq calls. Each (query, row) pair keeps score_rows' chains (chains_as: chain c sums blocks
// c, c + 4, ... of W elements, chain 0 also the blocks after the last group of four; then (s0 + s1) +
// (s2 + s3), reduce, the scalar tail, the scale), but the tile runs them chain by chain for Q x R pairs,
// so that each block of a row is loaded and widened once for Q queries and each query block once for R
// rows. The rows are read from memory once (rows outer, the queries stay in L1); a tile past the last
// query or row repeats it and drops what it computed.
template <class P, Precision KP>
[[gnu::noinline]] void score_rows_multi(const float* queries, std::size_t nq, const float* scales, const RowSpan& span,
                                        float* out, std::size_t stride) {
  using V = typename P::V;
  constexpr std::size_t W = P::W, Q = kMultiQueries<P>, R = kMultiRows<P>;
  const std::size_t d = span.dim, row_bytes = span.key_row_bytes(), rows = span.rows;
  const std::size_t blocks = d / W, grouped = blocks / 4 * 4;
  const char* keys = static_cast<const char*>(span.keys);
  Prefetcher pf = key_prefetcher(span, 0);
  alignas(64) float pair01[Q * R * W];  // s0 + s1 of each pair, then (s0 + s1) + (s2 + s3)
  alignas(64) float pair2[Q * R * W];   // s2 of each pair
  for (std::size_t r0 = 0; r0 < rows; r0 += R) {
    const char* row[R];
    float row_scale[R];
    for (std::size_t j = 0; j < R; ++j) {
      const std::size_t r = std::min(r0 + j, rows - 1);
      row[j] = keys + r * row_bytes;
      row_scale[j] = KP == Precision::i8 ? span.key_scales[r] : 1.0f;
    }
    pf.upto(keys + std::min(r0 + R, rows) * row_bytes);
    for (std::size_t q0 = 0; q0 < nq; q0 += Q) {
      const float* q[Q];
      for (std::size_t i = 0; i < Q; ++i) q[i] = queries + std::min(q0 + i, nq - 1) * d;
      for (std::size_t c = 0; c < 4; ++c) {
        V acc[Q][R];
#pragma GCC unroll 16
        for (std::size_t i = 0; i < Q; ++i)
#pragma GCC unroll 16
          for (std::size_t j = 0; j < R; ++j) acc[i][j] = V(0.0f);
        const auto step = [&](std::size_t b) {
          V k[R];
#pragma GCC unroll 16
          for (std::size_t j = 0; j < R; ++j) k[j] = P::template load_as<KP>(row[j], b * W, row_scale[j]);
#pragma GCC unroll 16
          for (std::size_t i = 0; i < Q; ++i) {
            const V a = P::load(q[i] + b * W);
#pragma GCC unroll 16
            for (std::size_t j = 0; j < R; ++j) acc[i][j] = P::fma(a, k[j], acc[i][j]);
          }
        };
        for (std::size_t b = c; b < grouped; b += 4) step(b);
        if (c == 0)
          for (std::size_t b = grouped; b < blocks; ++b) step(b);
#pragma GCC unroll 16
        for (std::size_t i = 0; i < Q; ++i)
#pragma GCC unroll 16
          for (std::size_t j = 0; j < R; ++j) {
            float* s01 = pair01 + (i * R + j) * W;
            float* s2 = pair2 + (i * R + j) * W;
            if (c == 0) acc[i][j].store_aligned(s01);
            else if (c == 1) (V::load_aligned(s01) + acc[i][j]).store_aligned(s01);
            else if (c == 2) acc[i][j].store_aligned(s2);
            else (V::load_aligned(s01) + (V::load_aligned(s2) + acc[i][j])).store_aligned(s01);
          }
      }
      if (blocks * W == d) {  // no tail: eight pairs reduced and scaled together (reduce8, the same bits)
        V sum[Q * R];
        alignas(32) float pair_scale[Q * R], score[Q * R];
        for (std::size_t t = 0; t < Q * R; ++t) {
          sum[t] = V::load_aligned(pair01 + t * W);
          pair_scale[t] = scales[std::min(q0 + t / R, nq - 1)];
        }
        for (std::size_t t = 0; t < Q * R; t += 8) P::reduce8(sum + t, pair_scale + t, score + t);
        for (std::size_t i = 0; i < Q && q0 + i < nq; ++i)
          for (std::size_t j = 0; j < R && r0 + j < rows; ++j) out[(q0 + i) * stride + r0 + j] = score[i * R + j];
      } else {
        for (std::size_t i = 0; i < Q && q0 + i < nq; ++i)
          for (std::size_t j = 0; j < R && r0 + j < rows; ++j) {
            float s = P::reduce(V::load_aligned(pair01 + (i * R + j) * W));
            for (std::size_t e = blocks * W; e < d; ++e) s = P::madd(q[i][e], element_as_float<KP>(row[j], e, row_scale[j]), s);
            out[(q0 + i) * stride + r0 + j] = scales[q0 + i] * s;
          }
      }
    }
  }
}

// Puts score_in_double in place of every non-finite score of rows [start, start + rows) (scores[r]),
// over key elements [first, first + count): a float sum that left the float range (or two
// overflows that cancelled into NaN) becomes the score summed in double, +-inf only where the score
// is beyond FLT_MAX. One vector test per block on the hot path; the rows it redoes are rare.
template <class P>
void repair_scores(const float* q, float scale, const RowSpan& span, std::size_t start, std::size_t rows, float* scores,
                   std::size_t first, std::size_t count) {
  if (P::all_finite(scores, rows)) return;
  for (std::size_t r = 0; r < rows; ++r)
    if (!std::isfinite(scores[r])) scores[r] = score_in_double(q, scale, span, start + r, first, count);
}

template <class P>
void score_block(const float* q, float scale, const RowSpan& span, std::size_t start, std::size_t rows, float* scores) {
  with_precision(span.key_precision, [&](auto kp) { score_rows<P, decltype(kp)::value>(q, scale, span, start, rows, scores); });
  repair_scores<P>(q, scale, span, start, rows, scores, 0, span.dim);
}

// Bytes of values a blend chunk covers: the chunk's rows stay in L1 while every column tile of them
// is blended (with one tile, as at dv <= 128 on avx512, the chunking only bounds the loop).
inline constexpr std::size_t kBlendChunkBytes = 16384;

// acc[j * dvh + c] += weights[j * stride + r] * value of row start + r, column j * dvh + c, for each
// of heads heads (dvh = dv / heads) and rows [0, rows): the value pass of a block, values read in
// place at their precision, per element the same fused multiply-adds in the same row order as one
// axpy per row and head.
template <class P>
void blend_block(float* acc, const float* weights, std::size_t stride, std::size_t heads, const RowSpan& span,
                 std::size_t start, std::size_t rows) {
  const std::size_t dv = span.value_dim, row_bytes = span.value_row_bytes();
  std::size_t chunk = row_bytes == 0 ? rows : kBlendChunkBytes / row_bytes;
  chunk = chunk < 1 ? 1 : chunk;
  with_value_precision(span.value_precision, [&](auto vp) {
    constexpr Precision VP = decltype(vp)::value;
    const char* values = static_cast<const char*>(span.values) + start * row_bytes;
    Prefetcher pf = row_prefetcher(span.values, row_bytes, span, start, Prefetcher::kLine);
    for (std::size_t r0 = 0; r0 < rows; r0 += chunk) {
      const std::size_t n = rows - r0 < chunk ? rows - r0 : chunk;
      pf.upto(values + (r0 + n) * row_bytes);  // the chunk's rows are read column tile by column tile
      if (heads == 1) P::template blend_rows<VP>(acc, weights + r0, values + r0 * row_bytes, n, dv, 0, dv);
      else P::template blend_heads<VP>(acc, weights + r0, stride, heads, values + r0 * row_bytes, n, dv);
    }
  });
}

template <class P>
void score_span(const float* q, float scale, const RowSpan& span, float* out) {
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_block<P>(q, scale, span, start, rows, out + start);
  }
}

// scores(queries + i * dim, scales[i], span, out + i * stride) for i < nq, bit for bit (score_rows_multi
// where the path has its tiles, one query at a time otherwise).
template <class P>
void score_span_multi(const float* queries, std::size_t nq, const float* scales, const RowSpan& span, float* out,
                      std::size_t stride) {
  const std::size_t d = span.dim;
  if constexpr (P::kJointHeads) {
    if (span.rows == 0 || nq == 0) return;
    with_precision(span.key_precision,
                   [&](auto kp) { score_rows_multi<P, decltype(kp)::value>(queries, nq, scales, span, out, stride); });
    for (std::size_t i = 0; i < nq; ++i) repair_scores<P>(queries + i * d, scales[i], span, 0, span.rows, out + i * stride, 0, d);
  } else {
    for (std::size_t i = 0; i < nq; ++i) score_span<P>(queries + i * d, scales[i], span, out + i * stride);
  }
}

// KernelTable::value_sums: the span's values in order, each read once for the four sums; the squared
// weights from the doubled scores in one exp pass.
template <class P>
float value_sums(const float* s, const RowSpan& span, const ValueSums& out) {
  with_value_precision(span.value_precision, [&](auto vp) {
    P::template value_sums<decltype(vp)::value>(s, span.values, span.rows, span.value_dim, out.u, out.sv, out.a, out.centre, out.sq);
  });
  alignas(64) float twice[kScanBlockRows];
  alignas(64) float w[kScanBlockRows];
  float squares = 0;
  for (std::size_t first = 0; first < span.rows; first += kScanBlockRows) {
    const std::size_t n = std::min(kScanBlockRows, span.rows - first);
    for (std::size_t r = 0; r < n; ++r) twice[r] = 2 * s[first + r];
    squares += P::exp_shifted(twice, n, 2 * out.shift, w);
  }
  return squares;
}

// KernelTable::fold_moments: a plain loop over restrict parameters, which each path's compiler flags
// vectorise at its own width (a template on P: one symbol per path, never another path's code).
template <class P>
void fold_moments_loop(std::size_t dv, double rows, double sigma, double sv_on, double fa, double w, const float* __restrict u,
                       const float* __restrict sv, const float* __restrict acc, const double* __restrict ubar,
                       const double* __restrict sbar, double* __restrict su, double* __restrict ss, double* __restrict suu,
                       double* __restrict sus, double* __restrict sss, double* __restrict sut, double* __restrict suw,
                       double* __restrict sst, double* __restrict ssw) {
  for (std::size_t k = 0; k < dv; ++k) {
    const double x = static_cast<double>(u[k]) - rows * ubar[k];
    const double y = (static_cast<double>(sv[k]) - ubar[k] * sigma - rows * sbar[k]) * sv_on;
    const double a = static_cast<double>(acc[k]) * fa;
    su[k] += x, ss[k] += y, suu[k] += x * x, sus[k] += x * y, sss[k] += y * y;
    sut[k] += x * a, suw[k] += x * w, sst[k] += y * a, ssw[k] += y * w;
  }
}
template <class P>
void fold_moments(const MomentFold& f) {
  fold_moments_loop<P>(f.dv, f.rows, f.sigma, f.sv_on, f.fa, f.w, f.u, f.sv, f.acc, f.ubar, f.sbar, f.su, f.ss, f.suu, f.sus, f.sss,
                       f.sut, f.suw, f.sst, f.ssw);
}

// KernelTable::fold_leverage: like fold_moments, a plain loop each path's flags vectorise.
template <class P>
void fold_leverage_loop(std::size_t dv, double rows, double sigma, double sv_on, double fa, double w, double hw, double cap,
                        const float* __restrict u, const float* __restrict sv, const float* __restrict acc,
                        const double* __restrict ubar, const double* __restrict sbar, const double* __restrict r,
                        const double* __restrict beta1, const double* __restrict beta2, const double* __restrict i11,
                        const double* __restrict i12, const double* __restrict i22, double* __restrict out) {
  for (std::size_t k = 0; k < dv; ++k) {
    const double x = static_cast<double>(u[k]) - rows * ubar[k];
    const double y = (static_cast<double>(sv[k]) - ubar[k] * sigma - rows * sbar[k]) * sv_on;
    const double e = static_cast<double>(acc[k]) * fa - r[k] * w - beta1[k] * x - beta2[k] * y;
    const double h = hw + i11[k] * x * x + 2 * i12[k] * x * y + i22[k] * y * y;
    const double left = 1 - (h < cap ? h : cap);
    out[k] += e * e / (left * left);
  }
}
template <class P>
void fold_leverage_plain(std::size_t dv, double fa, double w, double left2, const float* __restrict acc, const double* __restrict r,
                         double* __restrict out) {
  for (std::size_t k = 0; k < dv; ++k) {
    const double e = static_cast<double>(acc[k]) * fa - r[k] * w;
    out[k] += e * e / left2;
  }
}
template <class P>
void fold_leverage(const LeverageFold& f) {
  if (f.u == nullptr) {
    const double left = 1 - (f.hw < f.cap ? f.hw : f.cap);
    fold_leverage_plain<P>(f.dv, f.fa, f.w, left * left, f.acc, f.r, f.out);
    return;
  }
  fold_leverage_loop<P>(f.dv, f.rows, f.sigma, f.sv_on, f.fa, f.w, f.hw, f.cap, f.u, f.sv, f.acc, f.ubar, f.sbar, f.r, f.beta1, f.beta2,
                        f.i11, f.i12, f.i22, f.out);
}

// Single query: per block, a key pass (scores), one exp pass, a value pass; each row read once.
template <class P>
void soft_scan(const float* q, float scale, const RowSpan& span, float& max, float& sum, float* acc,
               ScoreSink* sink) {
  alignas(64) float scores[kScanBlockRows];
  alignas(64) float weights[kScanBlockRows];
  const std::size_t dv = span.value_dim;
  BlockSums<P> part(dv);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_block<P>(q, scale, span, start, rows, scores);
    raise_max<P>(P::max(scores, rows), max, sum, acc, dv);
    sum += P::exp_shifted(scores, rows, exp_shift(max), weights);
    blend_block<P>(part.begin(), weights, 0, 1, span, start, rows);
    part.end(acc);
    if (sink != nullptr) sink->offer(scores, start, rows);  // (after the blend: a sink reading the rows finds them in cache)
  }
}

// Keys only: every block's scores go to the sink (the flat index keeps its top k there).
template <class P>
void top_scan(const float* q, float scale, const RowSpan& span, ScoreSink& sink) {
  alignas(64) float scores[kScanBlockRows];
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    score_block<P>(q, scale, span, start, rows, scores);
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

// The scores of a batch block, rows x lanes (lane b: query b of queries, row-major, transposed into qt,
// times factor[b]; lanes from nq on are padding): the keys' dot products, scaled per lane afterwards,
// and any non-finite one redone by score_in_double, as score_block does for a single query.
template <class P>
void batch_scores(Widener<P>& widen, const TileProducts& tiles, const float* qt, const float* queries, std::size_t nq,
                  const float* factor, const RowSpan& span, std::size_t start, std::size_t rows, std::size_t lanes,
                  float* scores) {
  const std::size_t d = span.dim;
  widen.keys(span, start, rows, tiles.scores == &P::scores_block, [&](const float* k, std::size_t off, std::size_t n) {
    tiles.scores(qt, lanes, k, n, d, scores + off * lanes);
  });
  P::scale_columns(scores, rows, lanes, factor);
  if (P::all_finite(scores, rows * lanes)) return;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < nq; ++b)
      if (float& s = scores[r * lanes + b]; !std::isfinite(s)) s = score_in_double(queries + b * d, factor[b], span, start + r, 0, d);
}

// nq queries: each block of keys and values is read once for all of them (compute-bound). The
// queries sit in lanes, so scores come out as rows x lanes; each lane's scale multiplies its dot
// products afterwards, as in the single-query scan (folding it into the query could overflow where
// the single path does not), and the block max, the exponentials and their sums run down the
// columns with whole vectors.
template <class P>
void soft_scan_batch(const float* queries, std::size_t nq, const float* scales, const RowSpan& span, float* max,
                     float* sum, float* acc, float* scratch, const TileProducts& tiles) {
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
  Widener<P> widen;
  BlockSums<P> part(nq * dv);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    batch_scores<P>(widen, tiles, qt, queries, nq, factor, span, start, rows, lanes, scores);
    P::column_max(scores, rows, lanes, block);
    for (std::size_t b = 0; b < nq; ++b) {
      raise_max<P>(block[b], max[b], sum[b], acc + b * dv, dv);
      shift[b] = exp_shift(max[b]);
    }
    P::exp_columns(scores, rows, lanes, shift, block);
    for (std::size_t b = 0; b < nq; ++b) sum[b] += block[b];
    float* block_acc = part.begin();
    widen.values(span, start, rows, tiles.blend == &P::blend_block, [&](const float* v, std::size_t off, std::size_t n) {
      tiles.blend(scores + off * lanes, lanes, nq, v, n, dv, block_acc);
    });
    part.end(acc);
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
    score_block<P>(q, scale, span, start, rows, scores);
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
                     float* scratch, const TileProducts& tiles) {
  const std::size_t d = span.dim;
  const std::size_t lanes = batch_lanes(nq);
  float* qt = scratch;                             // d x lanes
  float* scores = qt + d * lanes;                  // kScanBlockRows x lanes, scaled in place
  float* top = scores + kScanBlockRows * lanes;    // per lane: the block's max
  float* total = top + lanes;                      // per lane: the block's sum
  float* factor = total + lanes;                   // per lane: the scale (0 on padding lanes)
  transpose_queries(queries, nq, d, qt, lanes);
  for (std::size_t b = 0; b < lanes; ++b) factor[b] = b < nq ? scales[b] : 0.0f;
  Widener<P> widen;
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const std::size_t rows = span.rows - start < kScanBlockRows ? span.rows - start : kScanBlockRows;
    batch_scores<P>(widen, tiles, qt, queries, nq, factor, span, start, rows, lanes, scores);
    P::column_max_sum(scores, rows, lanes, top, total);
    for (std::size_t b = 0; b < nq; ++b) {
      if (std::isfinite(total[b]) && top[b] < best[b].score) continue;
      for (std::size_t r = 0; r < rows; ++r) offer_argmax(scores[r * lanes + b], start + r, span.ids, best[b]);
    }
  }
}

}  // namespace softkv::detail::scan
