// The query plan (plan.hpp): option checks and routing, once for every door.
#include "query/plan.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "mask.hpp"
#include "softkv/error.hpp"
#include "validate.hpp"

namespace softkv::detail {
namespace {

// The iteration options: their ranges, soft only, and dv == d when the value becomes the next query.
void check_iterations(const CollectionConfig& config, const QueryOptions& options, Retrieval kind) {
  if (options.iterations < 1 || options.iterations > QueryOptions::kMaxIterations)
    throw Error(ErrorCode::invalid_argument, "iterations must lie in [1, " + std::to_string(QueryOptions::kMaxIterations) +
                                                 "], got " + std::to_string(options.iterations));
  if (!(std::isfinite(options.tolerance) && options.tolerance >= 0.0f))
    throw Error(ErrorCode::invalid_argument, "tolerance must be finite and >= 0, got " + float_text(options.tolerance));
  if (options.iterations > 1 && kind == Retrieval::hard)
    throw Error(ErrorCode::invalid_argument, "iterations > 1 apply to soft retrieval only (the blended value is the next query)");
  if (options.iterations > 1 && config.value_dim != config.dim)
    throw Error(ErrorCode::invalid_argument, "iterations > 1 feed the value back as the query, which needs value_dim (" +
                                                 std::to_string(config.value_dim) + ") == dim (" + std::to_string(config.dim) + ")");
}

// The soft query's pruning and estimate options: consistent, supported here, and with the index they need.
void check_pruning(const CollectionConfig& config, const QueryOptions& options) {
  if (options.error_target) {
    const float t = *options.error_target;
    if (!(t >= 0.0f) || !std::isfinite(t))
      throw Error(ErrorCode::invalid_argument, "error_target must be finite and >= 0 (0 asks for the exact answer), got " + float_text(t));
    if (options.top_k || options.epsilon) throw Error(ErrorCode::invalid_argument, "give error_target or top_k / epsilon, not both");
    if (config.heads > 1)
      throw Error(ErrorCode::unsupported, "error_target is not supported on multi-head collections (heads = " +
                                              std::to_string(config.heads) + "): query without it");
    return;
  }
  if (!options.top_k && !options.epsilon) return;
  if (options.top_k && options.epsilon) throw Error(ErrorCode::invalid_argument, "give top_k or epsilon, not both");
  if (config.heads > 1)
    throw Error(ErrorCode::unsupported, "pruned queries (top_k, epsilon) are not supported on multi-head collections (heads = " +
                                            std::to_string(config.heads) + "): query without top_k and epsilon");
  if (options.top_k && *options.top_k == 0) throw Error(ErrorCode::invalid_argument, "top_k must be >= 1");
  if (options.epsilon && !(*options.epsilon > 0.0f && *options.epsilon < 1.0f))
    throw Error(ErrorCode::invalid_argument, "epsilon must lie in (0, 1), got " + float_text(*options.epsilon));
  if (config.index.kind == IndexKind::exact)
    throw Error(ErrorCode::invalid_argument,
                "top_k and epsilon need a pruning index; create the collection with index.kind flat, hnsw, ivf or automatic");
  if (options.ef_search == 0 || options.nprobe == 0) throw Error(ErrorCode::invalid_argument, "ef_search and nprobe must be >= 1");
}

// How one query runs on its own. Hard queries ignore the soft-only options (top_k, epsilon, error_target).
SinglePath single_path(const CollectionConfig& config, const QueryOptions& options, Retrieval kind) {
  if (options.exact) return SinglePath::scan;
  if (kind == Retrieval::hard) {
    // hnsw and ivf (automatic becomes ivf) answer hard queries through their index, one query at a
    // time: the fused batch kernel has no index. flat would read every key like the scan.
    const IndexKind k = config.index.kind;
    return k == IndexKind::hnsw || k == IndexKind::ivf || k == IndexKind::automatic ? SinglePath::through_index : SinglePath::scan;
  }
  if (options.error_target && *options.error_target > 0.0f) return SinglePath::estimated;
  if (options.top_k || options.epsilon) return SinglePath::pruned;
  return SinglePath::scan;
}

}  // namespace

float resolve_scale(const CollectionConfig& config, const QueryOptions& options) {
  if (options.scale && options.temperature) throw Error(ErrorCode::invalid_argument, "give a temperature or a scale, not both");
  const double head_dim = static_cast<double>(config.dim / config.heads);
  if (options.scale) {
    if (!(std::isfinite(*options.scale) && *options.scale > 0.0f))
      throw Error(ErrorCode::invalid_argument, "scale must be finite and > 0, got " + float_text(*options.scale));
    return *options.scale;
  }
  if (options.temperature) {
    const float t = *options.temperature;
    if (!(std::isfinite(t) && t > 0.0f)) throw Error(ErrorCode::invalid_argument, "temperature must be finite and > 0, got " + float_text(t));
    const double s = 1.0 / (std::sqrt(head_dim) * t);
    if (!(s <= static_cast<double>(std::numeric_limits<float>::max())))
      throw Error(ErrorCode::invalid_argument, "temperature " + float_text(t) + " is too small: the scale overflows a float");
    return static_cast<float>(s);
  }
  if (config.scale) return *config.scale;
  return static_cast<float>(1.0 / std::sqrt(head_dim));
}

QueryPlan plan_query(const CollectionConfig& config, bool coalescing, const QueryOptions& options, std::size_t n, Retrieval kind) {
  if (kind != Retrieval::soft && kind != Retrieval::hard) throw Error(ErrorCode::invalid_argument, "unknown retrieval kind");
  QueryPlan plan;
  plan.kind = kind;
  plan.n = n;
  plan.scale = resolve_scale(config, options);
  check_mask(options);
  check_iterations(config, options, kind);
  if (kind == Retrieval::soft) check_pruning(config, options);
  plan.heads = config.heads > 1;
  plan.single = single_path(config, options, kind);
  const bool masked = has_mask(options);
  // Contributors (top_m) come from each query's own pass: a soft call that wants them runs query by query.
  const bool contributors = kind == Retrieval::soft && options.top_m > 0;
  if (n > 1 && options.iterations == 1 && plan.single == SinglePath::scan && !contributors)
    plan.path = plan.heads ? QueryPath::heads_fused : QueryPath::fused;
  // Estimates share their reads: the blocks a batch samples are read once for all its queries.
  if (n > 1 && options.iterations == 1 && plan.single == SinglePath::estimated) plan.path = QueryPath::estimated;
  // A query on its own may wait for a coalesced pass when it scans every row: masked queries run alone
  // (a pass serves its members over the same rows), and so do a multi-head query's contributors (from
  // its own pass's sinks).
  plan.coalesce = coalescing && plan.path == QueryPath::each && plan.single == SinglePath::scan && !masked &&
                  !(plan.heads && contributors);
  return plan;
}

bool shares_a_pass(const CollectionConfig& config, const QueryOptions& options, Retrieval kind) {
  return plan_query(config, false, options, 2, kind).path != QueryPath::each;
}

}  // namespace softkv::detail
