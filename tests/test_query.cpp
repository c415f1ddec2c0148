// The one query entry point (Collection::query) and the batch-first index search: each answer equals
// the path it routes to, bit for bit, for every index kind and option that changes the route.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>

#include "index/pruning_index.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

CollectionConfig config_for(IndexKind kind, std::size_t d, std::size_t dv) {
  CollectionConfig c{d, dv, Metric::dot, {}, {}};
  c.index.kind = kind;
  c.index.ivf_train_size = 500;
  c.index.ivf_nlist = 8;
  c.index.auto_threshold = 500;
  c.index.hnsw_ef_construction = 40;
  return c;
}

void same(const SoftResult& a, const SoftResult& b) {
  CHECK(a.value == b.value);
  CHECK(a.lse == b.lse);
  CHECK(a.max_score == b.max_score);
  CHECK(a.candidates == b.candidates);
  CHECK(a.tail_bound == b.tail_bound);
  CHECK(a.tail_bound_guaranteed == b.tail_bound_guaranteed);
  CHECK(a.searched_with == b.searched_with);
  REQUIRE(a.top.size() == b.top.size());
  for (std::size_t i = 0; i < a.top.size(); ++i) {
    CHECK(a.top[i].id == b.top[i].id);
    CHECK(a.top[i].weight == b.top[i].weight);
    CHECK(a.top[i].score == b.top[i].score);
  }
}

void same(const HardResult& a, const HardResult& b) {
  CHECK(a.id == b.id);
  CHECK(a.score == b.score);
  CHECK(a.value == b.value);
  CHECK(a.searched_with == b.searched_with);
}

}  // namespace

TEST_CASE("query() answers each query as the path it picks, bit for bit", "[query]") {
  const std::size_t n = 1200, d = 12, dv = 5, nq = 7;
  const auto keys = test::normal_floats(n * d, 1);
  const auto values = test::normal_floats(n * dv, 2);
  const auto queries = test::normal_floats(nq * d, 3);
  auto row = [&](std::size_t i) { return std::span<const float>(queries).subspan(i * d, d); };
  for (IndexKind kind : {IndexKind::exact, IndexKind::flat, IndexKind::hnsw, IndexKind::ivf, IndexKind::automatic}) {
    INFO("index " << static_cast<int>(kind));
    Collection c(config_for(kind, d, dv));
    c.add_batch(keys, values);
    c.wait_until_indexed();
    for (std::size_t count : {std::size_t{1}, nq}) {
      const auto qs = std::span<const float>(queries).first(count * d);
      INFO("queries " << count);
      // Soft, no contributors or pruning: the fused batch kernel for n > 1.
      const QueryResults plain = c.query(qs, Retrieval::soft, {.temperature = 0.5f});
      REQUIRE(plain.soft.size() == count);
      CHECK(plain.hard.empty());
      if (count == 1) {
        same(plain.soft[0], c.query_soft(row(0), {.temperature = 0.5f}));
      } else {
        const SoftBatchResult b = c.query_soft_batch(qs, {.temperature = 0.5f});
        for (std::size_t i = 0; i < count; ++i) {
          CHECK(std::equal(plain.soft[i].value.begin(), plain.soft[i].value.end(), b.values.begin() + static_cast<std::ptrdiff_t>(i * dv)));
          CHECK(plain.soft[i].lse == b.lse[i]);
          CHECK(plain.soft[i].max_score == b.max_score[i]);
          CHECK(plain.soft[i].candidates == n);
          CHECK(plain.soft[i].tail_bound == 0.0);
          CHECK(plain.soft[i].top.empty());
        }
      }
      // Contributors, and pruning where there is an index: one query at a time.
      std::vector<QueryOptions> per_query = {{.top_m = 3}};
      if (kind != IndexKind::exact) {
        per_query.push_back({.top_k = 20});
        per_query.push_back({.epsilon = 0.2f});
      }
      for (const QueryOptions& o : per_query) {
        const QueryResults r = c.query(qs, Retrieval::soft, o);
        REQUIRE(r.soft.size() == count);
        for (std::size_t i = 0; i < count; ++i) same(r.soft[i], c.query_soft(row(i), o));
      }
      // Hard: the batch kernel, unless an approximate index answers (and the query does not ask for the scan).
      for (const bool exact : {false, true}) {
        const QueryResults r = c.query(qs, Retrieval::hard, {.exact = exact});
        REQUIRE(r.hard.size() == count);
        CHECK(r.soft.empty());
        const bool through_index = kind == IndexKind::hnsw || kind == IndexKind::ivf || kind == IndexKind::automatic;
        if (count == 1 || (through_index && !exact)) {
          for (std::size_t i = 0; i < count; ++i) same(r.hard[i], c.query_hard(row(i), {.exact = exact}));
        } else {
          const HardBatchResult b = c.query_hard_batch(qs, {.exact = exact});
          for (std::size_t i = 0; i < count; ++i) {
            CHECK(r.hard[i].id == b.ids[i]);
            CHECK(r.hard[i].score == b.scores[i]);
            CHECK(std::equal(r.hard[i].value.begin(), r.hard[i].value.end(), b.values.begin() + static_cast<std::ptrdiff_t>(i * dv)));
            CHECK(r.hard[i].searched_with == IndexKind::exact);
          }
        }
      }
    }
  }
}

TEST_CASE("query() refuses what the single paths refuse, with the first failing query's error", "[query][errors]") {
  Collection c({3, 1, Metric::dot, {}});
  auto code_of = [&](std::span<const float> qs, Retrieval kind, const QueryOptions& o) {
    try {
      (void)c.query(qs, kind, o);
    } catch (const Error& e) {
      return e.code();
    }
    FAIL("expected an error");
    return ErrorCode::internal;
  };
  for (Retrieval kind : {Retrieval::soft, Retrieval::hard}) {
    CHECK(code_of({}, kind, {}) == ErrorCode::dimension_mismatch);
    CHECK(code_of(std::vector<float>(4, 1.0f), kind, {}) == ErrorCode::dimension_mismatch);
    CHECK(code_of(std::vector<float>(6, 1.0f), kind, {}) == ErrorCode::empty_collection);
    c.add(std::vector<float>{1, 0, 0}, std::vector<float>{1});
    const std::vector<float> second_bad = {1, 0, 0, NAN, 0, 0};
    CHECK(code_of(second_bad, kind, {}) == ErrorCode::non_finite);
    CHECK(code_of(second_bad, kind, {.top_m = 2}) == ErrorCode::non_finite);
    CHECK(code_of(std::vector<float>(6, 1.0f), kind, {.temperature = -1.0f}) == ErrorCode::invalid_argument);
    c.remove(c.ids().front());
  }
}

TEST_CASE("index search takes n queries and answers each as a search of it alone", "[query][indexes]") {
  const std::size_t n = 1500, d = 10, nq = 9;
  const auto keys = test::normal_floats(n * d, 11);
  std::vector<std::uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 100);
  const detail::RowSpan all{keys.data(), nullptr, ids.data(), n, d, 0};
  const auto queries = test::normal_floats(nq * d, 12);
  const std::vector<float> scales(nq, 1.0f);
  for (IndexKind kind : {IndexKind::flat, IndexKind::hnsw, IndexKind::ivf}) {
    INFO("index " << static_cast<int>(kind));
    auto index = detail::make_pruning_index(config_for(kind, d, 1));
    index->put(ids, keys.data(), all);
    index->build_now(all);
    for (std::uint64_t dead = 100; dead < 400; dead += 3) index->erase(dead, all);  // positions to filter out
    REQUIRE(index->ready());
    const detail::IndexSearch p{.k = 25, .ef_search = 64, .nprobe = 4, .parts = 2};
    const auto batch = index->search(queries.data(), scales.data(), nq, all, p);
    REQUIRE(batch.size() == nq);
    for (std::size_t i = 0; i < nq; ++i) {
      auto one = index->search(queries.data() + i * d, scales.data() + i, 1, all, p).front();
      auto got = batch[i];
      CHECK(got.size() == 25);
      std::sort(one.begin(), one.end());
      std::sort(got.begin(), got.end());
      CHECK(got == one);
      if (kind != IndexKind::flat)  // flat searches the live storage; the others filter their tombstones
        for (std::uint64_t id : got) CHECK_FALSE((id >= 100 && id < 400 && (id - 100) % 3 == 0));
    }
  }
}
