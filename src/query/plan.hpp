// The query plan: every routing decision of a query call, made once (docs/DESIGN.md, "The data path
// of a query"). plan_query validates the options and decides how the call's queries are grouped
// (one pass for all, or each on its own) and how each runs on its own (a scan that may be coalesced,
// a pruned search, an estimate, an index search). Collection::query executes the plan; the sharded
// server asks the same plan which requests can share a pass.
#pragma once

#include <cstddef>
#include <cstdint>

#include "softkv/types.hpp"

namespace softkv::detail {

/// How the queries of one call are grouped.
enum class QueryPath : std::uint8_t {
  fused,        ///< every query in one pass over the (eligible) rows: the batch kernels
  heads_fused,  ///< multi-head: every query and every head in one pass
  estimated,    ///< soft, error_target > 0, n > 1: each query's certified walk, one shared sample, one fused pass for the rest
  each,         ///< each query on its own path (QueryPlan::single)
};

/// How one query runs on its own.
enum class SinglePath : std::uint8_t {
  scan,           ///< one pass over the eligible rows (every head of a multi-head collection at once)
  pruned,         ///< soft with top_k or epsilon: the index's candidates or certified lists, within the planner's budget
  estimated,      ///< soft with error_target > 0: a certified walk or a sample of row blocks, within the budget
  through_index,  ///< hard on hnsw / ivf / automatic: the index's candidates rescored
};

/// The decisions plan_query makes for one call; Collection::query executes them.
struct QueryPlan {
  Retrieval kind = Retrieval::soft;      ///< soft or hard
  std::size_t n = 0;                     ///< queries in the call
  float scale = 0;                       ///< the resolved score scale
  bool heads = false;                    ///< a multi-head collection (queries are prepared per head slice)
  QueryPath path = QueryPath::each;      ///< how the queries are grouped
  SinglePath single = SinglePath::scan;  ///< each query's path (path == each)
  bool coalesce = false;                 ///< path == each: a query may wait to share a pass with other callers' queries
};

/// The plan for n >= 1 queries of this kind on a collection with this configuration (coalescing on or
/// off), after checking the options as a query would (scale, mask, iterations, pruning options and the
/// index they need): throws the Error the query would throw.
[[nodiscard]] QueryPlan plan_query(const CollectionConfig& config, bool coalescing, const QueryOptions& options, std::size_t n,
                                   Retrieval kind);

/// Whether queries of this kind and options, gathered from several requests into one call, are answered
/// by one pass over the rows (the sharded server merges such requests). Throws as plan_query does.
[[nodiscard]] bool shares_a_pass(const CollectionConfig& config, const QueryOptions& options, Retrieval kind);

/// The score scale of a query: options.scale, else 1/(sqrt(d/h) T) for options.temperature, else the
/// config's scale, else 1/sqrt(d/h). Throws Error(invalid_argument) for both, a bad T or a bad scale.
[[nodiscard]] float resolve_scale(const CollectionConfig& config, const QueryOptions& options);

}  // namespace softkv::detail
