// Scan orchestration: cut the rows (every row, or a mask's runs) into parts, scan each on the pool,
// merge in part order.
#include "scan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "precision.hpp"
#include "row_walk.hpp"
#include "simd/tile_gemm.hpp"
#include "thread_pool.hpp"

namespace softkv::detail {
namespace {

// Queries handled per pass over the rows: their scores, weights and accumulators stay in L2.
constexpr std::size_t kBatchChunk = 64;

// The rows a scan visits: `only`, or every row of span as one run (scanned in place, like any long run).
class Scope {
 public:
  Scope(const RowSpan& span, const EligibleRows* only) : only_(only) {
    if (only_ != nullptr) return;
    if (span.rows > 0) every_.runs.push_back({0, span.rows});
    every_.count = span.rows;
  }
  [[nodiscard]] const EligibleRows& rows() const { return only_ != nullptr ? *only_ : every_; }

 private:
  const EligibleRows* only_;
  EligibleRows every_;
};

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

void key_row(const RowSpan& span, std::size_t r, float* out) {
  decode_row(span.key_precision, static_cast<const std::byte*>(span.keys) + r * span.key_row_bytes(), span.dim,
             span.key_scales != nullptr ? span.key_scales[r] : 1.0f, out);
}

void prefetch_row(const RowSpan& span, std::size_t r, bool keys, bool values) {
  const auto lines = [](const void* base, std::size_t bytes) {
    for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(base) + o, 0, 3);
  };
  if (keys) lines(static_cast<const std::byte*>(span.keys) + r * span.key_row_bytes(), span.key_row_bytes());
  if (values && span.values != nullptr) lines(static_cast<const std::byte*>(span.values) + r * span.value_row_bytes(), span.value_row_bytes());
}

void value_row(const RowSpan& span, std::size_t r, float* out) {
  decode_row(span.value_precision, static_cast<const std::byte*>(span.values) + r * span.value_row_bytes(), span.value_dim,
             1.0f, out);
}

std::vector<float> value_vector(const RowSpan& span, std::size_t r) {
  std::vector<float> v(span.value_dim);
  value_row(span, r, v.data());
  return v;
}

void merge_argmax(const ArgMax& part, const std::uint64_t* ids, ArgMax& best) {
  best.overflow = best.overflow || part.overflow;
  if (part.row == ArgMax::kNoRow) return;
  if (best.row == ArgMax::kNoRow || part.score > best.score || (part.score == best.score && ids[part.row] < ids[best.row])) {
    best.score = part.score;
    best.row = part.row;
  }
}

void DoubleBlend::add(float s, const float* value) {
  if (s == -std::numeric_limits<float>::infinity()) return;
  const double x = s;
  if (x > max_) {  // rescale what is folded so far (nothing the first time: exp(-inf) = 0)
    const double f = std::exp(max_ - x);
    for (double& a : acc_) a *= f;
    sum_ *= f;
    max_ = x;
  }
  const double w = std::exp(x - max_);
  sum_ += w;
  for (std::size_t i = 0; i < acc_.size(); ++i) acc_[i] += w * static_cast<double>(value[i]);
}

std::vector<float> DoubleBlend::value() const {
  std::vector<float> out(acc_.size());
  for (std::size_t i = 0; i < acc_.size(); ++i) out[i] = static_cast<float>(acc_[i] / sum_);
  return out;
}

float score_in_double(const float* q, float scale, const RowSpan& span, std::size_t row, std::size_t first,
                      std::size_t count) {
  const char* key = static_cast<const char*>(span.keys) + row * span.key_row_bytes();
  const float row_scale = span.key_precision == Precision::i8 ? span.key_scales[row] : 1.0f;
  auto sum = [&](auto element) {
    double s = 0.0;
    for (std::size_t i = 0; i < count; ++i) s += static_cast<double>(q[i]) * static_cast<double>(element(first + i));
    return s;
  };
  double dot = 0.0;
  switch (span.key_precision) {
    case Precision::f16: dot = sum([&](std::size_t i) { return element_as_float<Precision::f16>(key, i, 1.0f); }); break;
    case Precision::bf16: dot = sum([&](std::size_t i) { return element_as_float<Precision::bf16>(key, i, 1.0f); }); break;
    case Precision::i8: dot = sum([&](std::size_t i) { return element_as_float<Precision::i8>(key, i, row_scale); }); break;
    default: dot = sum([&](std::size_t i) { return element_as_float<Precision::f32>(key, i, 1.0f); }); break;
  }
  return static_cast<float>(static_cast<double>(scale) * dot);
}

float split_scale(std::span<float> query, float scale) {
  float largest = 0.0f;
  for (float x : query) largest = std::max(largest, std::fabs(x));
  if (largest == 0.0f) return scale;  // a zero query scores 0 everywhere, whatever the split
  // Exponents of normal floats run from -126 to 127; factor = scale * 2^e must stay in that range.
  const int scale_exp = std::ilogb(static_cast<double>(scale));  // exact for subnormal scales too
  const int e = std::clamp(std::ilogb(static_cast<double>(largest)), -126 - scale_exp, 127 - scale_exp);
  for (float& x : query) x = std::ldexp(x, -e);
  return static_cast<float>(std::ldexp(static_cast<double>(scale), e));
}

std::size_t choose_parts(std::size_t rows, std::size_t floats_per_row, std::size_t requested,
                         std::size_t max_parts) {
  constexpr std::size_t kMinFloatsPerPart = std::size_t{1} << 18;  // below ~1 MiB a wake-up costs more than it saves
  std::size_t parts = requested;
  if (parts == 0) parts = std::clamp<std::size_t>(rows * floats_per_row / kMinFloatsPerPart, 1, std::max<std::size_t>(max_parts, 1));
  return std::max<std::size_t>(1, std::min(parts, rows));
}

SoftScan soft_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                         std::size_t parts, std::size_t top_m, const EligibleRows* only) {
  const Scope scope(span, only);
  top_m = std::min(top_m, scope.rows().count);
  const auto split = split_runs(scope.rows(), parts);
  std::vector<SoftmaxState> states(split.size(), SoftmaxState(span.value_dim));
  std::vector<std::optional<TopScores>> tops(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    BlockWalker walker(span);
    SoftmaxState& st = states[p];
    if (top_m > 0) tops[p].emplace(top_m, nullptr);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      std::optional<TopScores> block_top;  // items carry ids, so a block's heap merges into the part's
      if (top_m > 0) block_top.emplace(top_m, block.ids);
      k.soft_scan(query, scale, block, st.max, st.sum, st.acc.data(), block_top ? &*block_top : nullptr);
      if (block_top) tops[p]->absorb(*block_top);
    });
  });
  SoftScan result{std::move(states[0]), {}};
  for (std::size_t p = 1; p < states.size(); ++p) result.state.merge(states[p]);
  if (top_m > 0) {
    for (std::size_t p = 1; p < tops.size(); ++p) tops[0]->absorb(*tops[p]);
    result.top = tops[0]->sorted();
  }
  return result;
}

std::vector<float> blended_value(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                 const SoftmaxState& state, const EligibleRows* only) {
  std::vector<float> value(state.acc.size());
  const float inv = 1.0f / state.sum;
  for (std::size_t i = 0; i < value.size(); ++i) value[i] = state.acc[i] * inv;
  if (all_finite(value) || !std::isfinite(state.lse())) return value;
  // The single-query kernel's scores, weighted and summed in double, whose range holds N * FLT_MAX
  // for any N (with their own max: a batch kernel's state rounds differently); the scanned rows only.
  const Scope scope(span, only);
  const std::size_t dv = span.value_dim;
  DoubleBlend blend(dv);
  std::vector<float> scores(kScanBlockRows), v(dv);
  BlockWalker walker(span);
  walker.walk(scope.rows().runs, [&](const RowSpan& block, const std::size_t*, std::size_t) {
    for (std::size_t start = 0; start < block.rows; start += kScanBlockRows) {
      const RowSpan piece = block.sub(start, std::min(kScanBlockRows, block.rows - start));
      k.scores(query, scale, piece, scores.data());
      for (std::size_t r = 0; r < piece.rows; ++r) {
        value_row(block, start + r, v.data());
        blend.add(scores[r], v.data());
      }
    }
  });
  return blend.value();
}

ArgMax hard_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span, std::size_t parts,
                       const EligibleRows* only) {
  const Scope scope(span, only);
  const auto split = split_runs(scope.rows(), parts);
  std::vector<ArgMax> best(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    BlockWalker walker(keys_only(span));
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      ArgMax b;
      k.hard_scan(query, scale, block, b);
      merge_block_best({&b, 1}, map, first, span.ids, &best[p]);
    });
  });
  ArgMax merged;
  for (const ArgMax& b : best) merge_argmax(b, span.ids, merged);
  return merged;
}

std::vector<SoftmaxState> soft_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                                const float* scales, const RowSpan& span, std::size_t parts,
                                                const EligibleRows* only) {
  const Scope scope(span, only);
  const std::size_t d = span.dim, dv = span.value_dim;
  const auto split = split_runs(scope.rows(), parts);
  const TileProducts tiles = tiles_for(k);
  // Per part: flat max/sum/acc arrays for all nq queries, which the kernel updates in place.
  struct PartState {
    std::vector<float> max, sum, acc;
  };
  std::vector<PartState> part_states(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    PartState& st = part_states[p];
    st.max.assign(nq, -std::numeric_limits<float>::infinity());
    st.sum.assign(nq, 0.0f);
    st.acc.assign(nq * dv, 0.0f);
    std::vector<float> scratch(batch_scratch_floats(std::min(nq, kBatchChunk), d));
    BlockWalker walker(span);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t b = 0; b < nq; b += kBatchChunk) {
        const std::size_t n = std::min(kBatchChunk, nq - b);
        k.soft_scan_batch(queries + b * d, n, scales + b, block, st.max.data() + b, st.sum.data() + b, st.acc.data() + b * dv,
                          scratch.data(), tiles);
      }
    });
  });
  std::vector<SoftmaxState> merged(nq, SoftmaxState(dv));
  for (const PartState& st : part_states) {
    SoftmaxState part(dv);
    for (std::size_t b = 0; b < nq; ++b) {
      part.max = st.max[b];
      part.sum = st.sum[b];
      std::copy_n(st.acc.begin() + static_cast<std::ptrdiff_t>(b * dv), dv, part.acc.begin());
      merged[b].merge(part);
    }
  }
  return merged;
}

std::vector<ArgMax> hard_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                          const float* scales, const RowSpan& span, std::size_t parts,
                                          const EligibleRows* only) {
  const Scope scope(span, only);
  const std::size_t d = span.dim;
  const auto split = split_runs(scope.rows(), parts);
  const TileProducts tiles = tiles_for(k);
  std::vector<std::vector<ArgMax>> part_best(split.size(), std::vector<ArgMax>(nq));
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    std::vector<float> scratch(batch_scratch_floats(std::min(nq, kBatchChunk), d));
    std::vector<ArgMax> block_best(nq);
    BlockWalker walker(keys_only(span));
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      std::fill(block_best.begin(), block_best.end(), ArgMax{});
      for (std::size_t b = 0; b < nq; b += kBatchChunk) {
        const std::size_t n = std::min(kBatchChunk, nq - b);
        k.hard_scan_batch(queries + b * d, n, scales + b, block, block_best.data() + b, scratch.data(), tiles);
      }
      merge_block_best(block_best, map, first, span.ids, part_best[p].data());
    });
  });
  return merge_part_best(part_best, nq, span.ids);
}

namespace {

// Rows of a chunk that every query of an interleaved pass scans while it is in cache: whole blocks (so
// each query's kernel sees the block boundaries of a single scan), about 256 KiB of keys and values
// (half of the smallest L2 of the CPUs measured, Zen 3's 512 KiB), at least one block.
std::size_t chunk_rows(const RowSpan& span) {
  const std::size_t row = span.key_row_bytes() + (span.values != nullptr ? span.value_row_bytes() : 0);
  const std::size_t blocks = std::max<std::size_t>(1, (std::size_t{256} << 10) / std::max<std::size_t>(row, 1) / kScanBlockRows);
  return blocks * kScanBlockRows;
}

// Calls fn(piece) for each chunk of each block the walker visits (a gathered block is one chunk).
template <class Fn>
void for_each_chunk(const RowSpan& block, std::size_t chunk, const Fn& fn) {
  for (std::size_t start = 0; start < block.rows; start += chunk) fn(block.sub(start, std::min(chunk, block.rows - start)), start);
}

}  // namespace

std::vector<SoftmaxState> soft_scan_each_split(const KernelTable& k, const float* queries, std::size_t nq,
                                               const float* scales, const RowSpan& span, std::size_t parts,
                                               const EligibleRows* only) {
  const Scope scope(span, only);
  const std::size_t d = span.dim, dv = span.value_dim, chunk = chunk_rows(span);
  const auto split = split_runs(scope.rows(), parts);
  std::vector<std::vector<SoftmaxState>> part_states(split.size(), std::vector<SoftmaxState>(nq, SoftmaxState(dv)));
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    BlockWalker walker(span);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for_each_chunk(block, chunk, [&](const RowSpan& piece, std::size_t) {
        for (std::size_t b = 0; b < nq; ++b) {
          SoftmaxState& st = part_states[p][b];
          k.soft_scan(queries + b * d, scales[b], piece, st.max, st.sum, st.acc.data(), nullptr);
        }
      });
    });
  });
  std::vector<SoftmaxState> merged = std::move(part_states[0]);
  for (std::size_t p = 1; p < part_states.size(); ++p)
    for (std::size_t b = 0; b < nq; ++b) merged[b].merge(part_states[p][b]);
  return merged;
}

std::vector<ArgMax> hard_scan_each_split(const KernelTable& k, const float* queries, std::size_t nq, const float* scales,
                                         const RowSpan& span, std::size_t parts, const EligibleRows* only) {
  const Scope scope(span, only);
  const RowSpan keys = keys_only(span);
  const std::size_t d = span.dim, chunk = chunk_rows(keys);
  const auto split = split_runs(scope.rows(), parts);
  std::vector<std::vector<ArgMax>> part_best(split.size(), std::vector<ArgMax>(nq));
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    BlockWalker walker(keys);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      for_each_chunk(block, chunk, [&](const RowSpan& piece, std::size_t start) {
        for (std::size_t b = 0; b < nq; ++b) {
          ArgMax one;
          k.hard_scan(queries + b * d, scales[b], piece, one);
          if (one.row != ArgMax::kNoRow) one.row += start;  // relative to the visited block
          merge_block_best({&one, 1}, map, first, span.ids, &part_best[p][b]);
        }
      });
    });
  });
  return merge_part_best(part_best, nq, span.ids);
}

std::vector<TopScores::Item> top_k_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                        std::size_t top_k, std::size_t parts, const EligibleRows* only) {
  const Scope scope(span, only);
  top_k = std::min(top_k, scope.rows().count);
  const auto split = split_runs(scope.rows(), parts);
  std::vector<std::optional<TopScores>> tops(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    tops[p].emplace(top_k, nullptr);
    BlockWalker walker(keys_only(span));
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      TopScores block_top(top_k, block.ids);
      k.top_scan(query, scale, block, block_top);
      tops[p]->absorb(block_top);
    });
  });
  for (std::size_t p = 1; p < tops.size(); ++p) tops[0]->absorb(*tops[p]);
  return tops[0]->sorted();
}

std::size_t run_holding(const EligibleRows& rows, std::size_t row) {
  const auto at = std::upper_bound(rows.runs.begin(), rows.runs.end(), row,
                                   [](std::size_t r, const RowRun& run) { return r < run.begin; });
  if (at == rows.runs.begin()) return rows.runs.size();
  const RowRun& run = *std::prev(at);
  return row - run.begin < run.count ? static_cast<std::size_t>(at - rows.runs.begin()) - 1 : rows.runs.size();
}

}  // namespace softkv::detail
