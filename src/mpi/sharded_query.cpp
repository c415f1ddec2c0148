// ShardedCollection's queries: root broadcasts them, every rank scans its shard, one MPI_Allreduce merges.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include "codec/options.hpp"
#include "error_of.hpp"
#include "mpi/sharded_impl.hpp"
#include "mask.hpp"
#include "pruning.hpp"
#include "query/plan.hpp"
#include "score_range.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

using detail::PartialRecords;
using detail::RecordKind;
using detail::SoftmaxState;

// Root's options in every rank (one codec for every QueryOptions field: codec/options.hpp, its full
// form). bytes is root's encoding (its length is in the header every rank has); collective.
QueryOptions broadcast_options(std::vector<std::byte> bytes, std::uint64_t size, int root, MPI_Comm comm) {
  bytes.resize(static_cast<std::size_t>(size));
  MPI_Bcast(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, root, comm);
  detail::ByteReader r(bytes, ErrorCode::internal);
  return detail::get_query_options(r, detail::OptionsForm::full);
}

// The Error of a query that no entry takes part in: an empty collection, or a mask keeping no entry.
Error nothing_eligible(const QueryOptions& options) {
  return detail::has_mask(options)
             ? Error(ErrorCode::empty_collection, "sharded query: the query's mask (tags_any, tag_range, exclude_ids) "
                                                  "leaves no eligible entry on any shard")
             : Error(ErrorCode::empty_collection, "sharded query: no shard holds an entry");
}

// A rank's own failure during a collective step, kept until the reduction tells every rank about it.
struct LocalFailure {
  std::uint32_t code = 0;
  std::string message;

  template <typename Body>
  void run(const Body& body) {
    try {
      body();
    } catch (...) {  // any exception (a FAISS one too): every rank must still reach the reduction that follows
      const detail::ErrorOf e = detail::error_of(std::current_exception());
      code = static_cast<std::uint32_t>(e.code);
      message = e.code == ErrorCode::resource_exhausted ? "sharded query: out of memory on a shard" : e.message;
    }
  }

  // After the reduction: throws the global error (this rank's message when it is the one that failed).
  void rethrow(std::uint32_t global) const {
    if (global == 0) return;
    if (global == code) throw Error(static_cast<ErrorCode>(code), message);
    throw Error(static_cast<ErrorCode>(global),
                "sharded query failed on another rank: " + std::string(to_string(static_cast<ErrorCode>(global))));
  }
};

// n empty records of this shape, allocated on every rank or on none: an allocation that fails on one
// rank only would leave the others waiting in the reduction, so the ranks agree first. Collective.
PartialRecords allocate_records(std::size_t n, RecordKind kind, std::size_t value_dim, std::size_t top_cap, MPI_Comm comm) {
  std::optional<PartialRecords> records;
  int failed = 0;
  try {
    records.emplace(n, kind, value_dim, top_cap);
  } catch (const std::bad_alloc&) {
    failed = 1;
  } catch (const std::length_error&) {
    failed = 1;
  }
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, comm);
  if (failed != 0)
    throw Error(ErrorCode::resource_exhausted, "sharded query: the partial answers of " + std::to_string(n) +
                                                   " queries with a top list of " + std::to_string(top_cap) +
                                                   " do not fit in memory on every rank");
  return std::move(*records);
}

// One soft answer's partial: its (m, l, acc) from a shard's normalised answer (acc = value * l).
SoftmaxState state_of(const SoftResult& r) {
  SoftmaxState s(r.value.size());
  s.max = r.max_score;
  s.sum = static_cast<float>(std::exp(r.lse - static_cast<double>(r.max_score)));
  for (std::size_t i = 0; i < r.value.size(); ++i) s.acc[i] = r.value[i] * s.sum;
  return s;
}

// Fills record i's top list from contributors, best first by (score, smaller id).
void fill_top(PartialRecords& records, std::size_t i, std::vector<Contributor> top) {
  std::sort(top.begin(), top.end(), [](const Contributor& a, const Contributor& b) {
    return a.score > b.score || (a.score == b.score && a.id < b.id);
  });
  const std::size_t n = std::min(top.size(), records.top_ids(i).size());
  for (std::size_t j = 0; j < n; ++j) {
    records.top_ids(i)[j] = top[j].id;
    records.top_scores(i)[j] = top[j].score;
  }
  records.header(i).top_count = static_cast<std::uint32_t>(n);
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// This shard's answers to the n row-major queries. A query for which every row here scores below
// -FLT_MAX is answered by nothing from this shard (sits_out[b] = 1, an empty placeholder answer): one
// collection holding every row would answer it from the other shards' rows, where those hold
// representable scores. The batch runs in one pass; only when that pass fails so does it go query by query.
QueryResults shard_answers(const Collection& shard, const std::vector<float>& queries, std::size_t n, Retrieval kind,
                           const QueryOptions& options, std::vector<std::uint8_t>& sits_out) {
  sits_out.assign(n, 0);
  try {
    return shard.query(queries, kind, options);
  } catch (const detail::EveryScoreBelowRange&) {
  }
  const std::size_t d = queries.size() / n;
  QueryResults r;
  for (std::size_t b = 0; b < n; ++b) {
    const std::span<const float> one(queries.data() + b * d, d);
    try {
      if (kind == Retrieval::soft) r.soft.push_back(shard.query_soft(one, options));
      else r.hard.push_back(shard.query_hard(one, options));
    } catch (const detail::EveryScoreBelowRange&) {
      sits_out[b] = 1;
      if (kind == Retrieval::soft) r.soft.emplace_back();
      else r.hard.emplace_back();
    }
  }
  return r;
}

// The soft answer of a merged record: value = acc / l, contributors weighted by exp(s - lse).
SoftResult soft_answer(PartialRecords& records, std::size_t i) {
  const SoftmaxState s = records.state(i);
  if (s.sum == 0.0f) throw detail::EveryScoreBelowRange();  // every shard sat out (or held no eligible row)
  SoftResult r;
  r.value.resize(s.acc.size());
  for (std::size_t j = 0; j < s.acc.size(); ++j) r.value[j] = s.acc[j] / s.sum;
  r.lse = s.lse();
  if (!std::isfinite(r.lse)) throw Error(ErrorCode::numeric_overflow, "sharded query: the merged log-sum-exp is not finite");
  r.max_score = s.max;
  r.candidates = records.header(i).rows;
  r.rows_scored = r.candidates;
  for (std::size_t j = 0; j < records.header(i).top_count; ++j) {
    const float score = records.top_scores(i)[j];
    r.top.push_back({records.top_ids(i)[j], static_cast<float>(std::exp(static_cast<double>(score) - r.lse)), score});
  }
  return r;
}

}  // namespace

QueryResults detail::ShardScan::exact(const std::vector<float>& queries, std::size_t n, Retrieval kind,
                                      const QueryOptions& options) const {
  const std::size_t dv = shard.config().value_dim;
  // This shard's N: the rows the mask keeps (every row without one). A shard the mask empties sits out.
  LocalFailure failure;
  std::size_t local_rows = 0;
  failure.run([&] { local_rows = shard.eligible_count(options); });
  std::size_t top_m = kind == Retrieval::soft ? options.top_m : 0;
  if (top_m > 0) {  // a top list longer than the collection holds nothing more: cap it at the global N
    std::uint64_t total = local_rows;
    MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_UINT64_T, MPI_SUM, comm);
    top_m = static_cast<std::size_t>(std::min<std::uint64_t>(top_m, total));
  }
  PartialRecords records = allocate_records(n, kind == Retrieval::soft ? RecordKind::soft : RecordKind::hard, dv, top_m, comm);
  if (failure.code != 0) records.set_error(failure.code);
  QueryResults r;  // this shard's own answers (kept for the overflow fallback of soft values)
  std::vector<std::uint8_t> sits_out(n, 1);  // queries this shard contributes nothing to
  if (local_rows > 0 && failure.code == 0) {
    failure.run([&] {
      QueryOptions local = options;
      local.top_k.reset();
      local.epsilon.reset();
      r = shard_answers(shard, queries, n, kind, local, sits_out);
      for (std::size_t b = 0; b < n; ++b) {
        records.header(b).rows = local_rows;
        if (sits_out[b] != 0) continue;  // the empty record: the merge's identity
        if (kind == Retrieval::soft) {
          records.set_state(b, state_of(r.soft[b]));
          fill_top(records, b, r.soft[b].top);
        } else {
          records.header(b).has_best = 1;
          records.header(b).max = r.hard[b].score;
          records.header(b).best_id = r.hard[b].id;
          std::copy(r.hard[b].value.begin(), r.hard[b].value.end(), records.vector(b).begin());
          records.header(b).searched_with = static_cast<std::uint32_t>(r.hard[b].searched_with);
        }
      }
    });
    if (failure.code != 0) records.set_error(failure.code);
  }
  reduce(records);
  failure.rethrow(records.header(0).error);
  if (records.header(0).rows == 0) throw nothing_eligible(options);
  QueryResults out;
  for (std::size_t b = 0; b < n; ++b) {
    if (kind == Retrieval::soft) {
      out.soft.push_back(soft_answer(records, b));
      SoftResult& a = out.soft.back();
      if (!all_finite(a.value)) {  // acc = value * l overflowed: blend the shards' values instead
        std::vector<std::pair<double, const float*>> mine;
        if (sits_out[b] == 0) mine.emplace_back(r.soft[b].lse, r.soft[b].value.data());
        a.value = blend_in_double(mine, a.lse, dv);
      }
    } else {
      if (records.header(b).has_best == 0) throw detail::EveryScoreBelowRange();
      const std::span<float> v = records.vector(b);
      out.hard.push_back({records.header(b).best_id, records.header(b).max, {v.begin(), v.end()},
                            static_cast<IndexKind>(records.header(b).searched_with), {}, {}});
    }
  }
  return out;
}

// One pruned soft query at k: the global top k (each shard's top k merged), then the softmax over
// those rows (each owner contributes its own) and the tail bound from the global k-th score and N.
SoftResult detail::ShardScan::pruned_at(const std::vector<float>& query, std::size_t k, std::size_t local, std::size_t total,
                                        const QueryOptions& options) const {
  const std::size_t dv = shard.config().value_dim;
  // Round 1: candidates. A record of ids and scores only (no vector).
  PartialRecords top(1, RecordKind::soft, 0, k);
  LocalFailure failure;
  if (local > 0) {  // the shard's eligible rows (a mask travels in options; the shard applies it)
    failure.run([&] {
      QueryOptions at_k = options;
      at_k.epsilon.reset();
      at_k.top_k = k;
      at_k.top_m = k;
      SoftResult r;
      try {
        r = shard.query_soft(query, at_k);
      } catch (const detail::EveryScoreBelowRange&) {
        return;  // no candidate of this shard weighs anything: it offers none
      }
      fill_top(top, 0, r.top);
      top.header(0).rows = local;  // summed: the eligible rows of the ranks that answered
      top.header(0).guaranteed = r.tail_bound_guaranteed ? 1 : 0;
      top.header(0).searched_with = static_cast<std::uint32_t>(r.searched_with);
      top.header(0).filtered_after = r.mask_filtered_after_search ? 1 : 0;
    });
    if (failure.code != 0) top.set_error(failure.code);
  }
  reduce(top);
  failure.rethrow(top.header(0).error);
  const std::size_t chosen = top.header(0).top_count;
  if (chosen == 0) throw detail::EveryScoreBelowRange();  // every shard's candidates scored below -FLT_MAX
  const double kth = top.top_scores(0)[chosen - 1];
  // Fewer than k candidates because a rank sat out (its rows all score below -FLT_MAX): one collection
  // would fill its k with such rows (weight 0), count k candidates and bound the tail by the answering
  // ranks' rows alone (with flat: 0). The same here, so that the answer equals one collection's.
  const std::size_t answered = top.header(0).rows;
  const bool short_of_k = chosen < k && answered < total;

  // Round 2: the softmax over the chosen rows, each folded in by its owner with the library's merge.
  PartialRecords soft(1, RecordKind::soft, dv, std::min(options.top_m, chosen));  // only chosen rows contribute
  std::vector<Contributor> mine;       // this rank's chosen rows (id, score)
  std::vector<std::vector<float>> mine_values;
  failure.run([&] {
    SoftmaxState state(dv);
    for (std::size_t j = 0; j < chosen; ++j) {
      const std::uint64_t id = top.top_ids(0)[j];
      if (shard_owner(id, ranks) != rank) continue;
      SoftmaxState row(dv);
      row.max = top.top_scores(0)[j];
      row.sum = 1.0f;
      row.acc = shard.get(id).value;
      state.merge(row);  // best first: a rank's first chosen row is finite (it answered round 1), so -inf rows weigh 0
      mine.push_back({id, 0.0f, row.max});
      mine_values.push_back(row.acc);
    }
    soft.set_state(0, state);
    fill_top(soft, 0, mine);
    soft.header(0).rows = 0;
  });
  if (failure.code != 0) soft.set_error(failure.code);
  reduce(soft);
  failure.rethrow(soft.header(0).error);
  soft.header(0).rows = short_of_k ? k : chosen;
  SoftResult r = soft_answer(soft, 0);
  if (!all_finite(r.value)) {  // the float accumulator overflowed: the same blend in double
    std::vector<std::pair<double, const float*>> parts;
    for (std::size_t j = 0; j < mine.size(); ++j) parts.emplace_back(mine[j].score, mine_values[j].data());
    r.value = blend_in_double(parts, r.lse, dv);
  }
  r.tail_bound = detail::tail_bound(short_of_k ? answered : total, chosen, detail::with_rounding_slack(kth), r.lse);
  r.tail_bound_guaranteed = top.header(0).guaranteed != 0;
  r.mask_filtered_after_search = top.header(0).filtered_after != 0;  // any shard's index filtered after its search
  // Not every entry took part: the shards' index chose them, even where a small shard scanned all of its own.
  const auto merged = static_cast<IndexKind>(top.header(0).searched_with);
  r.searched_with = merged != IndexKind::exact ? merged : shard.config().index.kind;
  // hnsw: its shards answer from their certified lists (a guarantee) or, where those are not trained, their
  // graph (an estimate); the largest kind of the merge would say ivf for a mix, so the bound's kind decides.
  if (shard.config().index.kind == IndexKind::hnsw && merged != IndexKind::flat)
    r.searched_with = r.tail_bound_guaranteed ? IndexKind::ivf : IndexKind::hnsw;
  return r;
}

SoftResult detail::ShardScan::pruned(const std::vector<float>& query, std::size_t local, std::size_t total,
                                     const QueryOptions& options) const {
  if (options.top_k) {
    if (*options.top_k >= total) return exact(query, 1, Retrieval::soft, options).soft[0];
    return pruned_at(query, *options.top_k, local, total, options);
  }
  // The adaptive rule of one collection (detail::adaptive_rounds), on the global N and bound.
  return detail::adaptive_rounds<SoftResult>(
      total, *options.epsilon, [&](std::size_t k) { return pruned_at(query, k, local, total, options); },
      [&] { return exact(query, 1, Retrieval::soft, options).soft[0]; });
}

void detail::ShardScan::reduce(PartialRecords& records) const {
  const auto start = std::chrono::steady_clock::now();
  records.allreduce(comm);
  if (reduce_seconds != nullptr)
    *reduce_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<float> detail::ShardScan::blend_in_double(const std::vector<std::pair<double, const float*>>& parts, double lse,
                                                      std::size_t dim) const {
  std::vector<double> local(dim, 0.0);
  for (const auto& [score, value] : parts) {
    const double w = std::exp(score - lse);
    for (std::size_t i = 0; i < dim; ++i) local[i] += w * static_cast<double>(value[i]);
  }
  MPI_Allreduce(MPI_IN_PLACE, local.data(), detail::mpi_count(local.size(), "a value"), MPI_DOUBLE, MPI_SUM, comm);
  return {local.begin(), local.end()};
}

std::size_t detail::check_query(const Collection& shard, std::span<const float> queries, Retrieval kind,
                                const QueryOptions& options) {
  const std::size_t d = shard.config().dim;
  if (queries.empty() || queries.size() % d != 0)
    throw Error(ErrorCode::dimension_mismatch, "queries hold " + std::to_string(queries.size()) +
                                                   " floats, not a multiple of d = " + std::to_string(d));
  detail::check_finite(queries, "query", d);
  if (kind != Retrieval::soft && kind != Retrieval::hard) throw Error(ErrorCode::invalid_argument, "unknown retrieval kind");
  shard.check_options(options, kind);  // the same checks as one collection's, even on an empty shard
  if (options.iterations != 1)
    throw Error(ErrorCode::unsupported, "iterative retrieval (iterations > 1) is not supported on sharded collections");
  if (options.error_target)
    throw Error(ErrorCode::unsupported, "error_target (estimated answers) is not supported on sharded collections yet");
  if (shard.config().heads != 1)  // the partial records merge one softmax: a multi-head shard has h of them
    throw Error(ErrorCode::unsupported, "multi-head collections (heads > 1) are not supported on sharded collections");
  detail::mpi_count(queries.size(), "a query batch");
  return queries.size() / d;
}

QueryResults detail::ShardScan::answer(const std::vector<float>& q, std::size_t n, Retrieval kind,
                                       const QueryOptions& opts) const {
  // The plan Collection::query follows (checked by check_query at the root): pruned soft queries run
  // here, one by one; everything else is each shard's Collection::query and a merge.
  if (detail::plan_query(shard.config(), false, opts, n, kind).single != detail::SinglePath::pruned) return exact(q, n, kind, opts);
  // Pruned queries run one by one (as Collection::query does), each in lockstep on every rank.
  // The global N of the tail bound: the eligible rows of every shard (all rows without a mask).
  LocalFailure failure;
  std::size_t local = 0;
  failure.run([&] { local = shard.eligible_count(opts); });
  std::uint64_t counts[2] = {local, failure.code != 0 ? 1u : 0u};  // summed: N, ranks that failed
  MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_UINT64_T, MPI_SUM, comm);
  if (counts[1] != 0) failure.rethrow(failure.code != 0 ? failure.code : static_cast<std::uint32_t>(ErrorCode::resource_exhausted));
  const std::uint64_t total = counts[0];
  if (total == 0) throw nothing_eligible(opts);
  const std::size_t d = shard.config().dim;
  QueryResults out;
  for (std::size_t b = 0; b < n; ++b)
    out.soft.push_back(pruned({q.begin() + static_cast<std::ptrdiff_t>(b * d), q.begin() + static_cast<std::ptrdiff_t>((b + 1) * d)},
                              local, total, opts));
  return out;
}

QueryResults ShardedCollection::query(std::span<const float> queries, Retrieval kind, const QueryOptions& options,
                                      int root) const {
  Impl& im = *impl_;
  const bool is_root = static_cast<int>(im.rank_) == root;
  const std::size_t d = im.shard_.config().dim;
  im.reduce_seconds_ = 0;
  // Root checks the request and broadcasts it with its options; every rank then throws or proceeds.
  struct Header {
    detail::RootStatus status;
    std::uint64_t options_bytes = 0;
    std::uint64_t n = 0;
  } h;
  std::vector<std::byte> options_bytes;
  if (is_root) {
    try {
      h.n = detail::check_query(im.shard_, queries, kind, options);
      detail::ByteWriter w;
      detail::put_query_options(w, options, detail::OptionsForm::full);
      options_bytes = std::move(w.bytes());
      detail::mpi_count(options_bytes.size(), "the query options");
      h.options_bytes = options_bytes.size();
    } catch (const Error& e) {
      h.status = detail::status_of(e);
    } catch (const std::bad_alloc&) {  // root alone must not leave the collective: the others wait on it
      h.status = detail::status_of(Error(ErrorCode::resource_exhausted, "query: out of memory at the root"));
    }
  }
  MPI_Bcast(&h, sizeof(h), MPI_BYTE, root, im.comm_);
  if (h.status.code != 0) throw Error(static_cast<ErrorCode>(h.status.code), h.status.message);
  const QueryOptions opts = broadcast_options(std::move(options_bytes), h.options_bytes, root, im.comm_);
  std::vector<float> q(is_root ? queries.begin() : queries.end(), queries.end());
  q.resize(h.n * d);
  MPI_Bcast(q.data(), static_cast<int>(q.size()), MPI_FLOAT, root, im.comm_);
  return im.scan().answer(q, h.n, kind, opts);
}

SoftResult ShardedCollection::query_soft(std::span<const float> query, const QueryOptions& options, int root) const {
  return std::move(this->query(query, Retrieval::soft, options, root).soft.at(0));
}

HardResult ShardedCollection::query_hard(std::span<const float> query, const QueryOptions& options, int root) const {
  return std::move(this->query(query, Retrieval::hard, options, root).hard.at(0));
}

}  // namespace softkv
