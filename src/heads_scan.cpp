// Multi-head scans: parts by eligible rows, per-head states merged by log-sum-exp in part order.
#include "heads_scan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "row_walk.hpp"
#include "thread_pool.hpp"

namespace softkv::detail {

EligibleRows all_rows(std::size_t rows) {
  EligibleRows all;
  if (rows > 0) all.runs.push_back({0, rows});
  all.count = rows;
  return all;
}

HeadsSoftScan heads_soft_scan(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                              const RowSpan& span, const EligibleRows& rows, std::size_t parts, std::size_t top_m) {
  top_m = std::min(top_m, rows.count);
  const std::size_t dv = span.value_dim, dvh = dv / heads;
  const auto split = split_runs(rows, parts);
  struct PartState {
    std::vector<float> max, sum, acc;
    std::vector<std::optional<TopScores>> top;
  };
  std::vector<PartState> part_states(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    PartState& st = part_states[p];
    st.max.assign(heads, -std::numeric_limits<float>::infinity());
    st.sum.assign(heads, 0.0f);
    st.acc.assign(dv, 0.0f);
    st.top.resize(top_m > 0 ? heads : 0);
    for (auto& t : st.top) t.emplace(top_m, nullptr);
    std::vector<std::optional<TopScores>> block_top(st.top.size());
    std::vector<ScoreSink*> sinks(st.top.size());
    BlockWalker walker(span);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t j = 0; j < block_top.size(); ++j) sinks[j] = &block_top[j].emplace(top_m, block.ids);
      k.soft_scan_heads(query, scales, heads, block, st.max.data(), st.sum.data(), st.acc.data(),
                        sinks.empty() ? nullptr : sinks.data());
      for (std::size_t j = 0; j < block_top.size(); ++j) st.top[j]->absorb(*block_top[j]);
    });
  });
  HeadsSoftScan result;
  result.states.assign(heads, SoftmaxState(dvh));
  for (const PartState& st : part_states) {
    SoftmaxState part(dvh);
    for (std::size_t j = 0; j < heads; ++j) {
      part.max = st.max[j];
      part.sum = st.sum[j];
      std::copy_n(st.acc.begin() + static_cast<std::ptrdiff_t>(j * dvh), dvh, part.acc.begin());
      result.states[j].merge(part);
    }
  }
  if (top_m > 0) {
    result.top.resize(heads);
    for (std::size_t j = 0; j < heads; ++j) {
      for (std::size_t p = 1; p < part_states.size(); ++p) part_states[0].top[j]->absorb(*part_states[p].top[j]);
      result.top[j] = part_states[0].top[j]->sorted();
    }
  }
  return result;
}

std::vector<float> heads_blended_value(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                                       const RowSpan& span, const EligibleRows& rows,
                                       const std::vector<SoftmaxState>& states) {
  const std::size_t d = span.dim, dv = span.value_dim, dh = d / heads, dvh = dv / heads;
  std::vector<float> value(dv);
  for (std::size_t j = 0; j < heads; ++j) {
    const SoftmaxState& state = states[j];
    const float inv = 1.0f / state.sum;
    bool finite = true;
    for (std::size_t i = 0; i < dvh; ++i) {
      value[j * dvh + i] = state.acc[i] * inv;
      finite = finite && std::isfinite(value[j * dvh + i]);
    }
    if (finite || !std::isfinite(state.lse())) continue;
    // Head j's scores as the kernel computes them (scale * dot over the slice), summed in double.
    DoubleBlend blend(dvh);
    std::vector<float> key(d), v(dv);
    BlockWalker walker(span);
    walker.walk(rows.runs, [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t r = 0; r < block.rows; ++r) {
        key_row(block, r, key.data());
        float s = scales[j] * k.dot(query + j * dh, key.data() + j * dh, dh);
        if (!std::isfinite(s)) s = score_in_double(query + j * dh, scales[j], block, r, j * dh, dh);  // as the scan repairs it
        value_row(block, r, v.data());
        blend.add(s, v.data() + j * dvh);
      }
    });
    const std::vector<float> head = blend.value();
    std::copy(head.begin(), head.end(), value.begin() + static_cast<std::ptrdiff_t>(j * dvh));
  }
  return value;
}

std::vector<ArgMax> heads_hard_scan(const KernelTable& k, const float* query, const float* scales, std::size_t heads,
                                    const RowSpan& span, const EligibleRows& rows, std::size_t parts) {
  const auto split = split_runs(rows, parts);
  std::vector<std::vector<ArgMax>> part_best(split.size(), std::vector<ArgMax>(heads));
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    std::vector<ArgMax> block_best(heads);
    BlockWalker walker(keys_only(span));
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      std::fill(block_best.begin(), block_best.end(), ArgMax{});
      k.hard_scan_heads(query, scales, heads, block, block_best.data());
      merge_block_best(block_best, map, first, span.ids, part_best[p].data());
    });
  });
  return merge_part_best(part_best, heads, span.ids);
}

namespace {

// Rows of a batch's sub-block: about 256 KiB of keys and values as float32, which stay in L2 (512 KiB and
// up on every CPU kind we run on) while each query of the batch scans them. Counted at float32 whatever the
// stored precision, so that compact rows are scanned in the same pieces as the float32 rows they widen to
// (the online softmax rescales at the same rows: the same bits).
std::size_t batch_sub_rows(const RowSpan& span) {
  const std::size_t bytes = 4 * (span.dim + (span.values != nullptr ? span.value_dim : 0));
  return std::clamp<std::size_t>(std::size_t{256 * 1024} / std::max<std::size_t>(1, bytes), 16, kScanBlockRows);
}

}  // namespace

std::vector<SoftmaxState> heads_soft_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                                const float* scales, std::size_t heads, const RowSpan& span,
                                                const EligibleRows& rows, std::size_t parts) {
  const std::size_t d = span.dim, dv = span.value_dim, dvh = dv / heads;
  const auto split = split_runs(rows, parts);
  struct PartState {
    std::vector<float> max, sum, acc;  // nq * heads, nq * heads, nq * dv
  };
  std::vector<PartState> part_states(split.size());
  const std::size_t sub = batch_sub_rows(span);
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    PartState& st = part_states[p];
    st.max.assign(nq * heads, -std::numeric_limits<float>::infinity());
    st.sum.assign(nq * heads, 0.0f);
    st.acc.assign(nq * dv, 0.0f);
    BlockWalker walker(span);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t s0 = 0; s0 < block.rows; s0 += sub) {
        const RowSpan piece = block.sub(s0, std::min(sub, block.rows - s0));
        for (std::size_t b = 0; b < nq; ++b)
          k.soft_scan_heads(queries + b * d, scales + b * heads, heads, piece, st.max.data() + b * heads,
                            st.sum.data() + b * heads, st.acc.data() + b * dv, nullptr);
      }
    });
  });
  std::vector<SoftmaxState> merged(nq * heads, SoftmaxState(dvh));
  for (const PartState& st : part_states) {
    SoftmaxState part(dvh);
    for (std::size_t i = 0; i < nq * heads; ++i) {
      part.max = st.max[i];
      part.sum = st.sum[i];
      std::copy_n(st.acc.begin() + static_cast<std::ptrdiff_t>(i * dvh), dvh, part.acc.begin());
      merged[i].merge(part);
    }
  }
  return merged;
}

std::vector<ArgMax> heads_hard_scan_batch(const KernelTable& k, const float* queries, std::size_t nq, const float* scales,
                                          std::size_t heads, const RowSpan& span, const EligibleRows& rows,
                                          std::size_t parts) {
  const std::size_t d = span.dim;
  const auto split = split_runs(rows, parts);
  std::vector<std::vector<ArgMax>> part_best(split.size(), std::vector<ArgMax>(nq * heads));
  const RowSpan keys = keys_only(span);
  const std::size_t sub = batch_sub_rows(keys);
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    std::vector<ArgMax> block_best(heads);
    BlockWalker walker(keys);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      for (std::size_t s0 = 0; s0 < block.rows; s0 += sub) {
        const RowSpan piece = block.sub(s0, std::min(sub, block.rows - s0));
        for (std::size_t b = 0; b < nq; ++b) {
          std::fill(block_best.begin(), block_best.end(), ArgMax{});
          k.hard_scan_heads(queries + b * d, scales + b * heads, heads, piece, block_best.data());
          for (ArgMax& one : block_best)
            if (one.row != ArgMax::kNoRow) one.row += s0;  // relative to the block, as merge_block_best takes it
          merge_block_best(block_best, map, first, span.ids, part_best[p].data() + b * heads);
        }
      }
    });
  });
  return merge_part_best(part_best, nq * heads, span.ids);
}

}  // namespace softkv::detail
