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
    std::vector<double> acc(dvh, 0.0);
    double sum = 0.0;
    std::vector<float> key(d), v(dv);
    BlockWalker walker(span);
    walker.walk(rows.runs, [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t r = 0; r < block.rows; ++r) {
        key_row(block, r, key.data());
        const float s = scales[j] * k.dot(query + j * dh, key.data() + j * dh, dh);
        const double w = std::exp(static_cast<double>(s) - static_cast<double>(state.max));
        sum += w;
        value_row(block, r, v.data());
        for (std::size_t i = 0; i < dvh; ++i) acc[i] += w * static_cast<double>(v[j * dvh + i]);
      }
    });
    for (std::size_t i = 0; i < dvh; ++i) value[j * dvh + i] = static_cast<float>(acc[i] / sum);
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

}  // namespace softkv::detail
