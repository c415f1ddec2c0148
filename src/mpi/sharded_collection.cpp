// ShardedCollection: rows routed to their owner rank; queries broadcast, scanned per shard, merged by MPI_Allreduce.
#include "softkv/mpi.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <string>

#include "mpi/partial_record.hpp"
#include "pruning.hpp"
#include "softkv/error.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

using detail::PartialRecords;
using detail::RecordKind;
using detail::SoftmaxState;

// The outcome of a root-side check, broadcast so that every rank throws the same Error or none.
struct Status {
  std::uint32_t code = 0;
  char message[244] = {};
};

Status status_of(const Error& e) {
  Status s;
  s.code = static_cast<std::uint32_t>(e.code());
  std::strncpy(s.message, e.what(), sizeof(s.message) - 1);
  return s;
}

int to_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Error(ErrorCode::resource_exhausted, std::string("sharded collection: ") + what + " exceeds MPI's int counts");
  return static_cast<int>(n);
}

// The QueryOptions fields as one flat record for MPI_Bcast (root's options rule every rank).
struct WireOptions {
  std::uint8_t has_temperature = 0, has_scale = 0, has_top_k = 0, has_epsilon = 0, exact = 0;
  float temperature = 0, scale = 0, epsilon = 0;
  std::uint64_t top_m = 0, threads = 0, top_k = 0, ef_search = 0, nprobe = 0, check_sample = 0;
};

WireOptions flatten(const QueryOptions& o) {
  WireOptions w;
  w.has_temperature = o.temperature.has_value();
  w.temperature = o.temperature.value_or(0);
  w.has_scale = o.scale.has_value();
  w.scale = o.scale.value_or(0);
  w.has_top_k = o.top_k.has_value();
  w.top_k = o.top_k.value_or(0);
  w.has_epsilon = o.epsilon.has_value();
  w.epsilon = o.epsilon.value_or(0);
  w.exact = o.exact;
  w.top_m = o.top_m;
  w.threads = o.threads;
  w.ef_search = o.ef_search;
  w.nprobe = o.nprobe;
  w.check_sample = o.check_sample;
  return w;
}

QueryOptions unflatten(const WireOptions& w) {
  QueryOptions o;
  if (w.has_temperature) o.temperature = w.temperature;
  if (w.has_scale) o.scale = w.scale;
  if (w.has_top_k) o.top_k = w.top_k;
  if (w.has_epsilon) o.epsilon = w.epsilon;
  o.exact = w.exact != 0;
  o.top_m = w.top_m;
  o.threads = w.threads;
  o.ef_search = w.ef_search;
  o.nprobe = w.nprobe;
  o.check_sample = w.check_sample;
  return o;
}

// A rank's own failure during a collective step, kept until the reduction tells every rank about it.
struct LocalFailure {
  std::uint32_t code = 0;
  std::string message;

  template <typename Body>
  void run(const Body& body) {
    try {
      body();
    } catch (const Error& e) {
      code = static_cast<std::uint32_t>(e.code());
      message = e.what();
    } catch (const std::bad_alloc&) {
      code = static_cast<std::uint32_t>(ErrorCode::resource_exhausted);
      message = "sharded query: out of memory on a shard";
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

// The soft answer of a merged record: value = acc / l, contributors weighted by exp(s - lse).
SoftResult soft_answer(PartialRecords& records, std::size_t i) {
  const SoftmaxState s = records.state(i);
  SoftResult r;
  r.value.resize(s.acc.size());
  for (std::size_t j = 0; j < s.acc.size(); ++j) r.value[j] = s.acc[j] / s.sum;
  r.lse = s.lse();
  if (!std::isfinite(r.lse)) throw Error(ErrorCode::numeric_overflow, "sharded query: the merged log-sum-exp is not finite");
  r.max_score = s.max;
  r.candidates = records.header(i).rows;
  for (std::size_t j = 0; j < records.header(i).top_count; ++j) {
    const float score = records.top_scores(i)[j];
    r.top.push_back({records.top_ids(i)[j], static_cast<float>(std::exp(static_cast<double>(score) - r.lse)), score});
  }
  return r;
}

}  // namespace

std::size_t shard_owner(std::uint64_t id, std::size_t ranks) noexcept { return static_cast<std::size_t>(id % ranks); }

class ShardedCollection::Impl {
 public:
  Impl(MPI_Comm comm, const CollectionConfig& config) : shard_(config) {
    MPI_Comm_dup(comm, &comm_);
    int rank = 0, size = 1;
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
    rank_ = static_cast<std::size_t>(rank);
    ranks_ = static_cast<std::size_t>(size);
  }
  ~Impl() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0) MPI_Comm_free(&comm_);  // after MPI_Finalize the communicator is gone with MPI
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::size_t rank_ = 0, ranks_ = 1;
  Collection shard_;
  double reduce_seconds_ = 0;

  // The global reduction, timed (the merge's own cost is what the benchmark reports).
  void reduce(PartialRecords& records) {
    const auto start = std::chrono::steady_clock::now();
    records.allreduce(comm_);
    reduce_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // The element-wise sum over ranks of a vector of doubles (a convex blend's parts), as floats. Collective.
  std::vector<float> sum_in_double(std::vector<double> local) const {
    MPI_Allreduce(MPI_IN_PLACE, local.data(), to_int(local.size(), "a value"), MPI_DOUBLE, MPI_SUM, comm_);
    return {local.begin(), local.end()};
  }

  std::uint64_t sum_u64(std::uint64_t local, MPI_Op op) const {
    std::uint64_t global = 0;
    MPI_Allreduce(&local, &global, 1, MPI_UINT64_T, op, comm_);
    return global;
  }

  // Broadcasts root's values (count known on every rank) in place.
  template <typename T>
  void bcast(std::vector<T>& v, MPI_Datatype type, int root) const {
    std::uint64_t n = v.size();
    MPI_Bcast(&n, 1, MPI_UINT64_T, root, comm_);
    v.resize(n);
    if (n > 0) MPI_Bcast(v.data(), to_int(n, "a broadcast"), type, root, comm_);
  }

  // Sends each owner its rows of `rows` (significant at root): the rows this rank owns, in root's order.
  // Without vectors (a removal) only the ids travel.
  Rows scatter(const Rows& rows, int root, bool with_vectors = true) const {
    const std::size_t d = with_vectors ? shard_.config().dim : 0, dv = with_vectors ? shard_.config().value_dim : 0;
    std::vector<int> counts(ranks_, 0), key_counts(ranks_), value_counts(ranks_), displs(ranks_), key_displs(ranks_),
        value_displs(ranks_);
    Rows ordered;
    if (static_cast<int>(rank_) == root) {
      std::vector<std::vector<std::size_t>> by_owner(ranks_);
      for (std::size_t i = 0; i < rows.ids.size(); ++i) by_owner[shard_owner(rows.ids[i], ranks_)].push_back(i);
      for (std::size_t r = 0; r < ranks_; ++r) {
        counts[r] = static_cast<int>(by_owner[r].size());
        for (std::size_t i : by_owner[r]) {
          ordered.ids.push_back(rows.ids[i]);
          ordered.keys.insert(ordered.keys.end(), rows.keys.begin() + static_cast<std::ptrdiff_t>(i * d),
                              rows.keys.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
          ordered.values.insert(ordered.values.end(), rows.values.begin() + static_cast<std::ptrdiff_t>(i * dv),
                                rows.values.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
        }
      }
    }
    MPI_Bcast(counts.data(), static_cast<int>(ranks_), MPI_INT, root, comm_);
    int offset = 0;
    for (std::size_t r = 0; r < ranks_; ++r) {
      displs[r] = offset;
      key_counts[r] = counts[r] * static_cast<int>(d);
      key_displs[r] = offset * static_cast<int>(d);
      value_counts[r] = counts[r] * static_cast<int>(dv);
      value_displs[r] = offset * static_cast<int>(dv);
      offset += counts[r];
    }
    Rows mine;
    const auto n = static_cast<std::size_t>(counts[rank_]);
    mine.ids.resize(n);
    mine.keys.resize(n * d);
    mine.values.resize(n * dv);
    MPI_Scatterv(ordered.ids.data(), counts.data(), displs.data(), MPI_UINT64_T, mine.ids.data(), counts[rank_],
                 MPI_UINT64_T, root, comm_);
    if (!with_vectors) return mine;
    MPI_Scatterv(ordered.keys.data(), key_counts.data(), key_displs.data(), MPI_FLOAT, mine.keys.data(),
                 key_counts[rank_], MPI_FLOAT, root, comm_);
    MPI_Scatterv(ordered.values.data(), value_counts.data(), value_displs.data(), MPI_FLOAT, mine.values.data(),
                 value_counts[rank_], MPI_FLOAT, root, comm_);
    return mine;
  }

  // Every query exact (no pruning): one reduction for the whole batch.
  QueryResults exact(const std::vector<float>& queries, std::size_t n, Retrieval kind, const QueryOptions& options) {
    const std::size_t dv = shard_.config().value_dim;
    const std::size_t top_m = kind == Retrieval::soft ? options.top_m : 0;
    PartialRecords records(n, kind == Retrieval::soft ? RecordKind::soft : RecordKind::hard, dv, top_m);
    LocalFailure failure;
    const std::size_t local_rows = shard_.size();
    QueryResults r;  // this shard's own answers (kept for the overflow fallback of soft values)
    if (local_rows > 0) {
      failure.run([&] {
        QueryOptions local = options;
        local.top_k.reset();
        local.epsilon.reset();
        r = shard_.query(queries, kind, local);
        for (std::size_t b = 0; b < n; ++b) {
          records.header(b).rows = local_rows;
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
    if (records.header(0).rows == 0) throw Error(ErrorCode::empty_collection, "sharded query: no shard holds an entry");
    QueryResults out;
    for (std::size_t b = 0; b < n; ++b) {
      if (kind == Retrieval::soft) {
        out.soft.push_back(soft_answer(records, b));
        SoftResult& a = out.soft.back();
        if (!all_finite(a.value)) {  // acc = value * l overflowed: blend the shards' values instead
          std::vector<double> mine(dv, 0.0);
          if (!r.soft.empty()) {
            const double w = std::exp(r.soft[b].lse - a.lse);
            for (std::size_t j = 0; j < dv; ++j) mine[j] = w * static_cast<double>(r.soft[b].value[j]);
          }
          a.value = sum_in_double(std::move(mine));
        }
      } else {
        const std::span<float> v = records.vector(b);
        out.hard.push_back({records.header(b).best_id, records.header(b).max, {v.begin(), v.end()},
                              static_cast<IndexKind>(records.header(b).searched_with)});
      }
    }
    return out;
  }

  // One pruned soft query at k: the global top k (each shard's top k merged), then the softmax over
  // those rows (each owner contributes its own) and the tail bound from the global k-th score and N.
  SoftResult pruned_at(const std::vector<float>& query, std::size_t k, std::size_t total, const QueryOptions& options) {
    const std::size_t dv = shard_.config().value_dim;
    // Round 1: candidates. A record of ids and scores only (no vector).
    PartialRecords top(1, RecordKind::soft, 0, k);
    LocalFailure failure;
    if (shard_.size() > 0) {
      failure.run([&] {
        QueryOptions local = options;
        local.epsilon.reset();
        local.top_k = k;
        local.top_m = k;
        const SoftResult r = shard_.query_soft(query, local);
        fill_top(top, 0, r.top);
        top.header(0).guaranteed = r.tail_bound_guaranteed ? 1 : 0;
        top.header(0).searched_with = static_cast<std::uint32_t>(r.searched_with);
      });
      if (failure.code != 0) top.set_error(failure.code);
    }
    reduce(top);
    failure.rethrow(top.header(0).error);
    const std::size_t chosen = top.header(0).top_count;
    const double kth = top.top_scores(0)[chosen - 1];

    // Round 2: the softmax over the chosen rows, each folded in by its owner with the library's merge.
    PartialRecords soft(1, RecordKind::soft, dv, options.top_m);
    std::vector<Contributor> mine;       // this rank's chosen rows (id, score)
    std::vector<std::vector<float>> mine_values;
    failure.run([&] {
      SoftmaxState state(dv);
      for (std::size_t j = 0; j < chosen; ++j) {
        const std::uint64_t id = top.top_ids(0)[j];
        if (shard_owner(id, ranks_) != rank_) continue;
        SoftmaxState row(dv);
        row.max = top.top_scores(0)[j];
        row.sum = 1.0f;
        row.acc = shard_.get(id).value;
        state.merge(row);
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
    soft.header(0).rows = chosen;
    SoftResult r = soft_answer(soft, 0);
    if (!all_finite(r.value)) {  // the float accumulator overflowed: the same blend in double
      std::vector<double> blend(dv, 0.0);
      for (std::size_t j = 0; j < mine.size(); ++j) {
        const double w = std::exp(static_cast<double>(mine[j].score) - r.lse);
        for (std::size_t i = 0; i < dv; ++i) blend[i] += w * static_cast<double>(mine_values[j][i]);
      }
      r.value = sum_in_double(std::move(blend));
    }
    r.tail_bound = detail::tail_bound(total, chosen, detail::with_rounding_slack(kth), r.lse);
    r.tail_bound_guaranteed = top.header(0).guaranteed != 0;
    // Not every entry took part: the shards' index chose them, even where a small shard scanned all of its own.
    const auto merged = static_cast<IndexKind>(top.header(0).searched_with);
    r.searched_with = merged != IndexKind::exact ? merged : shard_.config().index.kind;
    return r;
  }

  SoftResult pruned(const std::vector<float>& query, std::size_t total, const QueryOptions& options) {
    if (options.top_k) {
      if (*options.top_k >= total) return exact(query, 1, Retrieval::soft, options).soft[0];
      return pruned_at(query, *options.top_k, total, options);
    }
    for (std::size_t k = 16;; k *= 2) {  // the adaptive rule of detail::adaptive_soft, on global figures
      if (k > total / 4) return exact(query, 1, Retrieval::soft, options).soft[0];
      SoftResult r = pruned_at(query, k, total, options);
      if (r.tail_bound <= *options.epsilon) return r;
    }
  }
};

ShardedCollection::ShardedCollection(MPI_Comm comm, const CollectionConfig& config)
    : impl_(std::make_unique<Impl>(comm, config)) {}

ShardedCollection::~ShardedCollection() = default;

std::size_t ShardedCollection::rank() const noexcept { return impl_->rank_; }
std::size_t ShardedCollection::ranks() const noexcept { return impl_->ranks_; }
std::size_t ShardedCollection::owner(std::uint64_t id) const noexcept { return shard_owner(id, impl_->ranks_); }
const CollectionConfig& ShardedCollection::config() const noexcept { return impl_->shard_.config(); }
const Collection& ShardedCollection::shard() const noexcept { return impl_->shard_; }
double ShardedCollection::last_reduce_seconds() const noexcept { return impl_->reduce_seconds_; }

std::size_t ShardedCollection::size() const { return impl_->sum_u64(impl_->shard_.size(), MPI_SUM); }

std::uint64_t ShardedCollection::next_id() const { return impl_->sum_u64(impl_->shard_.next_id(), MPI_MAX); }

void ShardedCollection::upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys,
                                     std::span<const float> values, int root) {
  Impl& im = *impl_;
  const bool is_root = static_cast<int>(im.rank_) == root;
  Rows rows;
  Status s;
  if (is_root) {
    try {
      if (ids.empty() && !keys.empty())
        throw Error(ErrorCode::dimension_mismatch, "upsert: " + std::to_string(keys.size()) + " key floats but no ids");
      rows = im.shard_.prepare(ids, keys, values);  // every check Collection::upsert_batch makes
      to_int(rows.keys.size(), "the keys of one write");
      to_int(rows.values.size(), "the values of one write");
    } catch (const Error& e) {
      s = status_of(e);
    }
  }
  MPI_Bcast(&s, sizeof(s), MPI_BYTE, root, im.comm_);
  if (s.code != 0) throw Error(static_cast<ErrorCode>(s.code), s.message);
  const Rows mine = im.scatter(rows, root);
  if (!mine.ids.empty()) im.shard_.apply(mine);
}

std::vector<std::uint64_t> ShardedCollection::add_batch(std::span<const float> keys, std::span<const float> values,
                                                        int root) {
  Impl& im = *impl_;
  const std::uint64_t first = next_id();
  std::uint64_t n = 0;
  std::vector<std::uint64_t> ids;
  if (static_cast<int>(im.rank_) == root) {
    n = keys.size() / im.shard_.config().dim;
    for (std::uint64_t i = 0; i < n; ++i) ids.push_back(first + i);
  }
  upsert_batch(ids, keys, values, root);  // checks shapes (keys vs n ids, values) and the reserved id at root
  MPI_Bcast(&n, 1, MPI_UINT64_T, root, im.comm_);
  ids.resize(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = first + i;
  return ids;
}

void ShardedCollection::remove_batch(std::span<const std::uint64_t> ids, int root) {
  Impl& im = *impl_;
  const bool is_root = static_cast<int>(im.rank_) == root;
  Status s;
  Rows rows;
  if (is_root) {
    std::vector<std::uint64_t> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
    if (twice != sorted.end())
      s = status_of(Error(ErrorCode::invalid_argument, "remove: id " + std::to_string(*twice) + " is given twice"));
    rows.ids.assign(ids.begin(), ids.end());
  }
  MPI_Bcast(&s, sizeof(s), MPI_BYTE, root, im.comm_);
  if (s.code != 0) throw Error(static_cast<ErrorCode>(s.code), s.message);
  const std::vector<std::uint64_t> mine = im.scatter(rows, root, /*with_vectors=*/false).ids;
  // Phase 1: every owner checks its ids; the smallest missing id anywhere is the one every rank names.
  std::uint64_t missing = kReservedId;
  for (std::uint64_t id : mine)
    if (!im.shard_.contains(id)) missing = std::min(missing, id);
  missing = im.sum_u64(missing, MPI_MIN);
  if (missing != kReservedId) throw Error(ErrorCode::unknown_id, "remove: no entry has id " + std::to_string(missing));
  // Phase 2: nothing can fail any more (ids distinct and present).
  if (!mine.empty()) im.shard_.remove_batch(mine);
}

QueryResults ShardedCollection::query(std::span<const float> queries, Retrieval kind, const QueryOptions& options,
                                      int root) const {
  Impl& im = *impl_;
  const bool is_root = static_cast<int>(im.rank_) == root;
  const std::size_t d = im.shard_.config().dim;
  im.reduce_seconds_ = 0;
  // Root checks the request and broadcasts it with its options; every rank then throws or proceeds.
  struct Header {
    Status status;
    WireOptions options;
    std::uint64_t n = 0;
  } h;
  if (is_root) {
    try {
      if (queries.empty() || queries.size() % d != 0)
        throw Error(ErrorCode::dimension_mismatch, "queries hold " + std::to_string(queries.size()) +
                                                       " floats, not a multiple of d = " + std::to_string(d));
      detail::check_finite(queries, "query", d);
      if (kind != Retrieval::soft && kind != Retrieval::hard) throw Error(ErrorCode::invalid_argument, "unknown retrieval kind");
      im.shard_.check_options(options, kind);  // the same checks as one collection's, even on an empty shard
      to_int(queries.size(), "a query batch");
      h.n = queries.size() / d;
    } catch (const Error& e) {
      h.status = status_of(e);
    }
    h.options = flatten(options);
  }
  MPI_Bcast(&h, sizeof(h), MPI_BYTE, root, im.comm_);
  if (h.status.code != 0) throw Error(static_cast<ErrorCode>(h.status.code), h.status.message);
  const QueryOptions opts = unflatten(h.options);
  std::vector<float> q(is_root ? queries.begin() : queries.end(), queries.end());
  q.resize(h.n * d);
  MPI_Bcast(q.data(), static_cast<int>(q.size()), MPI_FLOAT, root, im.comm_);

  // check_options refused top_k/epsilon without an index; options.exact scans everything (as use_index says).
  const bool prune = kind == Retrieval::soft && (opts.top_k || opts.epsilon) && !opts.exact;
  if (!prune) return im.exact(q, h.n, kind, opts);
  // Pruned queries run one by one (as Collection::query does), each in lockstep on every rank.
  const std::size_t total = size();
  if (total == 0) throw Error(ErrorCode::empty_collection, "sharded query: no shard holds an entry");
  QueryResults out;
  for (std::size_t b = 0; b < h.n; ++b)
    out.soft.push_back(im.pruned({q.begin() + static_cast<std::ptrdiff_t>(b * d), q.begin() + static_cast<std::ptrdiff_t>((b + 1) * d)},
                                 total, opts));
  return out;
}

SoftResult ShardedCollection::query_soft(std::span<const float> query, const QueryOptions& options, int root) const {
  return std::move(this->query(query, Retrieval::soft, options, root).soft.at(0));
}

HardResult ShardedCollection::query_hard(std::span<const float> query, const QueryOptions& options, int root) const {
  return std::move(this->query(query, Retrieval::hard, options, root).hard.at(0));
}

}  // namespace softkv
