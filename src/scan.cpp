// Scan orchestration: cut the rows into parts, scan each on the pool, merge in part order.
#include "scan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "precision.hpp"
#include "thread_pool.hpp"

namespace softkv::detail {
namespace {

// Queries handled per pass over the rows: their scores, weights and accumulators stay in L2.
constexpr std::size_t kBatchChunk = 64;

RowSpan slice(const RowSpan& span, std::size_t part, std::size_t parts) {
  const std::size_t begin = span.rows * part / parts;
  const std::size_t end = span.rows * (part + 1) / parts;
  return span.sub(begin, end - begin);
}

std::size_t part_begin(const RowSpan& span, std::size_t part, std::size_t parts) {
  return span.rows * part / parts;
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

void key_row(const RowSpan& span, std::size_t r, float* out) {
  decode_row(span.key_precision, static_cast<const std::byte*>(span.keys) + r * span.key_row_bytes(), span.dim,
             span.key_scales != nullptr ? span.key_scales[r] : 1.0f, out);
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
                         std::size_t parts, std::size_t top_m) {
  top_m = std::min(top_m, span.rows);
  std::vector<SoftmaxState> states(parts, SoftmaxState(span.value_dim));
  std::vector<std::optional<TopScores>> tops(parts);
  ThreadPool::shared().run(parts, [&](std::size_t p) {
    const RowSpan sub = slice(span, p, parts);
    ScoreSink* sink = nullptr;
    if (top_m > 0) sink = &tops[p].emplace(top_m, sub.ids);
    k.soft_scan(query, scale, sub, states[p].max, states[p].sum, states[p].acc.data(), sink);
  });
  SoftScan result{std::move(states[0]), {}};
  for (std::size_t p = 1; p < parts; ++p) result.state.merge(states[p]);
  if (top_m > 0) {
    for (std::size_t p = 1; p < parts; ++p) tops[0]->absorb(*tops[p]);
    result.top = tops[0]->sorted();
  }
  return result;
}

std::vector<float> blended_value(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                 const SoftmaxState& state) {
  std::vector<float> value(state.acc.size());
  const float inv = 1.0f / state.sum;
  for (std::size_t i = 0; i < value.size(); ++i) value[i] = state.acc[i] * inv;
  if (all_finite(value) || !std::isfinite(state.lse())) return value;
  // The single-query kernel's scores, weighted and summed in double, whose range holds N * FLT_MAX
  // for any N (with their own max: a batch kernel's state rounds differently).
  const std::size_t dv = span.value_dim;
  DoubleBlend blend(dv);
  std::vector<float> scores(std::min(span.rows, kScanBlockRows));
  std::vector<float> v(dv);
  for (std::size_t start = 0; start < span.rows; start += kScanBlockRows) {
    const RowSpan block = span.sub(start, std::min(kScanBlockRows, span.rows - start));
    k.scores(query, scale, block, scores.data());
    for (std::size_t r = 0; r < block.rows; ++r) {
      value_row(span, start + r, v.data());
      blend.add(scores[r], v.data());
    }
  }
  return blend.value();
}

ArgMax hard_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span, std::size_t parts) {
  std::vector<ArgMax> best(parts);
  ThreadPool::shared().run(parts, [&](std::size_t p) { k.hard_scan(query, scale, slice(span, p, parts), best[p]); });
  ArgMax merged;
  for (std::size_t p = 0; p < parts; ++p) {
    if (best[p].row != ArgMax::kNoRow) best[p].row += part_begin(span, p, parts);
    merge_argmax(best[p], span.ids, merged);
  }
  return merged;
}

std::vector<SoftmaxState> soft_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                                const float* scales, const RowSpan& span, std::size_t parts) {
  const std::size_t d = span.dim;
  const std::size_t dv = span.value_dim;
  // Per part: flat max/sum/acc arrays for all nq queries, which the kernel updates in place.
  struct PartState {
    std::vector<float> max, sum, acc;
  };
  std::vector<PartState> part_states(parts);
  ThreadPool::shared().run(parts, [&](std::size_t p) {
    const RowSpan sub = slice(span, p, parts);
    PartState& st = part_states[p];
    st.max.assign(nq, -std::numeric_limits<float>::infinity());
    st.sum.assign(nq, 0.0f);
    st.acc.assign(nq * dv, 0.0f);
    std::vector<float> scratch(batch_scratch_floats(kBatchChunk, d));
    for (std::size_t b = 0; b < nq; b += kBatchChunk) {
      const std::size_t n = std::min(kBatchChunk, nq - b);
      k.soft_scan_batch(queries + b * d, n, scales + b, sub, st.max.data() + b, st.sum.data() + b,
                        st.acc.data() + b * dv, scratch.data());
    }
  });
  std::vector<SoftmaxState> merged(nq, SoftmaxState(dv));
  for (std::size_t p = 0; p < parts; ++p) {
    SoftmaxState part(dv);
    for (std::size_t b = 0; b < nq; ++b) {
      part.max = part_states[p].max[b];
      part.sum = part_states[p].sum[b];
      std::copy_n(part_states[p].acc.begin() + static_cast<std::ptrdiff_t>(b * dv), dv, part.acc.begin());
      merged[b].merge(part);
    }
  }
  return merged;
}

std::vector<ArgMax> hard_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                          const float* scales, const RowSpan& span, std::size_t parts) {
  const std::size_t d = span.dim;
  std::vector<std::vector<ArgMax>> part_best(parts, std::vector<ArgMax>(nq));
  ThreadPool::shared().run(parts, [&](std::size_t p) {
    const RowSpan sub = slice(span, p, parts);
    std::vector<float> scratch(batch_scratch_floats(kBatchChunk, d));
    for (std::size_t b = 0; b < nq; b += kBatchChunk) {
      const std::size_t n = std::min(kBatchChunk, nq - b);
      k.hard_scan_batch(queries + b * d, n, scales + b, sub, part_best[p].data() + b, scratch.data());
    }
  });
  std::vector<ArgMax> merged(nq);
  for (std::size_t p = 0; p < parts; ++p) {
    const std::size_t begin = part_begin(span, p, parts);
    for (std::size_t b = 0; b < nq; ++b) {
      ArgMax part = part_best[p][b];
      if (part.row != ArgMax::kNoRow) part.row += begin;
      merge_argmax(part, span.ids, merged[b]);
    }
  }
  return merged;
}

std::vector<TopScores::Item> top_k_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                        std::size_t top_k, std::size_t parts) {
  top_k = std::min(top_k, span.rows);
  parts = std::clamp<std::size_t>(parts, 1, std::max<std::size_t>(1, span.rows));
  std::vector<std::optional<TopScores>> tops(parts);
  ThreadPool::shared().run(parts, [&](std::size_t p) {
    const RowSpan sub = slice(span, p, parts);
    k.top_scan(query, scale, sub, tops[p].emplace(top_k, sub.ids));
  });
  for (std::size_t p = 1; p < parts; ++p) tops[0]->absorb(*tops[p]);
  return tops[0]->sorted();
}

}  // namespace softkv::detail
