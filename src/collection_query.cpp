// Collection's query doors. Each asks the query plan (query/plan.hpp) how to answer, once, and runs it
// through the paths of src/query/: one pass for every query of the call, or each query on its own.
#include <cmath>
#include <exception>
#include <limits>
#include <string>

#include "assert.hpp"
#include "collection_impl.hpp"
#include "query/paths.hpp"
#include "query/plan.hpp"
#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

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

// One soft query on its own, as the plan says; iterated (Hopfield retrieval: x <- softmax(beta K x)^T V
// until the relative change <= tolerance) when options.iterations > 1.
SoftResult soft_single(const detail::CollectionImpl& impl, const detail::QueryPlan& plan, std::span<const float> query,
                       const QueryOptions& options) {
  auto once = [&](std::span<const float> x) {
    std::vector<float> factors;
    const std::vector<float> q =
        plan.heads ? detail::head_queries(impl, x, plan.scale, factors) : detail::scaled_queries(impl, x, plan.scale, factors);
    if (plan.coalesce) return detail::soft_coalesced(impl, q.data(), factors.data(), options);
    if (plan.heads) return detail::soft_heads(impl, q.data(), factors.data(), options);
    return detail::soft_one(impl, q.data(), factors[0], options, plan.single);
  };
  if (options.iterations == 1) return once(query);
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

// One hard query on its own, as the plan says.
HardResult hard_single(const detail::CollectionImpl& impl, const detail::QueryPlan& plan, std::span<const float> query,
                       const QueryOptions& options) {
  std::vector<float> factors;
  const std::vector<float> q =
      plan.heads ? detail::head_queries(impl, query, plan.scale, factors) : detail::scaled_queries(impl, query, plan.scale, factors);
  if (plan.coalesce) return detail::hard_coalesced(impl, q.data(), factors.data(), options);
  if (plan.heads) return detail::hard_heads(impl, q.data(), factors.data(), options);
  return detail::hard_one(impl, q.data(), factors[0], options);
}

// Executes a plan over its n row-major queries.
QueryResults run(const detail::CollectionImpl& impl, const detail::QueryPlan& plan, std::span<const float> queries,
                 const QueryOptions& options) {
  const std::size_t d = impl.dim();
  SOFTKV_ASSERT(queries.size() == plan.n * d, "a plan for as many queries as the call holds");
  QueryResults out;
  if (plan.path == detail::QueryPath::each) {
    for (std::size_t i = 0; i < plan.n; ++i) {
      const std::span<const float> row = queries.subspan(i * d, d);
      if (plan.kind == Retrieval::hard) out.hard.push_back(hard_single(impl, plan, row, options));
      else out.soft.push_back(soft_single(impl, plan, row, options));
    }
    return out;
  }
  if (plan.path == detail::QueryPath::estimated) {
    std::vector<float> f;
    const std::vector<float> q = detail::scaled_queries(impl, queries, plan.scale, f);
    std::vector<std::exception_ptr> errors;
    out.soft = detail::all_or_throw(detail::soft_estimated(impl, q.data(), f.data(), plan.n, options, errors), errors);
    return out;
  }
  const bool heads = plan.path == detail::QueryPath::heads_fused;
  std::vector<float> f;
  const std::vector<float> q =
      heads ? detail::head_queries(impl, queries, plan.scale, f) : detail::scaled_queries(impl, queries, plan.scale, f);
  std::vector<std::exception_ptr> errors;
  if (plan.kind == Retrieval::hard) {
    out.hard = detail::all_or_throw(heads ? detail::hard_heads_fused(impl, q.data(), f.data(), plan.n, options, errors)
                                          : detail::hard_fused(impl, q.data(), f.data(), plan.n, options, errors),
                                    errors);
  } else {
    out.soft = detail::all_or_throw(heads ? detail::soft_heads_fused(impl, q.data(), f.data(), plan.n, options, errors)
                                          : detail::soft_fused(impl, q.data(), f.data(), plan.n, options, {}, errors),
                                    errors);
  }
  return out;
}

}  // namespace

QueryResults Collection::query(std::span<const float> queries, Retrieval kind, const QueryOptions& options) const {
  const std::size_t d = impl_->dim();
  if (queries.empty())
    throw Error(ErrorCode::dimension_mismatch, "no query: give at least one query of d = " + std::to_string(d) + " floats");
  if (queries.size() % d != 0)
    throw Error(ErrorCode::dimension_mismatch, "queries hold " + std::to_string(queries.size()) + " floats, not a multiple of d = " +
                                                   std::to_string(d));
  // Checked whole here, so that a bad value is named by its row in the batch, whichever path answers.
  detail::check_finite(queries, "query", d);
  const detail::QueryPlan plan = detail::plan_query(impl_->config(), impl_->coalescing(), options, queries.size() / d, kind);
  return detail::guard_memory([&] { return run(*impl_, plan, queries, options); });
}

SoftResult Collection::query_soft(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  return std::move(this->query(query, Retrieval::soft, options).soft.front());
}

HardResult Collection::query_hard(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  return std::move(this->query(query, Retrieval::hard, options).hard.front());
}

SoftBatchResult Collection::query_soft_batch(std::span<const float> queries, const QueryOptions& options) const {
  if (options.top_m != 0) throw Error(ErrorCode::invalid_argument, "batched queries do not report contributors: top_m must be 0");
  const QueryResults answers = this->query(queries, Retrieval::soft, options);
  return detail::guard_memory([&] {
    SoftBatchResult result;
    for (const SoftResult& r : answers.soft) {
      result.values.insert(result.values.end(), r.value.begin(), r.value.end());
      result.lse.push_back(r.lse);
      result.max_score.push_back(r.max_score);
      for (const HeadResult& head : r.heads) {
        result.head_lse.push_back(head.lse);
        result.head_max_score.push_back(head.max_score);
      }
    }
    return result;
  });
}

HardBatchResult Collection::query_hard_batch(std::span<const float> queries, const QueryOptions& options) const {
  const QueryResults answers = this->query(queries, Retrieval::hard, options);
  return detail::guard_memory([&] {
    HardBatchResult result;
    for (const HardResult& r : answers.hard) {
      result.ids.push_back(r.id);
      result.scores.push_back(r.score);
      result.values.insert(result.values.end(), r.value.begin(), r.value.end());
      result.head_ids.insert(result.head_ids.end(), r.head_ids.begin(), r.head_ids.end());
      result.head_scores.insert(result.head_scores.end(), r.head_scores.begin(), r.head_scores.end());
    }
    return result;
  });
}

float Collection::resolve_scale(const QueryOptions& options) const { return detail::resolve_scale(impl_->config(), options); }

void Collection::check_options(const QueryOptions& options, Retrieval kind) const {
  (void)detail::plan_query(impl_->config(), false, options, 1, kind);
}

}  // namespace softkv
