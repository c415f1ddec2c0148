// The paths a query plan (plan.hpp) runs: each takes prepared queries (validated, normalised for
// cosine, split with the scale by split_scale: `q` with one factor per query, or per head slice on a
// multi-head collection) and answers under the collection's read lock. Only Collection::query and
// these files include it.
#pragma once

#include <cstddef>
#include <exception>
#include <new>
#include <span>
#include <vector>

#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "query/plan.hpp"

namespace softkv::detail {

class CollectionImpl;
class PassChoice;
struct ArgMax;
struct PrunedSoft;
struct BoundsSummary;
struct EligibleRows;
struct EligibleTotals;

/// Runs a query body; an allocation failure (a huge batch, top_m or top_k) becomes Error(resource_exhausted).
template <class F>
auto guard_memory(F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::resource_exhausted, "the query needs more memory than is available");
  }
}

/// A batch's results, or its first failing query's error (a call answers all its queries or throws).
template <class Result>
std::vector<Result> all_or_throw(std::vector<Result> results, const std::vector<std::exception_ptr>& errors) {
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

/// Error(numeric_overflow) for a best score that left the float range; EveryScoreBelowRange when no row scored above -FLT_MAX.
void check_best(const ArgMax& best);

// ---- preparing queries ----
/// Validated row-major queries, normalised for cosine, each split with scale; factors gets one per query.
[[nodiscard]] std::vector<float> scaled_queries(const CollectionImpl& impl, std::span<const float> queries, float scale,
                                                std::vector<float>& factors);
/// The same per head slice (normalised per slice for cosine): factors gets n x h, head j scoring as slice j alone would.
[[nodiscard]] std::vector<float> head_queries(const CollectionImpl& impl, std::span<const float> queries, float scale,
                                              std::vector<float>& factors);

// ---- one query on its own (single.cpp) ----
/// An error_target query's answer from the collection's certified lists (soft_one and soft_estimated; the
/// caller holds the read lock and checked that the lists exist and no mask applies): the walk's answer
/// within target for sure, or its head's estimate over the lists (estimate_over_lists). nullopt otherwise
/// (the walk saw the mass spread over the lists, or its head's estimate could not meet the target), with
/// the rows the walk visited — the lists of largest bound — in stratum: the block sample scores them
/// exactly and leaves them out of its blocks (estimated_soft). bounds and live: the lists' bounds for this
/// query computed beforehand (a batch's, CertifiedLists::bounds_batch, with what their pass gathered in
/// summary), or null; scorer: where lists are scored (a batch's shared reads), or null. apart (if given):
/// the rows the walk scored that are not in stratum (ListHead::apart), for the answer's rows_scored.
[[nodiscard]] std::optional<PrunedSoft> estimate_through_lists(const CollectionImpl& impl, const float* q, float f, double target,
                                                               std::size_t top_m, std::vector<std::size_t>& stratum,
                                                               const double* bounds = nullptr, const std::uint32_t* live = nullptr,
                                                               ListScorer* scorer = nullptr, const BoundsSummary* summary = nullptr,
                                                               std::size_t* apart = nullptr);

/// A masked block sample's known totals (soft_one and soft_estimated, under the read lock): the eligible
/// rows' value sums and squares. A mask of tags_any (options; with exclude_ids, at most max(2 chunks,
/// 1/kBudgetDivisor) of them, whose rows are taken out one by one) takes them from the collection's
/// per-tag sums (TagTotals), none (rows 0) while its tags are being summed (a sweep reading the values of
/// max(16 chunks, 1/8 of the eligible rows) rows a query); a tag_range or no tags_any from the chunk sums
/// (ValueChunks), none when more than max(2 chunks, 1/kBudgetDivisor) of the eligible rows lie outside
/// whole chunks (a mask of many short runs) or while its stale chunks hold more than max(16 chunks, 1/8)
/// of them (summed a share per query). None when memory ran out.
[[nodiscard]] EligibleTotals masked_totals(const CollectionImpl& impl, const EligibleRows& mask, const QueryOptions& options);

/// Soft: the exact scan, or pruned (top_k, epsilon) or estimated (error_target) as `path` says, within
/// the planner's budget (an index not built yet: the exact scan).
[[nodiscard]] SoftResult soft_one(const CollectionImpl& impl, const float* q, float f, const QueryOptions& options, SinglePath path);
/// A pruned, estimated or exact answer as a SoftResult: lse (checked), max, candidates, tail bound, rows
/// scored, error estimate, value and contributors; the caller sets what searched and what is guaranteed.
[[nodiscard]] SoftResult soft_result(PrunedSoft&& p);
/// Hard: through an approximate index when the plan says so and it is ready, else the exact scan.
[[nodiscard]] HardResult hard_one(const CollectionImpl& impl, const float* q, float f, const QueryOptions& options);

// ---- every query in one pass (passes.cpp); a failure that belongs to one query is errors[b] ----
/// Soft, over the eligible rows; top_m (empty, or one per query) asks for contributors. choice: null
/// for the batch kernel (a batch call: the same bits every time), or the collection's PassChoice for a
/// coalesced pass (the batch kernel, or each query's single-query scan over cached chunks: the answers
/// of the queries alone, bit for bit; whichever has measured cheaper for this many queries).
[[nodiscard]] std::vector<SoftResult> soft_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                 const QueryOptions& options, std::span<const std::size_t> top_m,
                                                 std::vector<std::exception_ptr>& errors, PassChoice* choice = nullptr);
/// soft_fused for a caller that holds the read lock and has checked for entries.
[[nodiscard]] std::vector<SoftResult> soft_fused_locked(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                        const QueryOptions& options, std::span<const std::size_t> top_m,
                                                        std::vector<std::exception_ptr>& errors, PassChoice* choice = nullptr);
/// Soft with error_target > 0 for n queries (estimated.cpp): each query's certified walk, then one
/// shared sample of blocks for the rest (each block read once for the batch), then one fused pass over
/// every row for the queries the sample could not answer.
[[nodiscard]] std::vector<SoftResult> soft_estimated(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                     const QueryOptions& options, std::vector<std::exception_ptr>& errors);
/// Hard, over the eligible keys; choice as soft_fused's.
[[nodiscard]] std::vector<HardResult> hard_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                 const QueryOptions& options, std::vector<std::exception_ptr>& errors,
                                                 PassChoice* choice = nullptr);

// ---- multi-head (heads.cpp): every head from one pass over the eligible rows ----
/// One soft query, with its heads' contributors when options.top_m > 0.
[[nodiscard]] SoftResult soft_heads(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options);
/// One hard query.
[[nodiscard]] HardResult hard_heads(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options);
/// n soft queries in one pass (no contributors).
[[nodiscard]] std::vector<SoftResult> soft_heads_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                       const QueryOptions& options, std::vector<std::exception_ptr>& errors);
/// n hard queries in one pass.
[[nodiscard]] std::vector<HardResult> hard_heads_fused(const CollectionImpl& impl, const float* q, const float* factors, std::size_t n,
                                                       const QueryOptions& options, std::vector<std::exception_ptr>& errors);

// ---- coalesced single queries (passes.cpp): at once, or in a shared pass with other callers' ----
/// A soft scan (heads: factors holds one per head; else factors[0]).
[[nodiscard]] SoftResult soft_coalesced(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options);
/// A hard scan.
[[nodiscard]] HardResult hard_coalesced(const CollectionImpl& impl, const float* q, const float* factors, const QueryOptions& options);

}  // namespace softkv::detail
