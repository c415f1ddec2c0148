// Multi-head queries (paths.hpp): every head of every query from one pass over the eligible rows.
#include <cmath>

#include "collection_impl.hpp"
#include "heads_scan.hpp"
#include "mask.hpp"
#include "query/paths.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"

namespace softkv::detail {
namespace {

// A multi-head soft answer from its heads' merged states (and top lists, if any): per-head lse, max
// and contributors, the concatenated value (redone in double for a head whose accumulator overflowed).
SoftResult heads_answer(const KernelTable& kernels, const float* q, const float* factors, std::size_t h,
                        const RowSpan& span, const EligibleRows& rows,
                        const std::vector<SoftmaxState>& states,
                        const std::vector<std::vector<TopScores::Item>>& top) {
  SoftResult result;
  result.heads.resize(h);
  for (std::size_t j = 0; j < h; ++j) {
    HeadResult& head = result.heads[j];
    head.lse = states[j].lse();
    CollectionImpl::check_lse(head.lse);
    head.max_score = states[j].max;
    if (!top.empty())
      for (const auto& item : top[j])
        head.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - head.lse)), item.score});
  }
  result.value = heads_blended_value(kernels, q, factors, h, span, rows, states);
  result.lse = result.heads[0].lse;
  result.max_score = result.heads[0].max_score;
  result.top = result.heads[0].top;
  result.candidates = rows.count;
  result.rows_scored = rows.count;
  return result;
}

// A multi-head hard answer from its heads' argmaxes: head j's winner (ties to the smallest id) gives value slice j.
HardResult heads_hard_answer(const CollectionImpl& impl, const RowSpan& span, const ArgMax* best) {
  const std::size_t h = impl.heads(), dvh = impl.value_dim() / h;
  HardResult result;
  result.value.resize(impl.value_dim());
  std::vector<float> v(impl.value_dim());
  for (std::size_t j = 0; j < h; ++j) {
    check_best(best[j]);
    result.head_ids.push_back(span.ids[best[j].row]);
    result.head_scores.push_back(best[j].score);
    value_row(span, best[j].row, v.data());
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(j * dvh), dvh, result.value.begin() + static_cast<std::ptrdiff_t>(j * dvh));
  }
  result.id = result.head_ids[0];
  result.score = result.head_scores[0];
  return result;
}

}  // namespace

// One multi-head soft query (prepared by head_queries): every head from one pass over the eligible rows.
SoftResult soft_heads(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const KernelTable& kernels = detail::kernels();
  const EligibleRows rows = has_mask(options) ? impl.eligible(options) : all_rows(span.rows);
  const std::size_t parts = impl.parts_for(options, impl.dim() + impl.value_dim());
  const HeadsSoftScan scan = heads_soft_scan(kernels, q, factors, h, span, rows, parts, options.top_m);
  return heads_answer(kernels, q, factors, h, span, rows, scan.states, scan.top);
}

// One multi-head hard query.
HardResult hard_heads(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const EligibleRows rows = has_mask(options) ? impl.eligible(options) : all_rows(span.rows);
  const std::vector<ArgMax> best =
      heads_hard_scan(detail::kernels(), q, factors, h, span, rows, impl.parts_for(options, impl.dim()));
  return heads_hard_answer(impl, span, best.data());
}

// nq multi-head queries (prepared by head_queries) in one pass over the eligible rows; a failure that
// belongs to one query (its lse or score overflowed) is that query's (errors[b]), not the batch's.
std::vector<SoftResult> soft_heads_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t nq,
                                         const QueryOptions& options, std::vector<std::exception_ptr>& errors) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t h = impl.heads(), d = impl.dim();
  const KernelTable& kernels = detail::kernels();
  const EligibleRows rows = has_mask(options) ? impl.eligible(options) : all_rows(span.rows);
  const std::vector<SoftmaxState> states = heads_soft_scan_batch(
      kernels, q, nq, factors, h, span, rows, impl.parts_for(options, (impl.dim() + impl.value_dim()) * nq));
  std::vector<SoftResult> out(nq);
  errors.assign(nq, nullptr);
  for (std::size_t b = 0; b < nq; ++b) {
    try {
      const std::vector<SoftmaxState> mine(states.begin() + static_cast<std::ptrdiff_t>(b * h),
                                                   states.begin() + static_cast<std::ptrdiff_t>((b + 1) * h));
      out[b] = heads_answer(kernels, q + b * d, factors + b * h, h, span, rows, mine, {});
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

// The same for hard queries.
std::vector<HardResult> hard_heads_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t nq,
                                         const QueryOptions& options, std::vector<std::exception_ptr>& errors) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const EligibleRows rows = has_mask(options) ? impl.eligible(options) : all_rows(span.rows);
  const std::vector<ArgMax> best = heads_hard_scan_batch(detail::kernels(), q, nq, factors, h, span, rows,
                                                                         impl.parts_for(options, impl.dim() * nq));
  std::vector<HardResult> out(nq);
  errors.assign(nq, nullptr);
  for (std::size_t b = 0; b < nq; ++b) {
    try {
      out[b] = heads_hard_answer(impl, span, best.data() + b * h);
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

}  // namespace softkv::detail
