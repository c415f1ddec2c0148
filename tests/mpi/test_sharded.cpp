// ShardedCollection under mpirun -np P: answers equal one Collection holding every entry, to float rounding.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "../errors.hpp"
#include "../reference.hpp"
#include "mpi/partial_record.hpp"
#include "mpi/parts.hpp"
#include "softkv/error.hpp"
#include "softkv/mpi.hpp"

using namespace softkv;
using softkv::test::error_of;
using softkv::test::max_abs_diff;

namespace {

constexpr std::size_t kD = 16, kDv = 8;

std::size_t world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return static_cast<std::size_t>(r);
}

std::size_t world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return static_cast<std::size_t>(n);
}

// The same rows on every rank: the single-process collection holds them all; the sharded one gets
// them from root (the other ranks pass nothing, as the API allows).
struct Data {
  std::vector<std::uint64_t> ids;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> tags = {};  // empty: every tag 0
};

Data sharded_data(std::size_t n, std::uint64_t seed, std::uint64_t id_step = 1) {
  Data data{{}, softkv::test::normal_floats(n * kD, seed), softkv::test::normal_floats(n * kDv, seed + 1)};
  for (std::size_t i = 0; i < n; ++i) data.ids.push_back(3 + i * id_step);
  return data;
}

struct Pair {
  Collection whole;
  ShardedCollection sharded;
  Pair(const CollectionConfig& config, const Data& data) : whole(config), sharded(MPI_COMM_WORLD, config) {
    whole.upsert_batch(data.ids, data.keys, data.values, data.tags);
    const bool root = world_rank() == 0;
    sharded.upsert_batch(root ? std::span<const std::uint64_t>(data.ids) : std::span<const std::uint64_t>{},
                         root ? std::span<const float>(data.keys) : std::span<const float>{},
                         root ? std::span<const float>(data.values) : std::span<const float>{},
                         root ? std::span<const std::uint64_t>(data.tags) : std::span<const std::uint64_t>{});
  }
};

CollectionConfig config(IndexKind index = IndexKind::exact, Metric metric = Metric::dot) {
  CollectionConfig c;
  c.dim = kD;
  c.value_dim = kDv;
  c.metric = metric;
  c.index.kind = index;
  return c;
}

// Queries are read at root only: the other ranks pass garbage of the wrong size to prove it.
std::span<const float> at_root(const std::vector<float>& q) {
  static const std::vector<float> garbage(3, std::numeric_limits<float>::quiet_NaN());
  return world_rank() == 0 ? std::span<const float>(q) : std::span<const float>(garbage);
}

void check_soft_equal(const SoftResult& got, const SoftResult& want) {
  const double scale = std::max(1.0, softkv::test::max_abs(want.value));
  CHECK(max_abs_diff(got.value, want.value) <= 2e-6 * scale);
  CHECK(got.lse == Approx(want.lse).epsilon(1e-6).margin(1e-6));
  CHECK(got.max_score == Approx(want.max_score).epsilon(1e-6).margin(1e-6));
  CHECK(got.candidates == want.candidates);
  CHECK(got.tail_bound == Approx(want.tail_bound).epsilon(1e-5).margin(1e-12));
  CHECK(got.tail_bound_guaranteed == want.tail_bound_guaranteed);
  REQUIRE(got.top.size() == want.top.size());
  for (std::size_t i = 0; i < got.top.size(); ++i) {
    CHECK(got.top[i].id == want.top[i].id);
    CHECK(got.top[i].weight == Approx(want.top[i].weight).epsilon(1e-5).margin(1e-9));
    CHECK(got.top[i].score == Approx(want.top[i].score).epsilon(1e-6).margin(1e-6));
  }
}

}  // namespace

TEST_CASE("sharded: ids are routed to id mod P, and the shards hold every row once", "[mpi]") {
  const Data data = sharded_data(101, 1, 7);
  Pair p(config(), data);
  const std::size_t P = world_size();
  CHECK(p.sharded.ranks() == P);
  CHECK(p.sharded.rank() == world_rank());
  CHECK(p.sharded.size() == data.ids.size());
  std::size_t expected_here = 0;
  for (std::uint64_t id : data.ids) {
    CHECK(p.sharded.owner(id) == id % P);
    if (shard_owner(id, P) == world_rank()) {
      ++expected_here;
      CHECK(p.sharded.shard().contains(id));
      CHECK(p.sharded.shard().get(id).value == p.whole.get(id).value);
    }
  }
  CHECK(p.sharded.shard().size() == expected_here);
  CHECK(p.sharded.next_id() == p.whole.next_id());
}

TEST_CASE("sharded: soft, top-m and hard answers equal one collection's, single and batched", "[mpi]") {
  for (Metric metric : {Metric::dot, Metric::cosine}) {
    const Data data = sharded_data(500, 11);
    Pair p(config(IndexKind::exact, metric), data);
    const std::vector<float> queries = softkv::test::normal_floats(5 * kD, 99, 3.0f);
    const std::vector<float> one(queries.begin(), queries.begin() + kD);
    for (std::size_t top_m : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{600}}) {
      QueryOptions o;
      o.top_m = top_m;
      o.temperature = 0.5f;
      check_soft_equal(p.sharded.query_soft(at_root(one), o), p.whole.query_soft(one, o));
      const QueryResults got = p.sharded.query(at_root(queries), Retrieval::soft, o);
      const QueryResults want = p.whole.query(queries, Retrieval::soft, o);
      REQUIRE(got.soft.size() == 5);
      for (std::size_t b = 0; b < 5; ++b) check_soft_equal(got.soft[b], want.soft[b]);
    }
    const QueryResults got = p.sharded.query(at_root(queries), Retrieval::hard);
    const QueryResults want = p.whole.query(queries, Retrieval::hard);
    REQUIRE(got.hard.size() == 5);
    for (std::size_t b = 0; b < 5; ++b) {
      CHECK(got.hard[b].id == want.hard[b].id);
      CHECK(got.hard[b].score == Approx(want.hard[b].score).epsilon(1e-6));
      CHECK(got.hard[b].value == want.hard[b].value);
    }
  }
}

TEST_CASE("sharded: the merged soft answer matches a double-precision reference", "[mpi]") {
  const Data data = sharded_data(300, 21);
  Pair p(config(), data);
  const std::vector<float> q = softkv::test::normal_floats(kD, 5, 2.0f);
  const SoftResult got = p.sharded.query_soft(at_root(q));
  CHECK(p.sharded.last_reduce_seconds() > 0.0);  // the query went through its reduction
  const auto ref = softkv::test::soft_reference(q.data(), data.keys.data(), data.values.data(), data.ids.size(), kD,
                                                kDv, 1.0 / std::sqrt(static_cast<double>(kD)));
  CHECK(max_abs_diff(got.value, ref.value) <= 1e-5);
  CHECK(got.lse == Approx(ref.lse).epsilon(1e-6));
  CHECK(got.max_score == Approx(ref.max_score).epsilon(1e-6));
}

TEST_CASE("sharded: equal best scores on several ranks go to the smallest id", "[mpi]") {
  // Integer keys make the scores exact; ids 1000..1003 share the best key and live on different ranks.
  Data data = sharded_data(40, 31);
  for (float& k : data.keys) k = std::round(k);
  for (std::size_t i = 0; i < 4; ++i) {
    data.ids[i] = 1003 - i;  // stored in descending id order, so storage order cannot pick the winner
    std::fill_n(data.keys.begin() + static_cast<std::ptrdiff_t>(i * kD), kD, 4.0f);
    data.values[i * kDv] = static_cast<float>(100 + i);
  }
  Pair p(config(), data);
  const std::vector<float> q(kD, 1.0f);
  const HardResult got = p.sharded.query_hard(at_root(q));
  CHECK(got.id == 1000);
  CHECK(got.id == p.whole.query_hard(q).id);
  CHECK(got.value == p.whole.get(1000).value);
  QueryOptions o;
  o.top_m = 4;
  const SoftResult soft = p.sharded.query_soft(at_root(q), o);
  REQUIRE(soft.top.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) CHECK(soft.top[i].id == 1000 + i);  // equal weights: ascending id
  // A batch of the same query twice takes the fused batch kernel on each shard.
  std::vector<float> two(q);
  two.insert(two.end(), q.begin(), q.end());
  const QueryResults batch = p.sharded.query(at_root(two), Retrieval::hard);
  CHECK(batch.hard.at(0).id == 1000);
  CHECK(batch.hard.at(1).id == 1000);
}

TEST_CASE("sharded: pruned answers (top_k) and their tail bound equal one collection's", "[mpi]") {
  const Data data = sharded_data(800, 41);
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = softkv::test::normal_floats(kD, 7, 4.0f);
  for (std::size_t k : {std::size_t{1}, std::size_t{5}, std::size_t{64}, std::size_t{799}, std::size_t{800}, std::size_t{5000}}) {
    QueryOptions o;
    o.top_k = k;
    o.top_m = 3;
    INFO("k = " << k);
    const SoftResult want = p.whole.query_soft(q, o);
    const SoftResult got = p.sharded.query_soft(at_root(q), o);
    check_soft_equal(got, want);
    CHECK(got.searched_with == want.searched_with);
  }
}

TEST_CASE("sharded: pruning through an approximate index reports an estimate from every shard's candidates", "[mpi]") {
  const Data data = sharded_data(600, 121);
  Pair p(config(IndexKind::hnsw), data);
  p.sharded.shard().wait_until_indexed();
  const std::vector<float> q = softkv::test::normal_floats(kD, 122, 6.0f);
  QueryOptions o;
  o.top_k = 24;
  o.top_m = 24;
  const SoftResult got = p.sharded.query_soft(at_root(q), o);
  CHECK(got.candidates == 24);
  CHECK_FALSE(got.tail_bound_guaranteed);
  CHECK(got.searched_with == IndexKind::hnsw);
  CHECK(got.tail_bound > 0.0);
  CHECK(got.tail_bound < 1.0);
  // Whatever the graphs chose, the answer is the exact softmax over its candidates: its top list holds
  // 24 distinct stored ids whose weights sum to 1 and whose scores are the exact ones.
  const SoftResult all = p.whole.query_soft(q, {.top_m = 600});
  double weight = 0;
  std::vector<std::uint64_t> seen;
  for (const Contributor& c : got.top) {
    weight += c.weight;
    seen.push_back(c.id);
    const auto exact = std::find_if(all.top.begin(), all.top.end(), [&](const Contributor& e) { return e.id == c.id; });
    REQUIRE(exact != all.top.end());
    CHECK(c.score == Approx(exact->score).epsilon(1e-6).margin(1e-6));
  }
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  CHECK(weight == Approx(1.0).epsilon(1e-5));
}

TEST_CASE("sharded: adaptive pruning (epsilon) meets its target with the global N", "[mpi]") {
  const Data data = sharded_data(2000, 51);
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = softkv::test::normal_floats(kD, 8, 12.0f);  // a peaked softmax
  const SoftResult exact = p.whole.query_soft(q);
  for (float eps : {0.5f, 0.05f, 1e-4f}) {
    QueryOptions o;
    o.epsilon = eps;
    const SoftResult got = p.sharded.query_soft(at_root(q), o);
    check_soft_equal(got, p.whole.query_soft(q, o));  // flat: the same k schedule over the same global top k
    CHECK(got.tail_bound <= eps);
    CHECK(got.tail_bound_guaranteed);
    double vmax = 0;
    for (float v : data.values) vmax = std::max(vmax, static_cast<double>(std::fabs(v)));
    CHECK(max_abs_diff(got.value, exact.value) <= 2 * got.tail_bound * vmax * std::sqrt(kDv) + 1e-5);
  }
}

TEST_CASE("sharded: values near the float limit blend like one collection (no overflow in the merge)", "[mpi]") {
  Data data = sharded_data(64, 91);
  for (float& v : data.values) v = v > 0 ? 3.0e38f : -3.0e38f;
  for (float& k : data.keys) k *= 0.01f;  // nearly flat weights: every row counts
  CollectionConfig c = config(IndexKind::flat);
  Pair p(c, data);
  const std::vector<float> q = softkv::test::normal_floats(kD, 92);
  const SoftResult want = p.whole.query_soft(q);
  const SoftResult got = p.sharded.query_soft(at_root(q));
  REQUIRE(std::all_of(want.value.begin(), want.value.end(), [](float x) { return std::isfinite(x); }));
  CHECK(max_abs_diff(got.value, want.value) <= 1e-5 * 3.0e38);
  QueryOptions o;
  o.top_k = 40;
  const SoftResult want_k = p.whole.query_soft(q, o);
  const SoftResult got_k = p.sharded.query_soft(at_root(q), o);
  CHECK(max_abs_diff(got_k.value, want_k.value) <= 1e-5 * 3.0e38);
  CHECK(got_k.tail_bound == Approx(want_k.tail_bound).epsilon(1e-5));
}

TEST_CASE("sharded: shapes at their extremes (d = 1, odd dv, one row) merge like one collection", "[mpi]") {
  for (const auto& [d, dv, rows] : {std::tuple<std::size_t, std::size_t, std::size_t>{1, 1, 1}, {1, 129, 37}, {33, 3, 5}}) {
    INFO("d = " << d << ", dv = " << dv << ", rows = " << rows);
    CollectionConfig c;
    c.dim = d;
    c.value_dim = dv;
    c.index.kind = IndexKind::flat;
    Collection whole(c);
    ShardedCollection sharded(MPI_COMM_WORLD, c);
    const std::vector<float> keys = softkv::test::normal_floats(rows * d, 111 + d), values = softkv::test::normal_floats(rows * dv, 112 + dv);
    std::vector<std::uint64_t> ids(rows);
    std::iota(ids.begin(), ids.end(), std::uint64_t{0});
    whole.upsert_batch(ids, keys, values);
    sharded.upsert_batch(ids, keys, values);
    const std::vector<float> q = softkv::test::normal_floats(3 * d, 113);
    QueryOptions o;
    o.top_m = 3;  // an odd top list: the vector part after it starts 4-byte aligned only
    const QueryResults got = sharded.query(at_root(q), Retrieval::soft, o);
    const QueryResults want = whole.query(q, Retrieval::soft, o);
    for (std::size_t b = 0; b < 3; ++b) check_soft_equal(got.soft[b], want.soft[b]);
    const QueryResults hard = sharded.query(at_root(q), Retrieval::hard);
    for (std::size_t b = 0; b < 3; ++b) {
      CHECK(hard.hard[b].id == whole.query(q, Retrieval::hard).hard[b].id);
      CHECK(hard.hard[b].value == whole.query(q, Retrieval::hard).hard[b].value);
    }
  }
}

TEST_CASE("sharded: a rank with an empty shard contributes nothing and breaks nothing", "[mpi]") {
  const std::size_t P = world_size();
  Data data = sharded_data(60, 61, P);  // ids 3 + i*P: every row lives on rank 3 % P
  Pair p(config(IndexKind::flat), data);
  CHECK(p.sharded.shard().size() == (world_rank() == 3 % P ? 60u : 0u));
  const std::vector<float> q = softkv::test::normal_floats(2 * kD, 9);
  QueryOptions o;
  o.top_m = 5;
  const QueryResults got = p.sharded.query(at_root(q), Retrieval::soft, o);
  const QueryResults want = p.whole.query(q, Retrieval::soft, o);
  for (std::size_t b = 0; b < 2; ++b) check_soft_equal(got.soft[b], want.soft[b]);
  CHECK(p.sharded.query(at_root(q), Retrieval::hard).hard[1].id == p.whole.query(q, Retrieval::hard).hard[1].id);
  o.top_k = 8;
  const std::vector<float> one(q.begin(), q.begin() + kD);
  check_soft_equal(p.sharded.query_soft(at_root(one), o), p.whole.query_soft(one, o));
}

namespace {

// Rows whose keys are -3e37 everywhere score below -FLT_MAX against a query of elements in [1, 2) at
// scale 1 (16 x -3e37 x q_i < -4.8e38); the rest score ordinary values. Ids are 3, 4, ..., n + 2.
Data with_rows_below_range(std::size_t n, std::uint64_t seed, const std::function<bool(std::uint64_t)>& below) {
  Data data = sharded_data(n, seed);
  for (std::size_t i = 0; i < n; ++i)
    if (below(data.ids[i])) std::fill_n(data.keys.begin() + static_cast<std::ptrdiff_t>(i * kD), kD, -3e37f);
  return data;
}

std::vector<float> queries_in_one_to_two(std::size_t n) {
  std::vector<float> q(n * kD);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 1.0f + 0.09f * static_cast<float>((i * 7) % 11);
  return q;
}

// check_soft_equal, except for contributors of weight 0 (score -inf), which a rank that sat out does
// not list: the contributors with a finite score agree in order, and got lists no more than want.
void check_soft_equal_but_weightless(const SoftResult& got, const SoftResult& want) {
  SoftResult finite_got = got, finite_want = want;
  for (SoftResult* r : {&finite_got, &finite_want})
    std::erase_if(r->top, [](const Contributor& c) { return !std::isfinite(c.score); });
  check_soft_equal(finite_got, finite_want);
  CHECK(got.top.size() <= want.top.size());
}

}  // namespace

TEST_CASE("sharded: a rank whose every row scores below -FLT_MAX sits the query out and the answer equals one collection's", "[mpi]") {
  const std::size_t P = world_size();
  // Every row rank 0 owns (with one rank: ids 3-50, half the rows) scores below -FLT_MAX for queries
  // 0 and 2 of the batch; query 1 is a thousandth of a query in [1, 2): there those rows score about
  // -4.8e35, so rank 0 answers query 1 and sits out the others of the same batch.
  const Data data = with_rows_below_range(96, 151, [&](std::uint64_t id) { return P > 1 ? id % P == 0 : id <= 50; });
  Pair p(config(IndexKind::flat), data);
  if (P > 1 && world_rank() == 0) REQUIRE(p.sharded.shard().size() > 0);
  std::vector<float> q = queries_in_one_to_two(3);
  for (std::size_t i = kD; i < 2 * kD; ++i) q[i] *= 1e-3f;
  const std::vector<float> one(q.begin(), q.begin() + kD);
  QueryOptions o;
  o.scale = 1.0f;
  for (std::size_t top_m : {std::size_t{0}, std::size_t{3}}) {
    o.top_m = top_m;
    INFO("top_m = " << top_m);
    check_soft_equal(p.sharded.query_soft(at_root(one), o), p.whole.query_soft(one, o));
    const QueryResults got = p.sharded.query(at_root(q), Retrieval::soft, o);
    const QueryResults want = p.whole.query(q, Retrieval::soft, o);
    REQUIRE(got.soft.size() == 3);
    for (std::size_t b = 0; b < 3; ++b) check_soft_equal(got.soft[b], want.soft[b]);
  }
  o.top_m = 0;
  const QueryResults hard = p.sharded.query(at_root(q), Retrieval::hard, o);
  const QueryResults hard_want = p.whole.query(q, Retrieval::hard, o);
  for (std::size_t b = 0; b < 3; ++b) {
    CHECK(hard.hard[b].id == hard_want.hard[b].id);
    CHECK(hard.hard[b].score == hard_want.hard[b].score);
    CHECK(hard.hard[b].value == hard_want.hard[b].value);
  }
  CHECK(p.sharded.query_hard(at_root(one), o).id == p.whole.query_hard(one, o).id);
  // Pruned (flat, 96 rows: epsilon's first k = 16 is within a quarter of them): rank 0 offers no candidate.
  for (int pruned = 0; pruned < 2; ++pruned) {
    QueryOptions k = o;
    if (pruned == 0) k.top_k = 4;
    else k.epsilon = 0.5f;
    k.top_m = 2;
    const SoftResult got = p.sharded.query_soft(at_root(one), k);
    check_soft_equal(got, p.whole.query_soft(one, k));
    CHECK(got.candidates < 96);  // the pruned path ran
  }
  // Contributors beyond the representable rows: one collection lists the rows below -FLT_MAX with
  // score -inf and weight 0; a rank that sat out lists none of its own (docs/SHARDING.md, "Running sharded").
  o.top_m = 96;
  const SoftResult all = p.sharded.query_soft(at_root(one), o);
  const SoftResult all_want = p.whole.query_soft(one, o);
  check_soft_equal_but_weightless(all, all_want);
  if (P > 1) CHECK(std::all_of(all.top.begin(), all.top.end(), [](const Contributor& c) { return std::isfinite(c.score); }));
  else CHECK(all.top.size() == 96);  // nobody sat out
}

TEST_CASE("sharded: a rank that sits out leaves the double-precision blend of values near FLT_MAX to the others", "[mpi]") {
  const std::size_t P = world_size();
  // Values of +-3e38 and nearly flat weights over the rows that count: the float accumulator
  // overflows and the blend is redone in double, without the rows of the rank that sat out.
  Data data = with_rows_below_range(64, 181, [&](std::uint64_t id) { return P > 1 ? id % P == 0 : id < 20; });
  for (float& v : data.values) v = v > 0 ? 3.0e38f : -3.0e38f;
  for (std::size_t i = 0; i < data.keys.size(); ++i)
    if (data.keys[i] != -3e37f) data.keys[i] *= 0.01f;
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = queries_in_one_to_two(2);
  const std::vector<float> one(q.begin(), q.begin() + kD);
  QueryOptions o;
  o.scale = 1.0f;
  const SoftResult want = p.whole.query_soft(one, o);
  REQUIRE(std::all_of(want.value.begin(), want.value.end(), [](float x) { return std::isfinite(x); }));
  REQUIRE(softkv::test::max_abs(want.value) > 1e37);  // the values did not cancel: the double blend mattered
  CHECK(max_abs_diff(p.sharded.query_soft(at_root(one), o).value, want.value) <= 1e-5 * 3.0e38);
  const QueryResults got = p.sharded.query(at_root(q), Retrieval::soft, o);
  const QueryResults batch_want = p.whole.query(q, Retrieval::soft, o);
  for (std::size_t b = 0; b < 2; ++b) CHECK(max_abs_diff(got.soft[b].value, batch_want.soft[b].value) <= 1e-5 * 3.0e38);
}

TEST_CASE("sharded: a pruned query whose candidates include rows below -FLT_MAX on several ranks weighs them 0", "[mpi]") {
  const std::size_t P = world_size();
  // Ids 3-50. Rank 0's rows (with one rank: ids 3-22) and ids 41-50 wherever they live score below
  // -FLT_MAX: 18-28 rows are representable (P = 1-4), so top_k = 30 takes rows of weight 0 as
  // candidates, two or more on each rank that answers.
  const Data data = with_rows_below_range(48, 171, [&](std::uint64_t id) { return id >= 41 || (P > 1 ? id % P == 0 : id <= 22); });
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> one = queries_in_one_to_two(1);
  QueryOptions o;
  o.scale = 1.0f;
  o.top_k = 30;
  o.top_m = 30;
  const SoftResult want = p.whole.query_soft(one, o);
  const SoftResult got = p.sharded.query_soft(at_root(one), o);
  REQUIRE(want.candidates == 30);
  REQUIRE(!std::isfinite(want.top.back().score));  // the 30th candidate weighs 0
  CHECK(want.tail_bound == 0.0);
  // With one rank nobody sits out; with more, rank 0 does and offers no candidate, yet the answer
  // counts 30 candidates and bounds the tail by 0 as one collection does.
  if (P == 1) check_soft_equal(got, want);
  else check_soft_equal_but_weightless(got, want);
}

TEST_CASE("sharded: a query whose every row on every rank scores below -FLT_MAX is numeric_overflow, as on one collection", "[mpi]") {
  const Data data = with_rows_below_range(30, 161, [](std::uint64_t) { return true; });
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = queries_in_one_to_two(2);
  const std::vector<float> one(q.begin(), q.begin() + kD);
  QueryOptions o;
  o.scale = 1.0f;
  QueryOptions k = o;
  k.top_k = 4;
  CHECK(error_of([&] { (void)p.whole.query_soft(one, o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.whole.query_hard(one, o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.sharded.query_hard(at_root(one), o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.sharded.query(at_root(q), Retrieval::soft, o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.sharded.query(at_root(q), Retrieval::hard, o); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), k); }) == ErrorCode::numeric_overflow);
  // The collective stayed in step: an ordinary query answers like one collection.
  const std::vector<float> ordinary = softkv::test::normal_floats(kD, 162);
  CHECK(p.sharded.query_hard(at_root(ordinary)).id == p.whole.query_hard(ordinary).id);
}

TEST_CASE("sharded: add_batch numbers rows like one collection, remove_batch is all or nothing", "[mpi]") {
  const Data data = sharded_data(20, 71);
  Pair p(config(), data);
  const std::vector<float> keys = softkv::test::normal_floats(3 * kD, 72), values = softkv::test::normal_floats(3 * kDv, 73);
  const bool root = world_rank() == 0;
  const std::vector<std::uint64_t> ids = p.sharded.add_batch(root ? std::span<const float>(keys) : std::span<const float>{},
                                                             root ? std::span<const float>(values) : std::span<const float>{});
  CHECK(ids == p.whole.add_batch(keys, values));
  CHECK(p.sharded.size() == 23);
  // One unknown id among known ones: nothing is removed, every rank names the same id.
  const std::vector<std::uint64_t> bad{ids[0], 999, ids[1]};
  CHECK(error_of([&] { p.sharded.remove_batch(bad); }) == ErrorCode::unknown_id);
  CHECK(p.sharded.size() == 23);
  const std::vector<std::uint64_t> twice{ids[0], ids[0]};
  CHECK(error_of([&] { p.sharded.remove_batch(twice); }) == ErrorCode::invalid_argument);
  CHECK(p.sharded.size() == 23);
  p.sharded.remove_batch(std::vector<std::uint64_t>{ids[0], ids[2], data.ids[0]});
  p.whole.remove_batch(std::vector<std::uint64_t>{ids[0], ids[2], data.ids[0]});
  CHECK(p.sharded.size() == 20);
  const std::vector<float> q = softkv::test::normal_floats(kD, 74);
  check_soft_equal(p.sharded.query_soft(at_root(q)), p.whole.query_soft(q));
}

TEST_CASE("sharded: inputs and options are read at the given root only", "[mpi]") {
  const int root = static_cast<int>(world_size()) - 1;
  const bool at_last = static_cast<int>(world_rank()) == root;
  const Data data = sharded_data(200, 101);
  Collection whole(config(IndexKind::flat));
  whole.upsert_batch(data.ids, data.keys, data.values);
  ShardedCollection s(MPI_COMM_WORLD, config(IndexKind::flat));
  const std::vector<std::uint64_t> none_ids;
  const std::vector<float> none;
  s.upsert_batch(at_last ? data.ids : none_ids, at_last ? data.keys : none, at_last ? data.values : none, root);
  CHECK(s.size() == 200);
  const std::vector<float> q = softkv::test::normal_floats(kD, 102);
  QueryOptions good;  // the root's options
  good.temperature = 0.25f;
  good.top_m = 3;
  good.top_k = 20;
  QueryOptions bad;  // what the other ranks pass: invalid, and must be ignored
  bad.temperature = -1.0f;
  bad.epsilon = 7.0f;
  const std::vector<float> garbage(1, 0.0f);
  const SoftResult got = s.query_soft(at_last ? q : garbage, at_last ? good : bad, root);
  check_soft_equal(got, whole.query_soft(q, good));
  const HardResult hard = s.query_hard(at_last ? q : garbage, at_last ? good : bad, root);
  CHECK(hard.id == whole.query_hard(q, good).id);
  const std::vector<std::uint64_t> gone{data.ids[5], data.ids[6]};
  s.remove_batch(at_last ? gone : none_ids, root);
  CHECK(s.size() == 198);
}

TEST_CASE("sharded: every caller error is the same typed Error on every rank and changes nothing", "[mpi]") {
  ShardedCollection s(MPI_COMM_WORLD, config(IndexKind::flat));
  const std::vector<float> q(kD, 1.0f);
  CHECK(error_of([&] { (void)s.query_soft(at_root(q)); }) == ErrorCode::empty_collection);
  CHECK(error_of([&] { (void)s.query_hard(at_root(q)); }) == ErrorCode::empty_collection);
  const Data data = sharded_data(10, 81);
  s.upsert_batch(data.ids, data.keys, data.values);  // every rank passes the rows; root's are used
  CHECK(s.size() == 10);
  const std::vector<float> short_q(kD - 1, 1.0f);
  CHECK(error_of([&] { (void)s.query_soft(at_root(short_q)); }) == ErrorCode::dimension_mismatch);
  CHECK(error_of([&] { (void)s.query_soft(at_root({})); }) == ErrorCode::dimension_mismatch);
  std::vector<float> nan_q(q);
  nan_q[kD - 1] = std::numeric_limits<float>::infinity();
  CHECK(error_of([&] { (void)s.query_hard(at_root(nan_q)); }) == ErrorCode::non_finite);
  QueryOptions bad_t;
  bad_t.temperature = 0.0f;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), bad_t); }) == ErrorCode::invalid_argument);
  QueryOptions both;
  both.temperature = 1.0f;
  both.scale = 1.0f;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), both); }) == ErrorCode::invalid_argument);
  QueryOptions k0;
  k0.top_k = 0;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), k0); }) == ErrorCode::invalid_argument);
  QueryOptions eps_bad;
  eps_bad.epsilon = 1.0f;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), eps_bad); }) == ErrorCode::invalid_argument);
  QueryOptions k_and_eps;
  k_and_eps.top_k = 4;
  k_and_eps.epsilon = 0.1f;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), k_and_eps); }) == ErrorCode::invalid_argument);
  QueryOptions ef0;
  ef0.top_k = 4;
  ef0.ef_search = 0;
  CHECK(error_of([&] { (void)s.query_soft(at_root(q), ef0); }) == ErrorCode::invalid_argument);
  {  // top_k needs an index, as on one collection
    ShardedCollection no_index(MPI_COMM_WORLD, config(IndexKind::exact));
    no_index.upsert_batch(data.ids, data.keys, data.values);
    QueryOptions k4;
    k4.top_k = 4;
    CHECK(error_of([&] { (void)no_index.query_soft(at_root(q), k4); }) == ErrorCode::invalid_argument);
    CHECK(no_index.query_hard(at_root(q), k4).id == s.query_hard(at_root(q)).id);  // hard ignores top_k
  }
  for (int field = 0; field < 3; ++field) {  // masks outside their limits: refused at root, on every rank
    QueryOptions masked;
    if (field == 0) masked.tags_any.assign(QueryOptions::kMaxTagsAny + 1, 1);
    if (field == 1) masked.tag_range = TagRange{5, 4};
    if (field == 2) masked.exclude_ids.assign(QueryOptions::kMaxExcludeIds + 1, 1);
    CHECK(error_of([&] { (void)s.query_soft(at_root(q), masked); }) == ErrorCode::invalid_argument);
    CHECK(error_of([&] { (void)s.query_hard(at_root(q), masked); }) == ErrorCode::invalid_argument);
  }
  QueryOptions huge;
  huge.scale = 1e38f;
  std::vector<float> big_q(kD, 1e3f);
  CHECK(error_of([&] { (void)s.query_soft(at_root(big_q), huge); }) == ErrorCode::numeric_overflow);
  // Writes: checked at root before any rank stores anything.
  const std::vector<std::uint64_t> reserved{kReservedId};
  CHECK(error_of([&] { s.upsert_batch(reserved, q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::invalid_argument);
  const std::vector<std::uint64_t> one_id{5};
  CHECK(error_of([&] { s.upsert_batch(one_id, short_q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::dimension_mismatch);
  CHECK(error_of([&] { s.upsert_batch(one_id, q, std::vector<float>(kDv + 1, 0.0f)); }) == ErrorCode::dimension_mismatch);
  CHECK(error_of([&] { s.upsert_batch(one_id, nan_q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::non_finite);
  CHECK(error_of([&] { s.upsert_batch({}, q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::dimension_mismatch);
  CHECK(error_of([&] { (void)s.add_batch(short_q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::dimension_mismatch);
  CHECK(s.size() == 10);
  // The id counter at its end: one id below the reserved one is the last that add_batch may give.
  const std::vector<std::uint64_t> last{kReservedId - 2};
  s.upsert_batch(last, q, std::vector<float>(kDv, 0.0f));
  CHECK(s.add_batch(q, std::vector<float>(kDv, 0.0f)) == std::vector<std::uint64_t>{kReservedId - 1});
  CHECK(error_of([&] { (void)s.add_batch(q, std::vector<float>(kDv, 0.0f)); }) == ErrorCode::invalid_argument);
  CHECK(s.size() == 12);
  CHECK(error_of([&] { ShardedCollection bad(MPI_COMM_WORLD, CollectionConfig{}); }) == ErrorCode::invalid_argument);
}

TEST_CASE("partial records merge commutatively, with the empty record as identity", "[mpi][record]") {
  using detail::PartialRecords;
  using detail::RecordKind;
  PartialRecords a(1, RecordKind::soft, 3, 2), b(1, RecordKind::soft, 3, 2), empty(1, RecordKind::soft, 3, 2);
  detail::SoftmaxState sa(3), sb(3);
  sa.max = 2.0f; sa.sum = 1.5f; sa.acc = {1.0f, -2.0f, 0.5f};
  sb.max = 3.0f; sb.sum = 2.0f; sb.acc = {0.25f, 4.0f, -1.0f};
  a.set_state(0, sa);
  b.set_state(0, sb);
  a.header(0).rows = 4;
  b.header(0).rows = 6;
  a.top_ids(0)[0] = 9; a.top_scores(0)[0] = 2.0f; a.header(0).top_count = 1;
  b.top_ids(0)[0] = 4; b.top_scores(0)[0] = 3.0f; b.top_ids(0)[1] = 2; b.top_scores(0)[1] = 1.0f; b.header(0).top_count = 2;
  PartialRecords ab = a, ba = b;
  detail::merge_record(b.data(), ab.data());
  detail::merge_record(a.data(), ba.data());
  CHECK(std::memcmp(ab.data(), ba.data(), ab.record_bytes()) == 0);
  CHECK(ab.header(0).rows == 10);
  CHECK(ab.header(0).top_count == 2);
  CHECK(ab.top_ids(0)[0] == 4);
  CHECK(ab.top_ids(0)[1] == 9);
  // The merged state in double: lse = log(1.5 e^2 + 2 e^3).
  const detail::SoftmaxState merged = ab.state(0);
  CHECK(merged.lse() == Approx(std::log(1.5 * std::exp(2.0) + 2.0 * std::exp(3.0))).epsilon(1e-6));
  CHECK(merged.acc[1] * std::exp(static_cast<double>(merged.max)) ==
        Approx(-2.0 * std::exp(2.0) + 4.0 * std::exp(3.0)).epsilon(1e-6));
  PartialRecords a_empty = a;
  detail::merge_record(empty.data(), a_empty.data());
  CHECK(std::memcmp(a_empty.data(), a.data(), a.record_bytes()) == 0);
  // Hard: the higher score wins; equal scores go to the smaller id, from either side.
  PartialRecords h1(1, RecordKind::hard, 1, 0), h2(1, RecordKind::hard, 1, 0);
  h1.header(0).has_best = 1; h1.header(0).max = 5.0f; h1.header(0).best_id = 8; h1.vector(0)[0] = 1.0f;
  h2.header(0).has_best = 1; h2.header(0).max = 5.0f; h2.header(0).best_id = 3; h2.vector(0)[0] = 2.0f;
  PartialRecords h12 = h1, h21 = h2;
  detail::merge_record(h2.data(), h12.data());
  detail::merge_record(h1.data(), h21.data());
  CHECK(h12.header(0).best_id == 3);
  CHECK(h12.vector(0)[0] == 2.0f);
  CHECK(std::memcmp(h12.data(), h21.data(), h12.record_bytes()) == 0);
  // An error code reduces to the smallest non-zero one.
  PartialRecords e1 = a, e2 = b;
  e1.set_error(13);
  e2.set_error(3);
  detail::merge_record(e2.data(), e1.data());
  CHECK(e1.header(0).error == 3);
}

namespace {

// The sharded soft answer's value under mask (default options otherwise).
std::vector<float> got_value_or(const Pair& p, const std::vector<float>& q, const QueryOptions& mask) {
  return p.sharded.query_soft(at_root(q), mask).value;
}

// Rows tagged i % 7, one row (index 10) alone with tag 99, and tag 77 on the even rows the last rank owns.
Data tagged_data(std::size_t n, std::uint64_t seed) {
  Data data = sharded_data(n, seed, 5);
  const std::size_t P = world_size();
  for (std::size_t i = 0; i < n; ++i) data.tags.push_back(i % 7);
  data.tags[10] = 99;
  for (std::size_t i = 0; i < n; ++i)
    if (i != 10 && i % 2 == 0 && shard_owner(data.ids[i], P) == P - 1) data.tags[i] = 77;
  return data;
}

// Whether row i passes options' mask (the rule of QueryOptions, written out).
bool passes(const Data& data, std::size_t i, const QueryOptions& o) {
  const std::uint64_t tag = data.tags[i];
  if (!o.tags_any.empty() && std::find(o.tags_any.begin(), o.tags_any.end(), tag) == o.tags_any.end()) return false;
  if (o.tag_range && (tag < o.tag_range->lo || tag > o.tag_range->hi)) return false;
  return std::find(o.exclude_ids.begin(), o.exclude_ids.end(), data.ids[i]) == o.exclude_ids.end();
}

// The eligible rows of data under o, as their own Data (for the double reference).
Data eligible_subset(const Data& data, const QueryOptions& o) {
  Data out;
  for (std::size_t i = 0; i < data.ids.size(); ++i) {
    if (!passes(data, i, o)) continue;
    out.ids.push_back(data.ids[i]);
    out.keys.insert(out.keys.end(), data.keys.begin() + static_cast<std::ptrdiff_t>(i * kD), data.keys.begin() + static_cast<std::ptrdiff_t>((i + 1) * kD));
    out.values.insert(out.values.end(), data.values.begin() + static_cast<std::ptrdiff_t>(i * kDv),
                      data.values.begin() + static_cast<std::ptrdiff_t>((i + 1) * kDv));
    out.tags.push_back(data.tags[i]);
  }
  return out;
}

// The masks of the masked tests, with a name: several tags, a range, excluded ids, all three, all rows,
// exactly one row, only the last rank's rows.
std::vector<std::pair<const char*, QueryOptions>> masks(const Data& data) {
  std::vector<std::pair<const char*, QueryOptions>> out;
  QueryOptions o;
  o.tags_any = {1, 3, 5};
  out.emplace_back("tags_any", o);
  o = {};
  o.tag_range = TagRange{2, 4};
  out.emplace_back("tag_range", o);
  o = {};
  for (std::size_t i = 0; i < data.ids.size(); i += 3) o.exclude_ids.push_back(data.ids[i]);
  o.exclude_ids.push_back(123456789);  // an id no entry has is ignored
  out.emplace_back("exclude_ids", o);
  o.tags_any = {0, 1, 2, 4, 77};
  o.tag_range = TagRange{1, 80};
  out.emplace_back("all three", o);
  o = {};
  o.tag_range = TagRange{0, 1000};
  out.emplace_back("keeps all", o);
  o = {};
  o.tags_any = {99};
  out.emplace_back("keeps one", o);
  o = {};
  o.tags_any = {77};
  out.emplace_back("last rank only", o);
  return out;
}

}  // namespace

TEST_CASE("sharded: tags travel with their rows on upsert_batch and add_batch", "[mpi][mask]") {
  const Data data = tagged_data(120, 301);
  Pair p(config(), data);
  for (std::size_t i = 0; i < data.ids.size(); ++i)
    if (p.sharded.owner(data.ids[i]) == world_rank()) CHECK(p.sharded.shard().get(data.ids[i]).tag == data.tags[i]);
  const std::vector<float> keys = softkv::test::normal_floats(3 * kD, 302), values = softkv::test::normal_floats(3 * kDv, 303);
  const std::vector<std::uint64_t> tags = {41, 42, 43};
  const bool root = world_rank() == 0;
  const std::vector<std::uint64_t> ids = p.sharded.add_batch(root ? std::span<const float>(keys) : std::span<const float>{}, values,
                                                             root ? std::span<const std::uint64_t>(tags) : std::span<const std::uint64_t>{});
  REQUIRE(ids.size() == 3);
  for (std::size_t i = 0; i < 3; ++i)
    if (p.sharded.owner(ids[i]) == world_rank()) CHECK(p.sharded.shard().get(ids[i]).tag == tags[i]);
  const std::vector<std::uint64_t> wrong = {1};  // tags 0 or n: checked at root, the same Error everywhere
  CHECK(error_of([&] { (void)p.sharded.add_batch(keys, values, wrong); }) == ErrorCode::dimension_mismatch);
  CHECK(p.sharded.size() == data.ids.size() + 3);
}

TEST_CASE("sharded: masked soft, hard and batched answers equal one collection's and a double reference", "[mpi][mask]") {
  for (Metric metric : {Metric::dot, Metric::cosine}) {
    const Data data = tagged_data(700, 311);
    Pair p(config(IndexKind::exact, metric), data);
    const std::vector<float> queries = softkv::test::normal_floats(3 * kD, 312, 3.0f);
    const std::vector<float> one(queries.begin(), queries.begin() + kD);
    for (const auto& [name, mask] : masks(data)) {
      INFO("mask: " << name << ", metric " << static_cast<int>(metric));
      const Data sub = eligible_subset(data, mask);
      REQUIRE(!sub.ids.empty());
      for (std::size_t top_m : {std::size_t{0}, std::size_t{4}, std::size_t{2000}}) {
        QueryOptions o = mask;
        o.top_m = top_m;
        const SoftResult got = p.sharded.query_soft(at_root(one), o);
        check_soft_equal(got, p.whole.query_soft(one, o));
        CHECK(got.candidates == sub.ids.size());
        CHECK(got.top.size() == std::min(top_m, sub.ids.size()));
        for (const Contributor& c : got.top) CHECK(std::find(sub.ids.begin(), sub.ids.end(), c.id) != sub.ids.end());
      }
      const HardResult hard = p.sharded.query_hard(at_root(one), mask);
      const HardResult hard_whole = p.whole.query_hard(one, mask);
      CHECK(hard.id == hard_whole.id);
      CHECK(hard.score == Approx(hard_whole.score).epsilon(1e-6).margin(1e-6));
      CHECK(hard.value == hard_whole.value);
      const QueryResults soft_batch = p.sharded.query(at_root(queries), Retrieval::soft, mask);
      const QueryResults soft_want = p.whole.query(queries, Retrieval::soft, mask);
      const QueryResults hard_batch = p.sharded.query(at_root(queries), Retrieval::hard, mask);
      const QueryResults hard_want = p.whole.query(queries, Retrieval::hard, mask);
      REQUIRE(soft_batch.soft.size() == 3);
      REQUIRE(hard_batch.hard.size() == 3);
      for (std::size_t b = 0; b < 3; ++b) {
        check_soft_equal(soft_batch.soft[b], soft_want.soft[b]);
        CHECK(hard_batch.hard[b].id == hard_want.hard[b].id);
        CHECK(hard_batch.hard[b].value == hard_want.hard[b].value);
      }
      if (metric == Metric::dot) {  // the double reference over the eligible rows only
        const auto ref = softkv::test::soft_reference(one.data(), sub.keys.data(), sub.values.data(), sub.ids.size(), kD, kDv,
                                                      1.0 / std::sqrt(static_cast<double>(kD)));
        CHECK(max_abs_diff(got_value_or(p, one, mask), ref.value) <= 1e-5);
        std::size_t best = 0;
        for (std::size_t i = 1; i < sub.ids.size(); ++i)
          if (ref.scores[i] > ref.scores[best] || (ref.scores[i] == ref.scores[best] && sub.ids[i] < sub.ids[best])) best = i;
        CHECK(hard.id == sub.ids[best]);
      }
    }
  }
}

TEST_CASE("sharded: masked pruned answers (top_k, epsilon) use the global eligible N", "[mpi][mask]") {
  const Data data = tagged_data(900, 321);
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = softkv::test::normal_floats(kD, 322, 6.0f);
  for (const auto& [name, mask] : masks(data)) {
    const std::size_t eligible = eligible_subset(data, mask).ids.size();
    for (std::size_t k : {std::size_t{1}, std::size_t{5}, std::size_t{40}, eligible, eligible + 7}) {
      INFO("mask: " << name << ", k = " << k);
      QueryOptions o = mask;
      o.top_k = k;
      o.top_m = 3;
      const SoftResult want = p.whole.query_soft(q, o);
      const SoftResult got = p.sharded.query_soft(at_root(q), o);
      check_soft_equal(got, want);
      CHECK(got.searched_with == want.searched_with);
      CHECK(got.candidates == std::min(k, eligible));
      CHECK_FALSE(got.mask_filtered_after_search);  // flat visits eligible rows only
    }
    for (float eps : {0.3f, 1e-3f}) {
      INFO("mask: " << name << ", epsilon = " << eps);
      QueryOptions o = mask;
      o.epsilon = eps;
      const SoftResult got = p.sharded.query_soft(at_root(q), o);
      check_soft_equal(got, p.whole.query_soft(q, o));
      CHECK(got.tail_bound <= eps);
    }
  }
}

TEST_CASE("sharded: masked pruning through hnsw reports filtering after search when a shard did", "[mpi][mask]") {
  const Data data = tagged_data(1200, 331);
  Pair p(config(IndexKind::hnsw), data);
  p.sharded.shard().wait_until_indexed();
  const std::vector<float> q = softkv::test::normal_floats(kD, 332, 6.0f);
  QueryOptions o;
  o.tag_range = TagRange{0, 5};  // most rows
  o.top_k = 8;
  o.top_m = 8;
  const SoftResult got = p.sharded.query_soft(at_root(q), o);
  CHECK(got.candidates == 8);
  // Each shard's own pruned query at k says whether its index filtered after searching; the merged answer ORs them.
  int local = p.sharded.shard().eligible_count(o) > 0 && p.sharded.shard().query_soft(q, o).mask_filtered_after_search ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &local, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  CHECK(got.mask_filtered_after_search == (local != 0));
  p.whole.wait_until_indexed();
  if (world_size() == 1) CHECK(got.mask_filtered_after_search == p.whole.query_soft(q, o).mask_filtered_after_search);
  const Data sub = eligible_subset(data, o);
  for (const Contributor& c : got.top) CHECK(std::find(sub.ids.begin(), sub.ids.end(), c.id) != sub.ids.end());
}

TEST_CASE("sharded: a mask that keeps no entry anywhere is empty_collection on every rank", "[mpi][mask]") {
  const Data data = tagged_data(200, 341);
  Pair p(config(IndexKind::flat), data);
  const std::vector<float> q = softkv::test::normal_floats(2 * kD, 342);
  const std::vector<float> one(q.begin(), q.begin() + kD);
  QueryOptions none;
  none.tags_any = {12345};
  QueryOptions excluded;
  excluded.exclude_ids = data.ids;
  for (const QueryOptions& mask : {none, excluded}) {
    CHECK(error_of([&] { (void)p.whole.query_soft(one, mask); }) == ErrorCode::empty_collection);
    CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), mask); }) == ErrorCode::empty_collection);
    CHECK(error_of([&] { (void)p.sharded.query_hard(at_root(one), mask); }) == ErrorCode::empty_collection);
    CHECK(error_of([&] { (void)p.sharded.query(at_root(q), Retrieval::soft, mask); }) == ErrorCode::empty_collection);
    CHECK(error_of([&] { (void)p.sharded.query(at_root(q), Retrieval::hard, mask); }) == ErrorCode::empty_collection);
    QueryOptions pruned = mask;
    pruned.top_k = 4;
    CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), pruned); }) == ErrorCode::empty_collection);
    pruned.top_k.reset();
    pruned.epsilon = 0.1f;
    CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), pruned); }) == ErrorCode::empty_collection);
    QueryOptions top = mask;
    top.top_m = 5;
    CHECK(error_of([&] { (void)p.sharded.query_soft(at_root(one), top); }) == ErrorCode::empty_collection);
  }
  CHECK(p.sharded.query_hard(at_root(one)).id == p.whole.query_hard(one).id);  // the collective stayed in step
}

TEST_CASE("sharded: compact precisions (keys f16 or i8, values bf16) answer like one collection of the same config", "[mpi][precision]") {
  for (Precision key : {Precision::f16, Precision::i8}) {
    CollectionConfig c = config(IndexKind::flat);
    c.key_precision = key;
    c.value_precision = Precision::bf16;
    const Data data = tagged_data(500, 351);
    Pair p(c, data);
    INFO("key precision " << static_cast<int>(key));
    for (std::size_t i = 0; i < data.ids.size(); ++i)  // every shard stores the rows rounded as one collection does
      if (p.sharded.owner(data.ids[i]) == world_rank()) {
        const Entry mine = p.sharded.shard().get(data.ids[i]), want = p.whole.get(data.ids[i]);
        CHECK(mine.key == want.key);
        CHECK(mine.value == want.value);
      }
    const std::vector<float> queries = softkv::test::normal_floats(3 * kD, 352, 3.0f);
    const std::vector<float> one(queries.begin(), queries.begin() + kD);
    QueryOptions top;
    top.top_m = 5;
    check_soft_equal(p.sharded.query_soft(at_root(one), top), p.whole.query_soft(one, top));
    const QueryResults soft = p.sharded.query(at_root(queries), Retrieval::soft);
    const QueryResults soft_want = p.whole.query(queries, Retrieval::soft);
    const QueryResults hard = p.sharded.query(at_root(queries), Retrieval::hard);
    const QueryResults hard_want = p.whole.query(queries, Retrieval::hard);
    for (std::size_t b = 0; b < 3; ++b) {
      check_soft_equal(soft.soft.at(b), soft_want.soft.at(b));
      CHECK(hard.hard.at(b).id == hard_want.hard.at(b).id);
      CHECK(hard.hard.at(b).value == hard_want.hard.at(b).value);
    }
    QueryOptions pruned;
    pruned.top_k = 9;
    pruned.top_m = 3;
    check_soft_equal(p.sharded.query_soft(at_root(one), pruned), p.whole.query_soft(one, pruned));
    QueryOptions masked = masks(data)[0].second;
    masked.top_m = 3;
    check_soft_equal(p.sharded.query_soft(at_root(one), masked), p.whole.query_soft(one, masked));
    masked.top_k = 4;
    check_soft_equal(p.sharded.query_soft(at_root(one), masked), p.whole.query_soft(one, masked));
  }
}

TEST_CASE("write parts: every rank's part of an upsert or remove holds exactly its owned rows, in order", "[mpi][parts]") {
  using namespace softkv::detail;
  for (std::size_t ranks : {1u, 2u, 3u, 7u}) {
    Rows rows;
    for (std::uint64_t id : {14ull, 3ull, 0ull, 9ull, 21ull, 5ull, 6ull}) {
      rows.ids.push_back(id);
      rows.keys.insert(rows.keys.end(), {float(id), float(id) + 0.5f});
      rows.values.push_back(-float(id));
      rows.tags.push_back(id * 10);
    }
    const Mutation whole = mutation::Upsert{"c", rows, true};
    std::size_t seen = 0, owners = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto part = part_of(whole, r, ranks);
      if (!part) continue;
      ++owners;
      const auto& u = std::get<mutation::Upsert>(*part);
      CHECK(u.name == "c");
      CHECK(u.keys_as_given);
      REQUIRE(u.rows.keys.size() == 2 * u.rows.ids.size());
      REQUIRE(u.rows.values.size() == u.rows.ids.size());
      REQUIRE(u.rows.tags.size() == u.rows.ids.size());
      std::size_t last_pos = 0;
      for (std::size_t i = 0; i < u.rows.ids.size(); ++i) {
        const std::uint64_t id = u.rows.ids[i];
        CHECK(id % ranks == r);
        const auto pos = static_cast<std::size_t>(std::find(rows.ids.begin(), rows.ids.end(), id) - rows.ids.begin());
        if (i > 0) CHECK(pos > last_pos);  // the whole's order
        last_pos = pos;
        CHECK(u.rows.keys[2 * i] == float(id));
        CHECK(u.rows.keys[2 * i + 1] == float(id) + 0.5f);
        CHECK(u.rows.values[i] == -float(id));
        CHECK(u.rows.tags[i] == id * 10);
      }
      seen += u.rows.ids.size();
    }
    CHECK(seen == rows.ids.size());
    CHECK(owners == owners_of(whole, ranks));
    const Mutation remove = mutation::Remove{"c", rows.ids};
    std::size_t removed = 0;
    for (std::size_t r = 0; r < ranks; ++r)
      if (const auto part = part_of(remove, r, ranks)) {
        for (std::uint64_t id : std::get<mutation::Remove>(*part).ids) CHECK(id % ranks == r);
        removed += std::get<mutation::Remove>(*part).ids.size();
      }
    CHECK(removed == rows.ids.size());
    CHECK(owners_of(remove, ranks) == owners);
    // create and drop go to every rank whole
    CHECK(owners_of(mutation::Drop{"c"}, ranks) == ranks);
    CHECK(std::get<mutation::Drop>(*part_of(mutation::Drop{"c"}, ranks - 1, ranks)).name == "c");
  }
}

TEST_CASE("write parts: the byte form round-trips every kind and refuses damaged bytes as corrupt_file", "[mpi][parts]") {
  using namespace softkv::detail;
  CollectionConfig config{3, 2};
  config.heads = 1;
  Rows untagged{{1, 2}, {1, 2, 3, 4, 5, 6}, {7, 8, 9, 10}, {}};
  Rows tagged = untagged;
  tagged.tags = {0, std::numeric_limits<std::uint64_t>::max()};
  for (const Mutation& m : std::vector<Mutation>{mutation::Create{"name", config}, mutation::Drop{"d"},
                                                  mutation::Upsert{"u", untagged, false}, mutation::Upsert{"t", tagged, false},
                                                  mutation::Upsert{"e", Rows{}, false},
                                                  mutation::Remove{"r", {0, 5, std::numeric_limits<std::uint64_t>::max() - 1}}}) {
    const PartTag tag{"0123456789abcdef0123456789abcdef", 2, 3, std::numeric_limits<std::uint64_t>::max()};
    const std::vector<std::byte> bytes = encode_part(m, tag);
    const Part back = decode_part(bytes, "part");
    CHECK(back.tag == tag);
    REQUIRE(back.mutation.index() == m.index());
    CHECK(collection_of(back.mutation) == collection_of(m));
    CHECK(encode_part(back.mutation, back.tag) == bytes);  // every field survived
    // any flipped byte, any truncation: corrupt_file, never a different write
    for (std::size_t at = 0; at < bytes.size(); at += 1 + bytes.size() / 40) {
      std::vector<std::byte> bad = bytes;
      bad[at] ^= std::byte{0x5a};
      CHECK(error_of([&] { (void)decode_part(bad, "part"); }) == ErrorCode::corrupt_file);
      CHECK(error_of([&] { (void)decode_part(std::span(bytes).first(at), "part"); }) == ErrorCode::corrupt_file);
    }
  }
}
