// Collection's queries: scale resolution, one scoring rule for every path, exact, pruned and batched
// soft and hard retrieval, and the numeric checks that turn an unrepresentable answer into an error.
#include <algorithm>
#include <exception>
#include <cmath>
#include <limits>
#include <new>
#include <string>

#include "collection_impl.hpp"
#include "heads_scan.hpp"
#include "mask.hpp"
#include "estimate.hpp"
#include "pruning.hpp"
#include "scan.hpp"
#include "score_range.hpp"
#include "simd/kernel_table.hpp"
#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

// Candidates an approximate index is asked for when a hard query goes through it: rescored with our
// kernel, the best wins with ties to the smallest id, so up to this many tied keys are ordered right.
constexpr std::size_t kHardCandidates = 64;

// The hard-retrieval side of the rule soft queries follow through their lse: a score above FLT_MAX
// (or NaN) anywhere, or no score above -FLT_MAX at all, is numeric_overflow.
void check_best(const detail::ArgMax& best) {
  if (best.overflow)
    throw Error(ErrorCode::numeric_overflow, "a score left the float range; use a smaller scale or a larger temperature");
  if (best.row == detail::ArgMax::kNoRow) throw detail::EveryScoreBelowRange();
}

// Runs a query body; an allocation failure (a huge batch, top_m or top_k) becomes a typed error.
template <class F>
auto guard_memory(F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::resource_exhausted, "the query needs more memory than is available");
  }
}

// The validated queries, normalised for cosine, each split with the scale (split_scale): the form
// every kernel takes. scales gets one factor per query.
// (Templates: Collection::Impl is private and cannot be named here.)
template <class Impl>
std::vector<float> scaled_queries(const Impl& impl, std::span<const float> queries, float scale,
                                  std::vector<float>& scales) {
  std::size_t count = 0;
  std::vector<float> q = impl.prepare_queries(queries, count);
  const std::size_t d = impl.dim();
  scales.resize(count);
  for (std::size_t b = 0; b < count; ++b) scales[b] = detail::split_scale(std::span<float>(q.data() + b * d, d), scale);
  return q;
}

// The fused soft batch; rows receives the entry count the scan saw (under the same lock).
template <class Impl>
SoftBatchResult soft_batch(const Impl& impl, std::span<const float> queries, float scale, const QueryOptions& options,
                           std::size_t& rows) {
  std::vector<float> factor;
  const std::vector<float> q = scaled_queries(impl, queries, scale, factor);
  const std::size_t nq = factor.size();

  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  rows = span.rows;
  const std::size_t parts = impl.parts_for(options, (impl.dim() + impl.value_dim()) * nq);
  const detail::KernelTable& kernels = detail::kernels();
  std::optional<detail::EligibleRows> mask;
  if (detail::has_mask(options)) mask = impl.eligible(options);
  if (mask) rows = mask->count;
  const std::vector<detail::SoftmaxState> states =
      mask ? detail::masked_soft_scan_batch(kernels, q.data(), nq, factor.data(), span, *mask, parts)
           : detail::soft_scan_batch_split(kernels, q.data(), nq, factor.data(), span, parts);

  const std::size_t d = impl.dim(), dv = impl.value_dim();
  SoftBatchResult result;
  result.values.resize(nq * dv);
  result.lse.resize(nq);
  result.max_score.resize(nq);
  for (std::size_t b = 0; b < nq; ++b) {
    result.lse[b] = states[b].lse();
    Impl::check_lse(result.lse[b]);
    result.max_score[b] = states[b].max;
    const std::vector<float> value = mask ? detail::masked_blended_value(kernels, q.data() + b * d, factor[b], span, *mask, states[b])
                                          : detail::blended_value(kernels, q.data() + b * d, factor[b], span, states[b]);
    std::copy(value.begin(), value.end(), result.values.begin() + static_cast<std::ptrdiff_t>(b * dv));
  }
  return result;
}

// Rows of up to k candidates for a masked pruned query. flat (filter_after false): its fused top-k pass
// runs over the eligible rows only, so they are exactly the top k eligible rows. hnsw/ivf: over-fetch
// and filter (flags marks eligible rows): ask for k * rows / eligible, then 4x more until k eligible
// ones come back; past a quarter of the rows a search costs about what the exact masked scan does,
// so none then (pruned_soft runs the exact scan of its scope).
template <class Impl>
std::vector<std::size_t> masked_candidates(const Impl& impl, const detail::KernelTable& kernels, const float* q, float f,
                                           const detail::EligibleRows& mask, const std::vector<std::uint8_t>& flags, std::size_t k,
                                           std::size_t parts, const QueryOptions& options, bool filter_after) {
  const detail::RowSpan span = impl.span();
  std::vector<std::size_t> kept;
  if (!filter_after) {
    for (const auto& item : detail::masked_top_k_scan(kernels, q, f, span, mask, k, parts)) kept.push_back(*impl.row_of(item.id));
    return kept;
  }
  for (std::size_t ask = std::max(k, k * span.rows / mask.count);; ask *= 4) {
    if (ask > span.rows / 4) return {};
    kept.clear();
    for (std::size_t row : impl.index_rows(q, f, ask, options)) {
      if (flags[row] == 0) continue;
      kept.push_back(row);
      if (kept.size() == k) break;
    }
    if (kept.size() == k) return kept;
  }
}

// One soft query on its own (prepared and split: q, f), pruned or exact, contributors included.
template <class Impl>
SoftResult soft_one(const Impl& impl, const float* q, float f, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::size_t parts = impl.parts_for(options, impl.dim() + impl.value_dim());
  const detail::KernelTable& kernels = detail::kernels();
  const bool prune = (options.top_k || options.epsilon) && impl.use_index(options);
  const detail::PruningIndex* index = impl.index();
  // The planner's budget: what a pruned path may spend before the exact scan costs less (pruning.hpp).
  const std::size_t budget = detail::prune_budget(span.rows, impl.row_bytes());
  auto exact = [&] { return detail::exact_soft(kernels, q, f, span, options.top_m, parts); };
  // flat with epsilon: every search reads all keys, so after a first cheap try (k = 16) one pass
  // fetches everything the doubling could still ask for (up to a quarter of the rows or the budget,
  // best first) and later k take its prefixes, which are exactly the top-k of a fresh pass.
  std::vector<std::size_t> best_first;
  const bool reuse = prune && options.epsilon && index->exact_top_k() && index->lists() == nullptr;
  // A mask: the scans visit eligible rows only (scope.exact); candidates come from masked_candidates.
  std::optional<detail::EligibleRows> mask;
  std::vector<std::uint8_t> flags;
  detail::PruneScope scope;
  if (detail::has_mask(options)) {
    mask = impl.eligible(options);
    scope.n = mask->count;
    scope.exact = [&] {
      detail::PrunedSoft r{detail::masked_soft_scan(kernels, q, f, span, *mask, parts, options.top_m), {}, mask->count, 0.0};
      r.value = detail::masked_blended_value(kernels, q, f, span, *mask, r.scan.state);
      return r;
    };
    if (prune && !index->exact_top_k()) {
      flags = detail::eligible_flags(*mask, span.rows);
      scope.flags = &flags;
    }
  }
  const detail::CandidateFinder index_find = [&](std::size_t k) {
    if (!reuse) return impl.index_rows(q, f, k, options);
    if (best_first.size() < k)
      best_first = impl.index_rows(q, f, best_first.empty() ? k : std::max(k, std::min(span.rows / 4, budget)), options);
    return std::vector<std::size_t>(best_first.begin(), best_first.begin() + static_cast<std::ptrdiff_t>(std::min(k, best_first.size())));
  };
  const bool filter_after = prune && mask && !index->exact_top_k();
  const detail::CandidateFinder masked_find = [&](std::size_t k) {
    return masked_candidates(impl, kernels, q, f, *mask, flags, k, parts, options, filter_after);
  };
  const detail::CandidateFinder& find = mask ? masked_find : index_find;
  const detail::PruneScope* in_scope = mask ? &scope : nullptr;
  const std::size_t check = prune && !index->exact_top_k() ? options.check_sample : 0;
  // What a round of the pruned path costs in row-equivalents (pruning.hpp): the keys it reads (flat: all
  // of them, hnsw: 2M neighbours of ef graph nodes), and the candidates and sampled rows it gathers out of order.
  const double key_share = static_cast<double>(impl.key_row_bytes()) / static_cast<double>(impl.row_bytes());
  const detail::RoundCost cost{[&](std::size_t k) -> std::size_t {
                                 const std::size_t gathered = (k + check) * detail::kRandomRowCost;
                                 if (index->exact_top_k()) return static_cast<std::size_t>(key_share * static_cast<double>(span.rows)) + gathered;
                                 // HNSW's search reads up to 2M neighbours of each of its ef closest nodes, out of order.
                                 const std::size_t nodes = 2 * std::max(options.ef_search, k) * impl.config().index.hnsw_m;
                                 return nodes * detail::kRandomRowCost + gathered;
                               },
                               budget};
  bool walked_lists = false;  // an error_target query answered by a certified walk
  auto plan = [&]() -> detail::PrunedSoft {
    if (options.error_target && *options.error_target > 0.0f && !options.exact) {
      const double target = *options.error_target;
      // Certified lists first: a walk whose guaranteed tail bound is <= target / 2 answers within the
      // target for sure (dropping a share tau of the mass moves the blend by at most 2 tau max ||v||_inf),
      // reading only the lists that hold the mass (peaked attention). It gives up early when the bounds
      // show the mass is spread.
      if (!mask && impl.use_index(options) && index->lists() != nullptr) {  // (the walk visits every row of a list: no mask)
        const detail::ListTarget walk{0, target / 2, budget / 2};
        if (std::optional<detail::PrunedSoft> walked = detail::certified_soft(
                kernels, *index->lists(), q, f, span, [&](std::uint64_t id) { return *impl.row_of(id); }, walk, options.top_m)) {
          walked->error_estimate = std::min(1.0, 2 * walked->tail_bound);
          walked_lists = true;
          return std::move(*walked);
        }
      }
      // Then a sample of blocks of rows (spread attention), up to an eighth of the rows over all rounds; the
      // rounds give up as soon as their error says the target needs more, and the exact scan answers.
      // (Small collections too: a sample past an eighth of the rows would cost more than the scan.) With a
      // mask, the sample draws from the eligible rows and the budget is an eighth of them.
      const std::size_t rows = mask ? mask->count : span.rows;
      const detail::EstimateTarget sample{target, impl.value_max(), rows / 8, detail::seed_of(q, impl.dim(), rows), options.top_m};
      std::optional<detail::PrunedSoft> estimated = detail::estimated_soft(kernels, q, f, span, sample, mask ? &*mask : nullptr);
      if (!estimated) {
        detail::PrunedSoft all = mask ? scope.exact() : exact();
        all.error_estimate = 0.0;
        return all;
      }
      return std::move(*estimated);
    }
    if (!prune) return mask ? scope.exact() : exact();
    if (!mask && index->lists() != nullptr) {  // certified lists: the walk keeps to the budget itself
      // top_k gets half the budget: whether the k-th score will beat the next bound shows only by walking
      // (the bounds alone rarely rule it out), so a hopeless walk wastes what it may spend.
      const detail::ListTarget target{options.top_k.value_or(0), options.epsilon.value_or(0.0f), options.top_k ? budget / 2 : budget};
      std::optional<detail::PrunedSoft> walked;
      if (!options.top_k || *options.top_k < span.rows)
        walked = detail::certified_soft(kernels, *index->lists(), q, f, span, [&](std::uint64_t id) { return *impl.row_of(id); },
                                        target, options.top_m);
      return walked ? std::move(*walked) : exact();
    }
    if (options.top_k) {
      // A single round: when it alone costs more than the exact scan would, the scan answers.
      const bool small = budget == std::numeric_limits<std::size_t>::max();
      if (!mask && !small && cost(*options.top_k) >= span.rows) return exact();
      return detail::pruned_soft(kernels, q, f, span, *options.top_k, options.top_m, parts, find, check, in_scope);
    }
    return detail::adaptive_soft(kernels, q, f, span, *options.epsilon, options.top_m, parts, find, check, in_scope,
                                 mask ? detail::RoundCost{} : cost);
  };
  detail::PrunedSoft pruned = plan();
  detail::SoftScan& scan = pruned.scan;

  SoftResult result;
  result.lse = scan.state.lse();
  Impl::check_lse(result.lse);
  result.max_score = scan.state.max;
  result.candidates = pruned.k;
  result.tail_bound = pruned.tail_bound;
  result.rows_scored = pruned.rows_scored != 0 ? pruned.rows_scored : pruned.k;
  result.error_estimate = pruned.error_estimate.value_or(0.0);
  const bool scanned_all = pruned.k == (mask ? mask->count : span.rows);
  if (pruned.error_estimate) {  // error_target: a walk's guaranteed tail bound, or a sample's (nothing dropped: 0)
    result.searched_with = walked_lists && !scanned_all ? index->kind() : IndexKind::exact;
    result.tail_bound_guaranteed = true;
  } else {
    result.searched_with = scanned_all ? IndexKind::exact : index->kind();
    result.mask_filtered_after_search = filter_after && !scanned_all;
    result.tail_bound_guaranteed = scanned_all || index->exact_top_k();
  }
  result.value = std::move(pruned.value);
  result.top.reserve(scan.top.size());
  for (const auto& item : scan.top)
    result.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - result.lse)), item.score});
  return result;
}

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
auto served(detail::Coalescer<Pending>& coalescer, Pending& pending, std::size_t rows, std::size_t bytes_per_row,
            const Alone& alone, const Batch& batch) {
  if (rows * bytes_per_row < kCoalesceMinBytes) coalescer.run_now(pending, alone);
  else coalescer.run(pending, alone, batch);
  if (pending.error) std::rethrow_exception(pending.error);
  return std::move(pending.result);
}

// The waiting queries of one pass side by side (row-major nq x d) with their factors, as the batch kernels take them.
template <class Pending>
void gather(std::span<Pending* const> members, std::size_t d, std::vector<float>& q, std::vector<float>& factor) {
  q.resize(members.size() * d);
  factor.resize(members.size());
  for (std::size_t b = 0; b < members.size(); ++b) {
    std::copy_n(members[b]->query, d, q.begin() + static_cast<std::ptrdiff_t>(b * d));
    factor[b] = members[b]->factor;
  }
}

// One coalesced pass of soft queries: the fused batch kernel over every row once, each query with its
// own factor; contributors, for the queries that want them, from a keys-only top-m pass each.
template <class Impl>
void soft_pass(const Impl& impl, std::span<detail::SoftPending* const> members, const QueryOptions& options) {
  const std::size_t nq = members.size(), d = impl.dim(), dv = impl.value_dim();
  std::vector<float> q, factor;
  gather(members, d, q, factor);
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const detail::KernelTable& kernels = detail::kernels();
  const std::vector<detail::SoftmaxState> states =
      detail::soft_scan_batch_split(kernels, q.data(), nq, factor.data(), span, impl.parts_for(options, (d + dv) * nq));
  for (std::size_t b = 0; b < nq; ++b) {
    detail::SoftPending& m = *members[b];
    try {
      SoftResult r;
      r.lse = states[b].lse();
      Impl::check_lse(r.lse);
      r.max_score = states[b].max;
      r.candidates = span.rows;
      r.rows_scored = span.rows;
      r.value = detail::blended_value(kernels, q.data() + b * d, factor[b], span, states[b]);
      if (m.top_m > 0)
        for (const auto& item : detail::top_k_scan(kernels, q.data() + b * d, factor[b], span, m.top_m, impl.parts_for(options, d)))
          r.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - r.lse)), item.score});
      m.result = std::move(r);
    } catch (...) {
      m.error = std::current_exception();
    }
  }
}

// Whether a soft query takes a path of its own (pruned: top_k, epsilon; estimated: error_target) rather
// than a pass over every row shared with other queries (a fused batch, a coalesced pass).
bool answered_alone(const QueryOptions& options) { return options.top_k || options.epsilon || options.error_target; }

// One hard query on its own: through an approximate index when it has one, else the exact scan.
template <class Impl>
HardResult hard_one(const Impl& impl, const float* q, float f, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const detail::KernelTable& kernels = detail::kernels();
  detail::ArgMax best;
  HardResult result;
  const IndexKind index_kind = impl.use_index(options) ? impl.index()->kind() : IndexKind::exact;
  std::optional<detail::EligibleRows> mask;
  std::vector<std::uint8_t> flags;
  if (detail::has_mask(options)) mask = impl.eligible(options);
  if (index_kind == IndexKind::hnsw || index_kind == IndexKind::ivf) {
    // The index's best candidates (hnsw: approximate; ivf: the exact top 1), rescored with our kernel (ties to the smallest id); flat would
    // read every key like the scan below, so it gains nothing here. A mask over-fetches and filters.
    std::size_t ask = impl.index()->exact_top_k() ? 1 : kHardCandidates;  // certified lists: the true best
    if (mask) {
      flags = detail::eligible_flags(*mask, span.rows);
      ask = std::max(ask, ask * span.rows / mask->count);
      if (ask > span.rows / 4) ask = 0;  // a search that large costs what the exact masked scan does
    }
    for (std::size_t row : ask == 0 ? std::vector<std::size_t>{} : impl.index_rows(q, f, ask, options)) {
      if (mask && flags[row] == 0) continue;
      const detail::RowSpan one = span.sub(row, 1);
      detail::ArgMax candidate;
      kernels.hard_scan(q, f, one, candidate);
      if (candidate.row != detail::ArgMax::kNoRow) candidate.row = row;
      detail::merge_argmax(candidate, span.ids, best);
    }
    result.searched_with = index_kind;
  }
  if (best.row == detail::ArgMax::kNoRow && !best.overflow) {
    const std::size_t parts = impl.parts_for(options, impl.dim());
    best = mask ? detail::masked_hard_scan(kernels, q, f, span, *mask, parts) : detail::hard_scan_split(kernels, q, f, span, parts);
    result.searched_with = IndexKind::exact;
  }
  check_best(best);
  result.id = span.ids[best.row];
  result.score = best.score;
  result.value = detail::value_vector(span, best.row);
  return result;
}

// One coalesced pass of exact hard queries: the batched argmax over the keys once.
template <class Impl>
void hard_pass(const Impl& impl, std::span<detail::HardPending* const> members, const QueryOptions& options) {
  const std::size_t nq = members.size(), d = impl.dim();
  std::vector<float> q, factor;
  gather(members, d, q, factor);
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::vector<detail::ArgMax> best =
      detail::hard_scan_batch_split(detail::kernels(), q.data(), nq, factor.data(), span, impl.parts_for(options, d * nq));
  for (std::size_t b = 0; b < nq; ++b) {
    detail::HardPending& m = *members[b];
    try {
      check_best(best[b]);
      const std::size_t row = best[b].row;
      m.result = {span.ids[row], best[b].score, detail::value_vector(span, row), IndexKind::exact, {}, {}};
    } catch (...) {
      m.error = std::current_exception();
    }
  }
}


// Multi-head: the validated queries (normalised per head slice for cosine), each head slice split with
// the scale on its own, so head j scores exactly as a collection of slice j alone would; factors gets
// nq x h factors.
template <class Impl>
std::vector<float> head_queries(const Impl& impl, std::span<const float> queries, float scale, std::vector<float>& factors) {
  std::size_t count = 0;
  std::vector<float> q = impl.prepare_queries(queries, count);
  const std::size_t d = impl.dim(), h = impl.heads(), dh = d / h;
  factors.resize(count * h);
  for (std::size_t b = 0; b < count; ++b)
    for (std::size_t j = 0; j < h; ++j)
      factors[b * h + j] = detail::split_scale(std::span<float>(q.data() + b * d + j * dh, dh), scale);
  return q;
}

// A multi-head soft answer from its heads' merged states (and top lists, if any): per-head lse, max
// and contributors, the concatenated value (redone in double for a head whose accumulator overflowed).
template <class Impl>
SoftResult heads_answer(const detail::KernelTable& kernels, const float* q, const float* factors, std::size_t h,
                        const detail::RowSpan& span, const detail::EligibleRows& rows,
                        const std::vector<detail::SoftmaxState>& states,
                        const std::vector<std::vector<detail::TopScores::Item>>& top) {
  SoftResult result;
  result.heads.resize(h);
  for (std::size_t j = 0; j < h; ++j) {
    HeadResult& head = result.heads[j];
    head.lse = states[j].lse();
    Impl::check_lse(head.lse);
    head.max_score = states[j].max;
    if (!top.empty())
      for (const auto& item : top[j])
        head.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - head.lse)), item.score});
  }
  result.value = detail::heads_blended_value(kernels, q, factors, h, span, rows, states);
  result.lse = result.heads[0].lse;
  result.max_score = result.heads[0].max_score;
  result.top = result.heads[0].top;
  result.candidates = rows.count;
  result.rows_scored = rows.count;
  return result;
}

// One multi-head soft query (prepared by head_queries): every head from one pass over the eligible rows.
template <class Impl>
SoftResult soft_heads(const Impl& impl, const float* q, const float* factors, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const detail::KernelTable& kernels = detail::kernels();
  const detail::EligibleRows rows = detail::has_mask(options) ? impl.eligible(options) : detail::all_rows(span.rows);
  const std::size_t parts = impl.parts_for(options, impl.dim() + impl.value_dim());
  const detail::HeadsSoftScan scan = detail::heads_soft_scan(kernels, q, factors, h, span, rows, parts, options.top_m);
  return heads_answer<Impl>(kernels, q, factors, h, span, rows, scan.states, scan.top);
}

// A multi-head hard answer from its heads' argmaxes: head j's winner (ties to the smallest id) gives value slice j.
template <class Impl>
HardResult heads_hard_answer(const Impl& impl, const detail::RowSpan& span, const detail::ArgMax* best) {
  const std::size_t h = impl.heads(), dvh = impl.value_dim() / h;
  HardResult result;
  result.value.resize(impl.value_dim());
  std::vector<float> v(impl.value_dim());
  for (std::size_t j = 0; j < h; ++j) {
    check_best(best[j]);
    result.head_ids.push_back(span.ids[best[j].row]);
    result.head_scores.push_back(best[j].score);
    detail::value_row(span, best[j].row, v.data());
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(j * dvh), dvh, result.value.begin() + static_cast<std::ptrdiff_t>(j * dvh));
  }
  result.id = result.head_ids[0];
  result.score = result.head_scores[0];
  return result;
}

// One multi-head hard query.
template <class Impl>
HardResult hard_heads(const Impl& impl, const float* q, const float* factors, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const detail::EligibleRows rows = detail::has_mask(options) ? impl.eligible(options) : detail::all_rows(span.rows);
  const std::vector<detail::ArgMax> best =
      detail::heads_hard_scan(detail::kernels(), q, factors, h, span, rows, impl.parts_for(options, impl.dim()));
  return heads_hard_answer(impl, span, best.data());
}

// nq multi-head queries (prepared by head_queries) in one pass over the eligible rows; a failure that
// belongs to one query (its lse or score overflowed) is that query's (errors[b]), not the batch's.
template <class Impl>
std::vector<SoftResult> soft_heads_batch(const Impl& impl, const float* q, const float* factors, std::size_t nq,
                                         const QueryOptions& options, std::vector<std::exception_ptr>& errors) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::size_t h = impl.heads(), d = impl.dim();
  const detail::KernelTable& kernels = detail::kernels();
  const detail::EligibleRows rows = detail::has_mask(options) ? impl.eligible(options) : detail::all_rows(span.rows);
  const std::vector<detail::SoftmaxState> states = detail::heads_soft_scan_batch(
      kernels, q, nq, factors, h, span, rows, impl.parts_for(options, (impl.dim() + impl.value_dim()) * nq));
  std::vector<SoftResult> out(nq);
  errors.assign(nq, nullptr);
  for (std::size_t b = 0; b < nq; ++b) {
    try {
      const std::vector<detail::SoftmaxState> mine(states.begin() + static_cast<std::ptrdiff_t>(b * h),
                                                   states.begin() + static_cast<std::ptrdiff_t>((b + 1) * h));
      out[b] = heads_answer<Impl>(kernels, q + b * d, factors + b * h, h, span, rows, mine, {});
    } catch (...) {
      errors[b] = std::current_exception();
    }
  }
  return out;
}

// The same for hard queries.
template <class Impl>
std::vector<HardResult> hard_heads_batch(const Impl& impl, const float* q, const float* factors, std::size_t nq,
                                         const QueryOptions& options, std::vector<std::exception_ptr>& errors) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const detail::RowSpan span = impl.span();
  const std::size_t h = impl.heads();
  const detail::EligibleRows rows = detail::has_mask(options) ? impl.eligible(options) : detail::all_rows(span.rows);
  const std::vector<detail::ArgMax> best = detail::heads_hard_scan_batch(detail::kernels(), q, nq, factors, h, span, rows,
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

// One soft answer appended to a batch result (value, lse, max and, for multi-head, each head's).
void append_soft(SoftBatchResult& result, const SoftResult& r) {
  result.values.insert(result.values.end(), r.value.begin(), r.value.end());
  result.lse.push_back(r.lse);
  result.max_score.push_back(r.max_score);
  for (const HeadResult& head : r.heads) {
    result.head_lse.push_back(head.lse);
    result.head_max_score.push_back(head.max_score);
  }
}

// A batch's results, or its first failing query's error (a batched call answers all or throws).
template <class Result>
std::vector<Result> all_or_throw(std::vector<Result> results, const std::vector<std::exception_ptr>& errors) {
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

// The waiting multi-head queries of one pass side by side with their heads factors each.
template <class Pending>
void gather_heads(std::span<Pending* const> members, std::size_t d, std::size_t h, std::vector<float>& q,
                  std::vector<float>& factors) {
  q.resize(members.size() * d);
  factors.resize(members.size() * h);
  for (std::size_t b = 0; b < members.size(); ++b) {
    std::copy_n(members[b]->query, d, q.begin() + static_cast<std::ptrdiff_t>(b * d));
    std::copy_n(members[b]->factors, h, factors.begin() + static_cast<std::ptrdiff_t>(b * h));
  }
}

// One coalesced pass of multi-head queries (soft or hard): results and errors go to each member.
template <class Impl, class Pending, class Batch>
void heads_pass(const Impl& impl, std::span<Pending* const> members, const QueryOptions& options, const Batch& batch) {
  std::vector<float> q, factors;
  gather_heads(members, impl.dim(), impl.heads(), q, factors);
  std::vector<std::exception_ptr> errors;
  auto results = batch(impl, q.data(), factors.data(), members.size(), options, errors);
  for (std::size_t b = 0; b < members.size(); ++b) {
    if (errors[b]) members[b]->error = errors[b];
    else members[b]->result = std::move(results[b]);
  }
}

// ||x_new - x_old|| / ||x_old|| in double; a zero x_old gives 0 if x_new is zero too, else +inf.
double relative_change(std::span<const float> x_new, std::span<const float> x_old) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < x_old.size(); ++i) {
    const double a = x_new[i], b = x_old[i];
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

// The iteration options: their ranges, soft only, and dv == d when the value becomes the next query.
template <class Impl>
void check_iterations(const Impl& impl, const QueryOptions& options, Retrieval kind) {
  if (options.iterations < 1 || options.iterations > QueryOptions::kMaxIterations)
    throw Error(ErrorCode::invalid_argument, "iterations must lie in [1, " + std::to_string(QueryOptions::kMaxIterations) +
                                                 "], got " + std::to_string(options.iterations));
  if (!(std::isfinite(options.tolerance) && options.tolerance >= 0.0f))
    throw Error(ErrorCode::invalid_argument, "tolerance must be finite and >= 0, got " + detail::float_text(options.tolerance));
  if (options.iterations > 1 && kind == Retrieval::hard)
    throw Error(ErrorCode::invalid_argument, "iterations > 1 apply to soft retrieval only (the blended value is the next query)");
  if (options.iterations > 1 && impl.value_dim() != impl.dim())
    throw Error(ErrorCode::invalid_argument, "iterations > 1 feed the value back as the query, which needs value_dim (" +
                                                 std::to_string(impl.value_dim()) + ") == dim (" + std::to_string(impl.dim()) + ")");
}

}  // namespace

QueryResults Collection::query(std::span<const float> queries, Retrieval kind, const QueryOptions& options) const {
  const std::size_t d = impl_->dim(), dv = impl_->value_dim();
  if (queries.empty())
    throw Error(ErrorCode::dimension_mismatch, "no query: give at least one query of d = " + std::to_string(d) + " floats");
  if (queries.size() % d != 0)
    throw Error(ErrorCode::dimension_mismatch, "queries hold " + std::to_string(queries.size()) + " floats, not a multiple of d = " +
                                                   std::to_string(d));
  const std::size_t nq = queries.size() / d;
  // Checked whole here, so that a bad value is named by its row in the batch, whichever path answers.
  detail::check_finite(queries, "query", d);
  auto row = [&](std::size_t i) { return queries.subspan(i * d, d); };
  QueryResults out;
  // Multi-head queries share one pass (heads_soft_scan_batch), unless they want contributors or iterate.
  if (impl_->heads() > 1 && options.iterations == 1 && nq > 1 && (kind == Retrieval::hard || options.top_m == 0)) {
    const float scale = resolve_scale(options);
    detail::check_mask(options);
    if (kind == Retrieval::soft) impl_->check_pruning(options);  // top_k / epsilon: unsupported on multi-head collections
    return guard_memory([&] {
      std::vector<float> factors;
      const std::vector<float> q = head_queries(*impl_, queries, scale, factors);
      std::vector<std::exception_ptr> errors;
      if (kind == Retrieval::hard) out.hard = all_or_throw(hard_heads_batch(*impl_, q.data(), factors.data(), nq, options, errors), errors);
      else out.soft = all_or_throw(soft_heads_batch(*impl_, q.data(), factors.data(), nq, options, errors), errors);
      return std::move(out);
    });
  }
  // Iterative queries (and multi-head ones with contributors) run one by one, each a single pass over
  // the rows per iteration.
  if (impl_->heads() > 1 || options.iterations != 1) {
    for (std::size_t i = 0; i < nq; ++i) {
      if (kind == Retrieval::hard) out.hard.push_back(query_hard(row(i), options));
      else out.soft.push_back(query_soft(row(i), options));
    }
    return out;
  }
  if (kind == Retrieval::hard) {
    // hnsw/ivf (and automatic, which becomes ivf) answer through the index, one query at a time;
    // the fused batch kernel has no index.
    const IndexKind index = impl_->config().index.kind;
    const bool approximate = index == IndexKind::hnsw || index == IndexKind::ivf || index == IndexKind::automatic;
    if (nq == 1 || (approximate && !options.exact)) {
      for (std::size_t i = 0; i < nq; ++i) out.hard.push_back(query_hard(row(i), options));
      return out;
    }
    const HardBatchResult b = query_hard_batch(queries, options);
    return guard_memory([&] {
      for (std::size_t i = 0; i < nq; ++i)
        out.hard.push_back({b.ids[i], b.scores[i], {b.values.begin() + static_cast<std::ptrdiff_t>(i * dv),
                                                    b.values.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv)}, IndexKind::exact, {}, {}});
      return std::move(out);
    });
  }
  if (nq == 1 || options.top_m > 0 || answered_alone(options)) {  // contributors, pruning or estimates: one by one
    for (std::size_t i = 0; i < nq; ++i) out.soft.push_back(query_soft(row(i), options));
    return out;
  }
  const float scale = resolve_scale(options);
  detail::check_mask(options);
  return guard_memory([&] {
    std::size_t rows = 0;
    const SoftBatchResult b = soft_batch(*impl_, queries, scale, options, rows);
    for (std::size_t i = 0; i < nq; ++i) {
      SoftResult s;
      s.value.assign(b.values.begin() + static_cast<std::ptrdiff_t>(i * dv), b.values.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
      s.lse = b.lse[i];
      s.max_score = b.max_score[i];
      s.candidates = rows;
      s.rows_scored = rows;
      out.soft.push_back(std::move(s));
    }
    return std::move(out);
  });
}

float Collection::resolve_scale(const QueryOptions& options) const {
  if (options.scale && options.temperature)
    throw Error(ErrorCode::invalid_argument, "give a temperature or a scale, not both");
  if (options.scale) {
    if (!(std::isfinite(*options.scale) && *options.scale > 0.0f))
      throw Error(ErrorCode::invalid_argument, "scale must be finite and > 0, got " + detail::float_text(*options.scale));
    return *options.scale;
  }
  if (options.temperature) {
    const float t = *options.temperature;
    if (!(std::isfinite(t) && t > 0.0f))
      throw Error(ErrorCode::invalid_argument, "temperature must be finite and > 0, got " + detail::float_text(t));
    const double s = 1.0 / (std::sqrt(static_cast<double>(impl_->dim() / impl_->heads())) * t);
    if (!(s <= static_cast<double>(std::numeric_limits<float>::max())))
      throw Error(ErrorCode::invalid_argument, "temperature " + detail::float_text(t) + " is too small: the scale overflows a float");
    return static_cast<float>(s);
  }
  if (impl_->config().scale) return *impl_->config().scale;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(impl_->dim() / impl_->heads())));
}

void Collection::check_options(const QueryOptions& options, Retrieval kind) const {
  (void)resolve_scale(options);
  detail::check_mask(options);
  check_iterations(*impl_, options, kind);
  if (kind == Retrieval::soft) impl_->check_pruning(options);
}

SoftResult Collection::query_soft(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  const float scale = resolve_scale(options);
  detail::check_mask(options);
  check_iterations(*impl_, options, Retrieval::soft);
  // One pass: the query as the collection prepares it (normalised for cosine, split with the scale).
  auto once = [&](std::span<const float> x) {
    return guard_memory([&] {
      std::vector<float> factor;
      if (impl_->heads() > 1) {
        const std::vector<float> q = head_queries(*impl_, x, scale, factor);
        impl_->check_pruning(options);  // top_k / epsilon: unsupported on multi-head collections
        // Contributors come from the single pass's sinks, and a masked query runs alone.
        if (!impl_->coalescing() || options.top_m > 0 || detail::has_mask(options)) return soft_heads(*impl_, q.data(), factor.data(), options);
        detail::SoftPending pending;
        pending.query = q.data();
        pending.factors = factor.data();
        return served(impl_->soft_coalescer(), pending, impl_->size_hint(), impl_->row_bytes(),
                      [&](detail::SoftPending& me) { me.result = soft_heads(*impl_, me.query, me.factors, options); },
                      [&](std::span<detail::SoftPending* const> members) {
                        heads_pass(*impl_, members, options, [](auto&&... a) { return soft_heads_batch(a...); });
                      });
      }
      const std::vector<float> q = scaled_queries(*impl_, x, scale, factor);
      impl_->check_pruning(options);
      // A masked query runs alone: a coalesced pass serves every member over the same rows.
      if (!impl_->coalescing() || answered_alone(options) || detail::has_mask(options))
        return soft_one(*impl_, q.data(), factor[0], options);
      detail::SoftPending pending;
      pending.query = q.data();
      pending.factor = factor[0];
      pending.top_m = options.top_m;
      return served(impl_->soft_coalescer(), pending, impl_->size_hint(), impl_->row_bytes(),
                    [&](detail::SoftPending& me) { me.result = soft_one(*impl_, me.query, me.factor, options); },
                    [&](std::span<detail::SoftPending* const> members) { soft_pass(*impl_, members, options); });
    });
  };
  if (options.iterations == 1) return once(query);
  // Iterative (Hopfield) retrieval: x <- softmax(beta K x)^T V until the relative change <= tolerance.
  std::vector<float> x(query.begin(), query.end());
  SoftResult result;
  for (std::size_t t = 1; t <= options.iterations; ++t) {
    result = once(x);
    result.iterations_run = t;
    result.last_change = relative_change(result.value, x);
    if (result.last_change <= static_cast<double>(options.tolerance)) break;
    x = result.value;
  }
  return result;
}

HardResult Collection::query_hard(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  const float scale = resolve_scale(options);
  detail::check_mask(options);
  check_iterations(*impl_, options, Retrieval::hard);
  return guard_memory([&] {
    std::vector<float> factor;
    if (impl_->heads() > 1) {
      const std::vector<float> q = head_queries(*impl_, query, scale, factor);
      if (!impl_->coalescing() || detail::has_mask(options)) return hard_heads(*impl_, q.data(), factor.data(), options);
      detail::HardPending pending;
      pending.query = q.data();
      pending.factors = factor.data();
      return served(impl_->hard_coalescer(), pending, impl_->size_hint(), impl_->key_row_bytes(),
                    [&](detail::HardPending& me) { me.result = hard_heads(*impl_, me.query, me.factors, options); },
                    [&](std::span<detail::HardPending* const> members) {
                      heads_pass(*impl_, members, options, [](auto&&... a) { return hard_heads_batch(a...); });
                    });
    }
    const std::vector<float> q = scaled_queries(*impl_, query, scale, factor);
    // Only exact scans coalesce: hnsw, ivf and automatic collections answer through their index.
    const IndexKind index = impl_->config().index.kind;
    const bool exact_scan = options.exact || index == IndexKind::exact || index == IndexKind::flat;
    if (!impl_->coalescing() || !exact_scan || detail::has_mask(options)) return hard_one(*impl_, q.data(), factor[0], options);
    detail::HardPending pending;
    pending.query = q.data();
    pending.factor = factor[0];
    return served(impl_->hard_coalescer(), pending, impl_->size_hint(), impl_->key_row_bytes(),
                  [&](detail::HardPending& me) { me.result = hard_one(*impl_, me.query, me.factor, options); },
                  [&](std::span<detail::HardPending* const> members) { hard_pass(*impl_, members, options); });
  });
}

SoftBatchResult Collection::query_soft_batch(std::span<const float> queries, const QueryOptions& options) const {
  if (options.top_m != 0)
    throw Error(ErrorCode::invalid_argument, "batched queries do not report contributors: top_m must be 0");
  const float scale = resolve_scale(options);
  detail::check_mask(options);
  check_iterations(*impl_, options, Retrieval::soft);
  if (impl_->heads() > 1 && options.iterations == 1) {  // one pass for every query and head
    impl_->check_pruning(options);
    return guard_memory([&] {
      std::vector<float> factors;
      const std::vector<float> q = head_queries(*impl_, queries, scale, factors);
      const std::size_t nq = factors.size() / impl_->heads();
      std::vector<std::exception_ptr> errors;
      SoftBatchResult result;
      for (const SoftResult& r : all_or_throw(soft_heads_batch(*impl_, q.data(), factors.data(), nq, options, errors), errors)) {
        append_soft(result, r);
      }
      return result;
    });
  }
  // One by one: each query iterates on its own, or takes a pruned or estimated path of its own (a
  // fused pass over every row would answer it exactly and ignore top_k, epsilon or error_target).
  if (options.iterations != 1 || answered_alone(options)) {
    const std::size_t d = impl_->dim();
    if (queries.empty() || queries.size() % d != 0)
      throw Error(ErrorCode::dimension_mismatch, "queries hold " + std::to_string(queries.size()) + " floats, not a multiple of d = " +
                                                     std::to_string(d));
    const std::size_t nq = queries.size() / d;
    SoftBatchResult result;
    for (std::size_t b = 0; b < nq; ++b) {
      const SoftResult r = query_soft(queries.subspan(b * d, d), options);
      append_soft(result, r);
    }
    return result;
  }
  std::size_t rows = 0;
  return guard_memory([&] { return soft_batch(*impl_, queries, scale, options, rows); });
}

HardBatchResult Collection::query_hard_batch(std::span<const float> queries, const QueryOptions& options) const {
  const float scale = resolve_scale(options);
  detail::check_mask(options);
  check_iterations(*impl_, options, Retrieval::hard);
  if (impl_->heads() > 1) {  // one pass for every query and head
    return guard_memory([&] {
      std::vector<float> factors;
      const std::vector<float> q = head_queries(*impl_, queries, scale, factors);
      const std::size_t nq = factors.size() / impl_->heads();
      std::vector<std::exception_ptr> errors;
      HardBatchResult result;
      for (const HardResult& r : all_or_throw(hard_heads_batch(*impl_, q.data(), factors.data(), nq, options, errors), errors)) {
        result.ids.push_back(r.id);
        result.scores.push_back(r.score);
        result.values.insert(result.values.end(), r.value.begin(), r.value.end());
        result.head_ids.insert(result.head_ids.end(), r.head_ids.begin(), r.head_ids.end());
        result.head_scores.insert(result.head_scores.end(), r.head_scores.begin(), r.head_scores.end());
      }
      return result;
    });
  }
  return guard_memory([&] {
    std::vector<float> factor;
    const std::vector<float> q = scaled_queries(*impl_, queries, scale, factor);
    const std::size_t nq = factor.size();

    const auto lock = impl_->read_lock();
    impl_->require_entries();
    const detail::RowSpan span = impl_->span();
    const std::size_t parts = impl_->parts_for(options, impl_->dim() * nq);
    const std::vector<detail::ArgMax> best =
        detail::has_mask(options)
            ? detail::masked_hard_scan_batch(detail::kernels(), q.data(), nq, factor.data(), span, impl_->eligible(options), parts)
            : detail::hard_scan_batch_split(detail::kernels(), q.data(), nq, factor.data(), span, parts);

    const std::size_t dv = impl_->value_dim();
    HardBatchResult result;
    result.ids.resize(nq);
    result.scores.resize(nq);
    result.values.resize(nq * dv);
    for (std::size_t b = 0; b < nq; ++b) {
      check_best(best[b]);
      result.ids[b] = span.ids[best[b].row];
      result.scores[b] = best[b].score;
      detail::value_row(span, best[b].row, result.values.data() + b * dv);
    }
    return result;
  });
}

}  // namespace softkv
