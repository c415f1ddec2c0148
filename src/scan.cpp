// Scan orchestration: cut the rows into parts, scan each on the pool, merge in part order.
#include "scan.hpp"

#include <algorithm>
#include <limits>
#include <optional>

#include "thread_pool.hpp"

namespace softkv::detail {
namespace {

// Queries handled per pass over the rows: their scores, weights and accumulators stay in L2.
constexpr std::size_t kBatchChunk = 64;

RowSpan slice(const RowSpan& span, std::size_t part, std::size_t parts) {
  const std::size_t begin = span.rows * part / parts;
  const std::size_t end = span.rows * (part + 1) / parts;
  RowSpan sub = span;
  sub.keys = span.keys + begin * span.dim;
  sub.values = span.values != nullptr ? span.values + begin * span.value_dim : nullptr;
  sub.ids = span.ids + begin;
  sub.rows = end - begin;
  return sub;
}

std::size_t part_begin(const RowSpan& span, std::size_t part, std::size_t parts) {
  return span.rows * part / parts;
}

void merge_argmax(const ArgMax& part, const std::uint64_t* ids, ArgMax& best) {
  if (part.row == ArgMax::kNoRow) return;
  if (best.row == ArgMax::kNoRow || part.dot > best.dot || (part.dot == best.dot && ids[part.row] < ids[best.row]))
    best = part;
}

}  // namespace

std::size_t choose_parts(std::size_t rows, std::size_t floats_per_row, std::size_t requested,
                         std::size_t max_parts) {
  constexpr std::size_t kMinFloatsPerPart = std::size_t{1} << 18;  // below ~1 MiB a wake-up costs more than it saves
  std::size_t parts = requested;
  if (parts == 0) parts = std::clamp<std::size_t>(rows * floats_per_row / kMinFloatsPerPart, 1, std::max<std::size_t>(max_parts, 1));
  return std::max<std::size_t>(1, std::min(parts, rows));
}

SoftScan soft_scan_split(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                         std::size_t parts, std::size_t top_m) {
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

ArgMax hard_scan_split(const KernelTable& k, const float* query, const RowSpan& span, std::size_t parts) {
  std::vector<ArgMax> best(parts);
  ThreadPool::shared().run(parts, [&](std::size_t p) { k.hard_scan(query, slice(span, p, parts), best[p]); });
  ArgMax merged;
  for (std::size_t p = 0; p < parts; ++p) {
    if (best[p].row != ArgMax::kNoRow) best[p].row += part_begin(span, p, parts);
    merge_argmax(best[p], span.ids, merged);
  }
  return merged;
}

std::vector<SoftmaxState> soft_scan_batch_split(const KernelTable& k, const float* queries, std::size_t nq,
                                                float scale, const RowSpan& span, std::size_t parts) {
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
      k.soft_scan_batch(queries + b * d, n, scale, sub, st.max.data() + b, st.sum.data() + b,
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
                                          const RowSpan& span, std::size_t parts) {
  const std::size_t d = span.dim;
  std::vector<std::vector<ArgMax>> part_best(parts, std::vector<ArgMax>(nq));
  ThreadPool::shared().run(parts, [&](std::size_t p) {
    const RowSpan sub = slice(span, p, parts);
    std::vector<float> scratch(batch_scratch_floats(kBatchChunk, d));
    for (std::size_t b = 0; b < nq; b += kBatchChunk) {
      const std::size_t n = std::min(kBatchChunk, nq - b);
      k.hard_scan_batch(queries + b * d, n, sub, part_best[p].data() + b, scratch.data());
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

}  // namespace softkv::detail
