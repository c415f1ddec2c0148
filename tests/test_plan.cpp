// The query plan (src/query/plan.hpp): every routing rule, decided once, over every option that moves
// a query from one path to another; and every door (query, query_soft/hard, the batch methods, the
// sharded server's merge rule) follows it.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>

#include "pruning.hpp"
#include "query/plan.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;
using detail::QueryPath;
using detail::SinglePath;

namespace {

CollectionConfig config_of(IndexKind kind, std::size_t heads = 1) {
  CollectionConfig c{8, 8, Metric::dot, {}, {}};
  c.heads = heads;
  c.index.kind = kind;
  return c;
}

}  // namespace

TEST_CASE("the plan groups a call's queries: one fused pass for plain scans, each on its own otherwise", "[query][plan]") {
  const CollectionConfig plain = config_of(IndexKind::exact), flat = config_of(IndexKind::flat);
  const CollectionConfig hnsw = config_of(IndexKind::hnsw), ivf = config_of(IndexKind::ivf), automatic = config_of(IndexKind::automatic);
  const CollectionConfig heads = config_of(IndexKind::exact, 4);
  for (const Retrieval kind : {Retrieval::soft, Retrieval::hard}) {
    CHECK(detail::plan_query(plain, true, {}, 5, kind).path == QueryPath::fused);
    CHECK(detail::plan_query(plain, true, {}, 1, kind).path == QueryPath::each);  // one query: its own path, which may coalesce
    CHECK(detail::plan_query(plain, true, {}, 1, kind).coalesce);
    CHECK_FALSE(detail::plan_query(plain, false, {}, 1, kind).coalesce);  // coalescing off
    CHECK(detail::plan_query(heads, true, {}, 5, kind).path == QueryPath::heads_fused);
    CHECK(detail::plan_query(plain, true, {.tags_any = {1}}, 5, kind).path == QueryPath::fused);  // masks fuse
    CHECK_FALSE(detail::plan_query(plain, true, {.tags_any = {1}}, 1, kind).coalesce);         // but never wait
  }
  // Soft: contributors, pruning, estimates and iterations take each query on its own path.
  CHECK(detail::plan_query(plain, true, {.top_m = 3}, 5, Retrieval::soft).path == QueryPath::each);
  CHECK(detail::plan_query(plain, true, {.top_m = 3}, 1, Retrieval::soft).coalesce);  // a coalesced pass serves contributors
  CHECK_FALSE(detail::plan_query(heads, true, {.top_m = 3}, 1, Retrieval::soft).coalesce);  // a multi-head query's come from its own pass
  CHECK(detail::plan_query(heads, true, {.top_m = 3}, 5, Retrieval::hard).path == QueryPath::heads_fused);  // hard ignores top_m
  for (const CollectionConfig& c : {flat, hnsw, ivf}) {
    const detail::QueryPlan top_k = detail::plan_query(c, true, {.top_k = 4}, 5, Retrieval::soft);
    CHECK(top_k.path == QueryPath::each);
    CHECK(top_k.single == SinglePath::pruned);
    CHECK_FALSE(top_k.coalesce);
    CHECK(detail::plan_query(c, true, {.epsilon = 0.01f}, 5, Retrieval::soft).single == SinglePath::pruned);
    // exact = true: the scan, fused and coalesced like a plain collection's
    CHECK(detail::plan_query(c, true, {.top_k = 4, .exact = true}, 5, Retrieval::soft).path == QueryPath::fused);
  }
  const detail::QueryPlan estimated = detail::plan_query(plain, true, {.error_target = 0.01f}, 5, Retrieval::soft);
  CHECK(estimated.path == QueryPath::estimated);  // one shared sample for the batch
  CHECK(detail::plan_query(plain, true, {.error_target = 0.01f}, 1, Retrieval::soft).path == QueryPath::each);
  CHECK(estimated.single == SinglePath::estimated);
  CHECK_FALSE(estimated.coalesce);
  CHECK(detail::plan_query(plain, true, {.error_target = 0.0f}, 5, Retrieval::soft).path == QueryPath::fused);  // 0: the exact answer
  const CollectionConfig square = config_of(IndexKind::exact);
  CHECK(detail::plan_query(square, true, {.iterations = 3}, 5, Retrieval::soft).path == QueryPath::each);
  // Hard: hnsw, ivf and automatic answer through their index, query by query; flat and exact scan.
  for (const CollectionConfig& c : {hnsw, ivf, automatic}) {
    const detail::QueryPlan p = detail::plan_query(c, true, {}, 5, Retrieval::hard);
    CHECK(p.path == QueryPath::each);
    CHECK(p.single == SinglePath::through_index);
    CHECK_FALSE(p.coalesce);
    CHECK(detail::plan_query(c, true, {.exact = true}, 5, Retrieval::hard).path == QueryPath::fused);
    CHECK(detail::plan_query(c, true, {.top_k = 4}, 5, Retrieval::hard).single == SinglePath::through_index);  // soft-only fields ignored
  }
  CHECK(detail::plan_query(flat, true, {}, 5, Retrieval::hard).path == QueryPath::fused);
}

TEST_CASE("the plan checks the options once for every door", "[query][plan][errors]") {
  const CollectionConfig plain = config_of(IndexKind::exact), heads = config_of(IndexKind::flat, 2);
  auto code = [](auto&& f) -> std::optional<ErrorCode> {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return std::nullopt;
  };
  CHECK(code([&] { (void)detail::plan_query(plain, true, {.temperature = 1.0f, .scale = 1.0f}, 1, Retrieval::soft); }) ==
        ErrorCode::invalid_argument);
  CHECK(code([&] { (void)detail::plan_query(plain, true, {.top_k = 4}, 1, Retrieval::soft); }) == ErrorCode::invalid_argument);  // no index
  CHECK(code([&] { (void)detail::plan_query(plain, true, {.top_k = 4}, 1, Retrieval::hard); }) == std::nullopt);  // hard ignores it
  CHECK(code([&] { (void)detail::plan_query(heads, true, {.top_k = 4}, 1, Retrieval::soft); }) == ErrorCode::unsupported);
  CHECK(code([&] { (void)detail::plan_query(heads, true, {.error_target = 0.1f}, 1, Retrieval::soft); }) == ErrorCode::unsupported);
  CHECK(code([&] { (void)detail::plan_query(plain, true, {.iterations = 2}, 1, Retrieval::hard); }) == ErrorCode::invalid_argument);
  CHECK(code([&] { (void)detail::plan_query(plain, true, {.error_target = -1.0f}, 1, Retrieval::soft); }) == ErrorCode::invalid_argument);
  CHECK(code([&] { (void)detail::plan_query(plain, true, {}, 1, static_cast<Retrieval>(7)); }) == ErrorCode::invalid_argument);
  // The scale the plan resolves is the one Collection::resolve_scale reports.
  const Collection c(plain);
  for (const QueryOptions& o : {QueryOptions{}, QueryOptions{.temperature = 0.25f}, QueryOptions{.scale = 3.0f}})
    CHECK(detail::plan_query(plain, true, o, 1, Retrieval::soft).scale == c.resolve_scale(o));
}

TEST_CASE("the sharded server merges exactly the requests the plan answers in one pass", "[query][plan]") {
  const CollectionConfig plain = config_of(IndexKind::exact), hnsw = config_of(IndexKind::hnsw);
  CHECK(detail::shares_a_pass(plain, {}, Retrieval::soft));
  CHECK(detail::shares_a_pass(plain, {}, Retrieval::hard));
  CHECK_FALSE(detail::shares_a_pass(plain, {.top_m = 2}, Retrieval::soft));
  CHECK(detail::shares_a_pass(plain, {.top_m = 2}, Retrieval::hard));
  CHECK_FALSE(detail::shares_a_pass(hnsw, {.top_k = 8}, Retrieval::soft));
  CHECK(detail::shares_a_pass(hnsw, {.top_k = 8, .exact = true}, Retrieval::soft));
  CHECK_FALSE(detail::shares_a_pass(hnsw, {}, Retrieval::hard));
  CHECK_THROWS_AS(detail::shares_a_pass(plain, {.temperature = -1.0f}, Retrieval::soft), Error);  // refused as plan_query refuses
}

TEST_CASE("every door answers as query() plans: the batch methods equal query() on an index-searched collection", "[query][plan]") {
  CollectionConfig config{16, 4, Metric::dot, {}, {}};
  config.index.kind = IndexKind::hnsw;
  config.index.hnsw_ef_construction = 40;
  Collection c(config);
  c.add_batch(test::normal_floats(2000 * 16, 1), test::normal_floats(2000 * 4, 2));
  c.wait_until_indexed();
  const auto qs = test::normal_floats(6 * 16, 3);
  const QueryResults all = c.query(qs, Retrieval::hard);
  const HardBatchResult batch = c.query_hard_batch(qs);
  REQUIRE(all.hard.size() == 6);
  for (std::size_t b = 0; b < 6; ++b) {
    CHECK(all.hard[b].searched_with == IndexKind::hnsw);  // through the index, as a single query would
    CHECK(batch.ids[b] == all.hard[b].id);
    CHECK(batch.scores[b] == all.hard[b].score);
    CHECK(c.query_hard(std::span(qs).subspan(b * 16, 16)).id == all.hard[b].id);
  }
  // One soft query through the batch door takes the single path (equal to query_soft, bit for bit).
  const auto one = std::span(qs).subspan(0, 16);
  const SoftBatchResult sb = c.query_soft_batch(one, {.temperature = 0.5f});
  const SoftResult s = c.query_soft(one, {.temperature = 0.5f});
  CHECK(sb.values == s.value);
  CHECK(sb.lse == std::vector<double>{s.lse});
}

TEST_CASE("the planner's calibration turns measured times into the factor its cost model is scaled by", "[query][plan]") {
  detail::PlannerCalibration c;
  CHECK(c.factor() == 1.0);  // nothing measured: the model as it stands
  c.note_scan(1000.0, 100);  // 10 ns a scanned row
  CHECK(c.factor() == 1.0);  // one side only
  c.note_pruned(6000.0, 200);  // 30 ns a modelled row-equivalent: three scanned rows each
  CHECK(c.factor() == Approx(3.0));
  c.note_pruned(1000.0, 1000);  // 1 ns: the average moves a fifth of the way
  CHECK(c.factor() == Approx((0.8 * 30 + 0.2 * 1) / 10));
  for (int i = 0; i < 40; ++i) c.note_pruned(1.0, 1000);  // a model far too pessimistic is trusted to 4x at most
  CHECK(c.factor() == 0.25);
  c.note_scan(0.0, 0);  // a zero-row scan is one row, not a division by zero
  CHECK(std::isfinite(c.factor()));
  int explored = 0;
  for (int i = 0; i < 160; ++i) explored += c.explore();
  CHECK(explored == 10);  // one query in 16
}

TEST_CASE("the planner skips attempts after 8 misses in a row, or once their misses wasted more than their answers saved", "[query][plan]") {
  using Attempt = detail::PlannerCalibration::Attempt;
  detail::PlannerCalibration c;
  const auto skipped_of_16 = [&](Attempt a) {
    int n = 0;
    for (int i = 0; i < 16; ++i) n += c.skip(a);
    return n;
  };
  // Cheap misses (a twentieth of the scan each: the scan measured at 10 ns a row over 1,000 rows) skip after 8.
  c.note_scan(1e4, 1000);
  CHECK(c.balance(Attempt::top_k_walk) == Approx(0.5));  // every kind starts with half a scan's credit
  for (int i = 0; i < 7; ++i) c.note(Attempt::top_k_walk, false, 500.0, 1000);
  CHECK(skipped_of_16(Attempt::top_k_walk) == 0);
  c.note(Attempt::top_k_walk, false, 500.0, 1000);
  CHECK(c.balance(Attempt::top_k_walk) == Approx(0.1));
  CHECK(skipped_of_16(Attempt::top_k_walk) == 15);  // one in 16 still tries
  CHECK(skipped_of_16(Attempt::sample) == 0);  // the other kinds keep their own count
  CHECK(skipped_of_16(Attempt::estimate_walk) == 0);
  CHECK(skipped_of_16(Attempt::epsilon_walk) == 0);
  c.note(Attempt::top_k_walk, true, 500.0, 1000);  // an answer ends the skipping
  CHECK(skipped_of_16(Attempt::top_k_walk) == 0);
  // Costly misses (0.3 of the scan each) spend the credit: three are not enough, four are.
  for (int i = 0; i < 3; ++i) c.note(Attempt::sample, false, 3000.0, 1000);
  CHECK(skipped_of_16(Attempt::sample) == 0);
  c.note(Attempt::sample, false, 3000.0, 1000);
  CHECK(c.balance(Attempt::sample) == Approx(-0.5));  // (-0.7, kept at -0.5)
  CHECK(skipped_of_16(Attempt::sample) == 15);
  // An answer costing a quarter of the scan repays 0.75: the attempts resume.
  c.note(Attempt::sample, true, 2500.0, 1000);
  CHECK(c.balance(Attempt::sample) == Approx(0.25));
  CHECK(skipped_of_16(Attempt::sample) == 0);
  // A stream the attempt answers one query in four, each answer costing 0.3 of the scan and each miss 0.3
  // wasted: 0.7 saved against 0.9 wasted every four queries, so the misses reset by answers still lead to
  // skipping (the old rule, misses in a row, never would: an answer came every fourth query).
  detail::PlannerCalibration alternating;
  alternating.note_scan(1e4, 1000);
  int skipped = 0;
  for (int i = 0; i < 64; ++i) {
    if (alternating.skip(Attempt::estimate_walk)) {
      ++skipped;
      continue;
    }
    alternating.note(Attempt::estimate_walk, i % 4 == 3, 3000.0, 1000);
  }
  CHECK(alternating.misses(Attempt::estimate_walk) < 8);
  CHECK(skipped >= 32);
  // The same stream answering one query in two pays for itself (0.7 saved against 0.3 wasted) and runs.
  detail::PlannerCalibration paying;
  paying.note_scan(1e4, 1000);
  for (int i = 0; i < 64; ++i) {
    CHECK_FALSE(paying.skip(Attempt::estimate_walk));
    paying.note(Attempt::estimate_walk, i % 2 == 1, 3000.0, 1000);
  }
  // An answer slower than the scan saved nothing and loses nothing (a stalled query is as likely the
  // machine's as the path's); a miss loses at most half a scan, so one stalled miss does not start the
  // skipping, a second does.
  detail::PlannerCalibration slow;
  slow.note_scan(1e4, 1000);
  slow.note(Attempt::sample, true, 5e4, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(0.5));
  slow.note(Attempt::sample, false, 1e6, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(0.0));
  CHECK_FALSE(slow.skip(Attempt::sample));
  slow.note(Attempt::sample, false, 1e6, 1000);
  CHECK(slow.skip(Attempt::sample));
  // The balance owes at most half a scan, and any answer ends the skipping: one at 0.1 of the scan lifts
  // it to 0.4, one at 0.9 or slower than the scan to -0.25 (a stream of answers is never skipped for their time).
  for (int i = 0; i < 40; ++i) slow.note(Attempt::sample, false, 9000.0, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(-0.5));
  slow.note(Attempt::sample, true, 1000.0, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(0.4));
  CHECK_FALSE(slow.skip(Attempt::sample));
  for (int i = 0; i < 2; ++i) slow.note(Attempt::sample, false, 9000.0, 1000);
  CHECK(slow.skip(Attempt::sample));
  slow.note(Attempt::sample, true, 9000.0, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(-0.25));
  CHECK_FALSE(slow.skip(Attempt::sample));
  for (int i = 0; i < 2; ++i) slow.note(Attempt::sample, false, 9000.0, 1000);
  CHECK(slow.skip(Attempt::sample));
  slow.note(Attempt::sample, true, 3e4, 1000);
  CHECK(slow.balance(Attempt::sample) == Approx(-0.25));
  CHECK_FALSE(slow.skip(Attempt::sample));
  // Untimed misses (before any scan was timed) cost 1/16 of a scan each: 8 spend the credit (and are 8 in a row).
  detail::PlannerCalibration fresh;
  for (int i = 0; i < 7; ++i) fresh.note(Attempt::estimate_walk, false, 1e9, 1000);
  CHECK_FALSE(fresh.skip(Attempt::estimate_walk));
  CHECK(fresh.balance(Attempt::estimate_walk) == Approx(0.5 - 7.0 / 16));
  // Timed misses (the scan timed now) wasting whole scans cost half a scan each; an untimed answer (ns 0,
  // the scan timed or not) ends the skipping as a timed one does, and saves nothing.
  fresh.note_scan(1e4, 1000);
  for (int i = 0; i < 2; ++i) fresh.note(Attempt::estimate_walk, false, 1e4, 1000);
  CHECK(fresh.balance(Attempt::estimate_walk) == Approx(-0.5));
  CHECK(fresh.skip(Attempt::estimate_walk));
  fresh.note(Attempt::estimate_walk, true, 0.0, 1000);
  CHECK(fresh.balance(Attempt::estimate_walk) == Approx(-0.25));
  CHECK_FALSE(fresh.skip(Attempt::estimate_walk));
  fresh.note(Attempt::estimate_walk, false, 0.0, 1000);  // (an untimed miss after the scan was timed: 1/16)
  CHECK(fresh.balance(Attempt::estimate_walk) == Approx(-0.25 - 1.0 / 16));
}
