// Query masks: eligibility from the tags and excluded rows, and the scans over eligible runs.
#include "mask.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "softkv/error.hpp"
#include "scan.hpp"
#include "row_walk.hpp"
#include "thread_pool.hpp"

namespace softkv::detail {

bool has_mask(const QueryOptions& options) noexcept {
  return !options.tags_any.empty() || options.tag_range.has_value() || !options.exclude_ids.empty();
}

void check_mask(const QueryOptions& options) {
  if (options.tags_any.size() > QueryOptions::kMaxTagsAny)
    throw Error(ErrorCode::invalid_argument, "tags_any holds " + std::to_string(options.tags_any.size()) + " tags; at most " +
                                                 std::to_string(QueryOptions::kMaxTagsAny) + " are allowed");
  if (options.exclude_ids.size() > QueryOptions::kMaxExcludeIds)
    throw Error(ErrorCode::invalid_argument, "exclude_ids holds " + std::to_string(options.exclude_ids.size()) +
                                                 " ids; at most " + std::to_string(QueryOptions::kMaxExcludeIds) + " are allowed");
  if (options.tag_range && options.tag_range->lo > options.tag_range->hi)
    throw Error(ErrorCode::invalid_argument, "tag_range has lo " + std::to_string(options.tag_range->lo) + " above hi " +
                                                 std::to_string(options.tag_range->hi));
}

namespace {

// Appends the rows of [begin, end) that keep(tag) accepts to out, as runs. The loop reads the tags only.
template <class Keep>
void collect_runs(std::span<const std::uint64_t> tags, const Keep& keep, EligibleRows& out) {
  std::size_t r = 0;
  const std::size_t n = tags.size();
  while (r < n) {
    while (r < n && !keep(tags[r])) ++r;
    const std::size_t begin = r;
    while (r < n && keep(tags[r])) ++r;
    if (r > begin) out.runs.push_back({begin, r - begin});
  }
}

// Cuts the (sorted, distinct) excluded rows out of the runs.
void cut_excluded(EligibleRows& rows, std::span<const std::size_t> excluded) {
  if (excluded.empty()) return;
  std::vector<RowRun> kept;
  kept.reserve(rows.runs.size() + excluded.size());
  std::size_t e = 0;
  for (RowRun run : rows.runs) {
    const std::size_t end = run.begin + run.count;
    while (e < excluded.size() && excluded[e] < run.begin) ++e;
    std::size_t from = run.begin;
    for (; e < excluded.size() && excluded[e] < end; ++e) {
      if (excluded[e] > from) kept.push_back({from, excluded[e] - from});
      from = excluded[e] + 1;
    }
    if (end > from) kept.push_back({from, end - from});
  }
  rows.runs = std::move(kept);
}

}  // namespace

EligibleRows eligible_rows(std::span<const std::uint64_t> tags, const QueryOptions& options,
                           std::span<const std::size_t> excluded_rows) {
  std::vector<std::uint64_t> any = options.tags_any;
  std::sort(any.begin(), any.end());
  any.erase(std::unique(any.begin(), any.end()), any.end());
  const TagRange range = options.tag_range.value_or(TagRange{});
  // The range test is two compares; a set of up to 8 tags is compared in turn, a larger one searched.
  auto in_range = [&](std::uint64_t t) { return t >= range.lo && t <= range.hi; };
  EligibleRows out;
  if (any.empty()) {
    collect_runs(tags, in_range, out);
  } else if (any.size() <= 8) {
    collect_runs(tags, [&](std::uint64_t t) { return in_range(t) && std::find(any.begin(), any.end(), t) != any.end(); }, out);
  } else {
    collect_runs(tags, [&](std::uint64_t t) { return in_range(t) && std::binary_search(any.begin(), any.end(), t); }, out);
  }
  std::vector<std::size_t> excluded(excluded_rows.begin(), excluded_rows.end());
  excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());  // an id given twice
  cut_excluded(out, excluded);
  for (const RowRun& run : out.runs) out.count += run.count;
  return out;
}

std::vector<std::uint8_t> eligible_flags(const EligibleRows& rows, std::size_t total_rows) {
  std::vector<std::uint8_t> flags(total_rows, 0);
  for (const RowRun& run : rows.runs) std::fill_n(flags.begin() + static_cast<std::ptrdiff_t>(run.begin), run.count, 1);
  return flags;
}

SoftScan masked_soft_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                          const EligibleRows& rows, std::size_t parts, std::size_t top_m) {
  top_m = std::min(top_m, rows.count);
  const auto split = split_runs(rows, parts);
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

std::vector<float> masked_blended_value(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                        const EligibleRows& rows, const SoftmaxState& state) {
  std::vector<float> value(state.acc.size());
  const float inv = 1.0f / state.sum;
  for (std::size_t i = 0; i < value.size(); ++i) value[i] = state.acc[i] * inv;
  const bool finite = std::all_of(value.begin(), value.end(), [](float x) { return std::isfinite(x); });
  if (finite || !std::isfinite(state.lse())) return value;
  // As blended_value: the same scores, weighted and summed in double (reading eligible rows only).
  const std::size_t dv = span.value_dim;
  std::vector<double> acc(dv, 0.0);
  double sum = 0.0;
  std::vector<float> scores(kScanBlockRows);
  BlockWalker walker(span);
  walker.walk(rows.runs, [&](const RowSpan& block, const std::size_t*, std::size_t) {
    for (std::size_t start = 0; start < block.rows; start += kScanBlockRows) {
      const RowSpan piece = block.sub(start, std::min(kScanBlockRows, block.rows - start));
      k.scores(query, scale, piece, scores.data());
      std::vector<float> v(dv);
      for (std::size_t r = 0; r < piece.rows; ++r) {
        const double w = std::exp(static_cast<double>(scores[r]) - static_cast<double>(state.max));
        sum += w;
        value_row(block, start + r, v.data());
        for (std::size_t i = 0; i < dv; ++i) acc[i] += w * static_cast<double>(v[i]);
      }
    }
  });
  for (std::size_t i = 0; i < dv; ++i) value[i] = static_cast<float>(acc[i] / sum);
  return value;
}

ArgMax masked_hard_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                        const EligibleRows& rows, std::size_t parts) {
  const auto split = split_runs(rows, parts);
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

std::vector<SoftmaxState> masked_soft_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                                 const float* scales, const RowSpan& span, const EligibleRows& rows,
                                                 std::size_t parts) {
  const std::size_t d = span.dim, dv = span.value_dim;
  const auto split = split_runs(rows, parts);
  struct PartState {
    std::vector<float> max, sum, acc;
  };
  std::vector<PartState> part_states(split.size());
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    PartState& st = part_states[p];
    st.max.assign(nq, -std::numeric_limits<float>::infinity());
    st.sum.assign(nq, 0.0f);
    st.acc.assign(nq * dv, 0.0f);
    std::vector<float> scratch(batch_scratch_floats(std::min(nq, kBatchLanes * 4), d));
    BlockWalker walker(span);
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t*, std::size_t) {
      for (std::size_t b = 0; b < nq; b += kBatchLanes * 4) {
        const std::size_t n = std::min(kBatchLanes * 4, nq - b);
        k.soft_scan_batch(queries + b * d, n, scales + b, block, st.max.data() + b, st.sum.data() + b, st.acc.data() + b * dv,
                          scratch.data());
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

std::vector<ArgMax> masked_hard_scan_batch(const KernelTable& k, const float* queries, std::size_t nq,
                                           const float* scales, const RowSpan& span, const EligibleRows& rows,
                                           std::size_t parts) {
  const std::size_t d = span.dim;
  const auto split = split_runs(rows, parts);
  std::vector<std::vector<ArgMax>> part_best(split.size(), std::vector<ArgMax>(nq));
  ThreadPool::shared().run(split.size(), [&](std::size_t p) {
    std::vector<float> scratch(batch_scratch_floats(std::min(nq, kBatchLanes * 4), d));
    std::vector<ArgMax> block_best(nq);
    BlockWalker walker(keys_only(span));
    walker.walk(split[p], [&](const RowSpan& block, const std::size_t* map, std::size_t first) {
      std::fill(block_best.begin(), block_best.end(), ArgMax{});
      for (std::size_t b = 0; b < nq; b += kBatchLanes * 4) {
        const std::size_t n = std::min(kBatchLanes * 4, nq - b);
        k.hard_scan_batch(queries + b * d, n, scales + b, block, block_best.data() + b, scratch.data());
      }
      merge_block_best(block_best, map, first, span.ids, part_best[p].data());
    });
  });
  return merge_part_best(part_best, nq, span.ids);
}

std::vector<TopScores::Item> masked_top_k_scan(const KernelTable& k, const float* query, float scale, const RowSpan& span,
                                               const EligibleRows& rows, std::size_t top_k, std::size_t parts) {
  top_k = std::min(top_k, rows.count);
  const auto split = split_runs(rows, parts);
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

}  // namespace softkv::detail
