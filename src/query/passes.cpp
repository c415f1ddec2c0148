// One pass for many queries (paths.hpp): the fused batch over the (eligible) rows, and the coalescer
// that gathers single queries from concurrent callers into such a pass (docs/PERFORMANCE.md, "Coalescing").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "assert.hpp"
#include "collection_impl.hpp"
#include "mask.hpp"
#include "query/paths.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"

namespace softkv::detail {
namespace {

// A pass that reads fewer bytes than this (about 100 us at the read bandwidth of the machines we
// measured on) runs at once instead of waiting for the running pass: waking the next pass's leader
// costs tens of microseconds on a loaded machine, which for a small collection is longer than the
// pass itself (measured: 16 connections of hard queries on N = 1,000, d = 128 served 15,000 queries/s
// in passes of 1-2 queries, against 41,000/s with coalescing off).
inline constexpr std::size_t kCoalesceMinBytes = std::size_t{4} << 20;

// Serves pending through its coalescer and returns its answer or rethrows its error: at once (counted
// as a pass of one) when a pass over bytes_per_row bytes of each of rows rows is short; otherwise at
// once on an idle collection, or in a later pass.
template <class Pending, class Alone, class Batch>
auto served(Coalescer<Pending>& coalescer, Pending& pending, std::size_t rows, std::size_t bytes_per_row, const Alone& alone,
            const Batch& batch) {
  if (rows * bytes_per_row < kCoalesceMinBytes) coalescer.run_now(pending, alone);
  else coalescer.run(pending, alone, batch);
  if (pending.error) std::rethrow_exception(pending.error);
  return std::move(pending.result);
}

// The waiting queries of one pass side by side (row-major n x d) with their factors (per_query each:
// 1, or h for multi-head), as the fused paths take them.
template <class Pending>
void gather(std::span<Pending* const> members, std::size_t d, std::size_t per_query, std::vector<float>& q, std::vector<float>& factors) {
  q.resize(members.size() * d);
  factors.resize(members.size() * per_query);
  for (std::size_t b = 0; b < members.size(); ++b) {
    std::copy_n(members[b]->query, d, q.begin() + static_cast<std::ptrdiff_t>(b * d));
    std::copy_n(members[b]->factors, per_query, factors.begin() + static_cast<std::ptrdiff_t>(b * per_query));
  }
}

// Hands a pass's answers to its members: each gets its result or its own error.
template <class Pending, class Result>
void deliver(std::span<Pending* const> members, std::vector<Result>& results, const std::vector<std::exception_ptr>& errors) {
  for (std::size_t b = 0; b < members.size(); ++b) {
    if (errors[b]) members[b]->error = errors[b];
    else members[b]->result = std::move(results[b]);
  }
}

}  // namespace

std::vector<SoftResult> soft_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                   const QueryOptions& options, std::span<const std::size_t> top_m,
                                   std::vector<std::exception_ptr>& errors, PassChoice* choice) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  return soft_fused_locked(impl, q, factors, n, options, top_m, errors, choice);
}

std::vector<SoftResult> soft_fused_locked(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                          const QueryOptions& options, std::span<const std::size_t> top_m,
                                          std::vector<std::exception_ptr>& errors, PassChoice* choice) {
  const RowSpan span = impl.span();
  const std::size_t d = impl.dim(), dv = impl.value_dim();
  const KernelTable& kernels = detail::kernels();
  std::optional<EligibleRows> mask;
  if (has_mask(options)) mask = impl.eligible(options);
  const std::size_t rows = mask ? mask->count : span.rows;
  const std::size_t parts = impl.parts_for(options, (d + dv) * n);
  const EligibleRows* only = mask ? &*mask : nullptr;
  const PassChoice::Way way = choice != nullptr ? choice->choose(n) : PassChoice::Way::batch;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<SoftmaxState> states = way == PassChoice::Way::each ? soft_scan_each_split(kernels, q, n, factors, span, parts, only)
                                                                        : soft_scan_batch_split(kernels, q, n, factors, span, parts, only);
  if (choice != nullptr) choice->note(way, n, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count(), rows);
  SOFTKV_ASSERT(top_m.empty() || top_m.size() == n, "one top_m per query of a fused pass");
  std::vector<SoftResult> out(n);
  errors.assign(n, nullptr);
  for (std::size_t b = 0; b < n; ++b) {
    try {
      SoftResult& r = out[b];
      r.lse = states[b].lse();
      CollectionImpl::check_lse(r.lse);
      r.max_score = states[b].max;
      r.candidates = rows;
      r.rows_scored = rows;
      r.value = blended_value(kernels, q + b * d, factors[b], span, states[b], only);
      if (!top_m.empty() && top_m[b] > 0) {  // contributors: a keys-only top-m pass of this query's own
        for (const auto& item : top_k_scan(kernels, q + b * d, factors[b], span, top_m[b], impl.parts_for(options, d), only))
          r.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - r.lse)), item.score});
      }
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

std::vector<HardResult> hard_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                   const QueryOptions& options, std::vector<std::exception_ptr>& errors, PassChoice* choice) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t parts = impl.parts_for(options, impl.dim() * n);
  std::optional<EligibleRows> mask;
  if (has_mask(options)) mask = impl.eligible(options);
  const EligibleRows* only = mask ? &*mask : nullptr;
  const PassChoice::Way way = choice != nullptr ? choice->choose(n) : PassChoice::Way::batch;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<ArgMax> best = way == PassChoice::Way::each ? hard_scan_each_split(detail::kernels(), q, n, factors, span, parts, only)
                                                                : hard_scan_batch_split(detail::kernels(), q, n, factors, span, parts, only);
  if (choice != nullptr)
    choice->note(way, n, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count(),
                 mask ? mask->count : span.rows);
  std::vector<HardResult> out(n);
  errors.assign(n, nullptr);
  for (std::size_t b = 0; b < n; ++b) {
    try {
      check_best(best[b]);
      out[b] = {span.ids[best[b].row], best[b].score, value_vector(span, best[b].row), IndexKind::exact, {}, {}};
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

SoftResult soft_coalesced(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options) {
  SoftPending pending;
  pending.query = q;
  pending.factors = factors;
  pending.top_m = options.top_m;
  if (impl.heads() > 1) {
    return served(impl.soft_coalescer(), pending, impl.size_hint(), impl.row_bytes(),
                  [&](SoftPending& me) { me.result = soft_heads(impl, me.query, me.factors, options); },
                  [&](std::span<SoftPending* const> members) {
                    std::vector<float> all, f;
                    gather(members, impl.dim(), impl.heads(), all, f);
                    std::vector<std::exception_ptr> errors;
                    std::vector<SoftResult> results = soft_heads_fused(impl, all.data(), f.data(), members.size(), options, errors);
                    deliver(members, results, errors);
                  });
  }
  return served(impl.soft_coalescer(), pending, impl.size_hint(), impl.row_bytes(),
                [&](SoftPending& me) { me.result = soft_one(impl, me.query, me.factors[0], options, SinglePath::scan); },
                [&](std::span<SoftPending* const> members) {
                  std::vector<float> all, f;
                  gather(members, impl.dim(), 1, all, f);
                  std::vector<std::size_t> top_m(members.size());  // each member's own
                  for (std::size_t b = 0; b < members.size(); ++b) top_m[b] = members[b]->top_m;
                  std::vector<std::exception_ptr> errors;
                  std::vector<SoftResult> results =
                      soft_fused(impl, all.data(), f.data(), members.size(), options, top_m, errors, &impl.soft_pass_choice());
                  deliver(members, results, errors);
                });
}

HardResult hard_coalesced(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options) {
  HardPending pending;
  pending.query = q;
  pending.factors = factors;
  const std::size_t per_query = impl.heads();
  return served(impl.hard_coalescer(), pending, impl.size_hint(), impl.key_row_bytes(),
                [&](HardPending& me) {
                  me.result = per_query > 1 ? hard_heads(impl, me.query, me.factors, options) : hard_one(impl, me.query, me.factors[0], options);
                },
                [&](std::span<HardPending* const> members) {
                  std::vector<float> all, f;
                  gather(members, impl.dim(), per_query, all, f);
                  std::vector<std::exception_ptr> errors;
                  std::vector<HardResult> results = per_query > 1 ? hard_heads_fused(impl, all.data(), f.data(), members.size(), options, errors)
                                                                  : hard_fused(impl, all.data(), f.data(), members.size(), options, errors,
                                                                               &impl.hard_pass_choice());
                  deliver(members, results, errors);
                });
}

}  // namespace softkv::detail
