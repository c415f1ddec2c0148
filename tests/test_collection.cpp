// Collection semantics: storage, upsert/remove, cosine, scales, soft -> hard, batches, on every kernel path.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>

#include "id_map.hpp"
#include "reference.hpp"
#include "kernel_paths.hpp"
#include "simd/scan_tuning.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

using test::ForcedPath;
using test::any_path;

// A collection with n random entries and, for reference checks, copies of what was stored.
struct Filled {
  Collection c;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> ids;
  Filled(std::size_t n, std::size_t d, std::size_t dv, Metric metric = Metric::dot, std::uint64_t seed = 1)
      : c(CollectionConfig{d, dv, metric, {}}), keys(test::normal_floats(n * d, seed)),
        values(test::normal_floats(n * dv, seed + 1)) {
    ids = c.add_batch(keys, values);
  }
};

}  // namespace

TEST_CASE("add assigns increasing ids and get returns what was stored", "[collection]") {
  Collection c({4, 2, Metric::dot, {}});
  CHECK(c.size() == 0);
  const std::vector<float> k1 = {1, 2, 3, 4}, v1 = {5, 6};
  const std::vector<float> k2 = {0, 0, 0, 1}, v2 = {7, 8};
  const auto id1 = c.add(k1, v1);
  const auto id2 = c.add(k2, v2);
  CHECK(id2 == id1 + 1);
  CHECK(c.size() == 2);
  CHECK(c.contains(id1));
  CHECK_FALSE(c.contains(id2 + 1));
  const Entry e = c.get(id1);
  CHECK(e.id == id1);
  CHECK(e.key == k1);
  CHECK(e.value == v1);
  // Batch ids continue after the largest id ever used, including upserted ones.
  c.upsert(100, k1, v1);
  const auto more = c.add_batch(std::vector<float>(8, 1.0f), std::vector<float>(4, 1.0f));
  CHECK(more == std::vector<std::uint64_t>{101, 102});
  c.remove(id1);
  CHECK(c.size_hint() == c.size());  // the lock-free count follows every write
  CHECK(c.size() == 4);
}

TEST_CASE("upsert replaces by id and the old value never contributes", "[collection]") {
  Collection c({2, 1, Metric::dot, {}});
  c.upsert(7, std::vector<float>{1, 0}, std::vector<float>{10});
  c.upsert(8, std::vector<float>{0, 1}, std::vector<float>{20});
  c.upsert(7, std::vector<float>{0, 1}, std::vector<float>{30});  // same key as 8 now
  CHECK(c.size() == 2);
  CHECK(c.get(7).value == std::vector<float>{30});
  const SoftResult r = c.query_soft(std::vector<float>{1, 0});
  // Both keys are (0, 1) now: equal weights, so the blend is exactly (20 + 30) / 2.
  CHECK(r.value[0] == Approx(25.0f).epsilon(1e-6));
  CHECK(r.candidates == 2);
}

TEST_CASE("a removed id never contributes and its slot is reused correctly", "[collection]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  Filled f(300, 16, 3);
  const auto q = test::normal_floats(16, 42);
  // Remove the current best match and 100 others; the answer must equal the reference over the rest.
  const auto best = f.c.query_hard(q).id;
  std::vector<bool> removed(300, false);
  f.c.remove(best);
  removed[best] = true;
  for (std::uint64_t id = 0; id < 300; id += 3)
    if (!removed[id]) f.c.remove(id), removed[id] = true;
  std::vector<float> keys, values;
  for (std::uint64_t id = 0; id < 300; ++id) {
    if (removed[id]) {
      CHECK_FALSE(f.c.contains(id));
      continue;
    }
    keys.insert(keys.end(), f.keys.begin() + id * 16, f.keys.begin() + (id + 1) * 16);
    values.insert(values.end(), f.values.begin() + id * 3, f.values.begin() + (id + 1) * 3);
    CHECK(f.c.get(id).value == std::vector<float>(f.values.begin() + id * 3, f.values.begin() + (id + 1) * 3));
  }
  const std::size_t n = keys.size() / 16;
  REQUIRE(f.c.size() == n);
  const auto ref = test::soft_reference(q.data(), keys.data(), values.data(), n, 16, 3, 0.25);
  const SoftResult r = f.c.query_soft(q, {.top_m = 300});
  CHECK(test::max_abs_diff(r.value, ref.value) <= 1e-5);
  CHECK(r.top.size() == n);
  for (const Contributor& t : r.top) CHECK_FALSE(removed[t.id]);
  CHECK(f.c.query_hard(q).id != best);
}

TEST_CASE("soft query matches the double reference, contributors included", "[collection]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  const std::size_t n = 3000, d = 128, dv = 64;  // large enough to split over threads
  Filled f(n, d, dv);
  const auto q = test::normal_floats(d, 5);
  for (const float t : {0.5f, 1.0f, 4.0f}) {
    INFO("path " << path << ", T = " << t);
    const double scale = 1.0 / (std::sqrt(static_cast<double>(d)) * t);
    const auto ref = test::soft_reference(q.data(), f.keys.data(), f.values.data(), n, d, dv, scale);
    const SoftResult r = f.c.query_soft(q, {.temperature = t, .top_m = 5});
    CHECK(test::max_abs_diff(r.value, ref.value) <= 1e-4 * test::max_abs(f.values));
    CHECK(r.lse == Approx(ref.lse).epsilon(1e-5));
    CHECK(r.max_score == Approx(ref.max_score).epsilon(1e-5));
    // Contributors: the five largest reference weights, in order, with matching weights and scores.
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 5, order.end(),
                      [&](std::size_t a, std::size_t b) { return ref.scores[a] > ref.scores[b]; });
    REQUIRE(r.top.size() == 5);
    for (std::size_t i = 0; i < 5; ++i) {
      CHECK(r.top[i].id == f.ids[order[i]]);
      CHECK(r.top[i].weight == Approx(ref.weights[order[i]]).epsilon(1e-4));
      CHECK(r.top[i].score == Approx(ref.scores[order[i]]).epsilon(1e-5));
    }
  }
}

TEST_CASE("an explicit scale, a default scale and a temperature agree", "[collection]") {
  Filled f(200, 9, 2);
  const auto q = test::normal_floats(9, 8);
  const SoftResult by_t = f.c.query_soft(q, {.temperature = 0.5f});
  const SoftResult by_scale = f.c.query_soft(q, {.scale = 1.0f / (3.0f * 0.5f)});
  CHECK(by_t.value == by_scale.value);
  CHECK(f.c.resolve_scale({}) == Approx(1.0 / 3.0));
  Collection with_default({9, 2, Metric::dot, 2.0f / 3.0f});
  with_default.add_batch(f.keys, f.values);
  CHECK(with_default.query_soft(q).value == by_t.value);
}

TEST_CASE("soft retrieval converges to hard retrieval as T -> 0", "[collection]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  Filled f(500, 32, 4);
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    const auto q = test::normal_floats(32, 100 + seed);
    const HardResult hard = f.c.query_hard(q);
    const SoftResult soft = f.c.query_soft(q, {.temperature = 1e-4f, .top_m = 1});
    CHECK(soft.top[0].id == hard.id);
    CHECK(soft.top[0].weight == Approx(1.0f));
    CHECK(test::max_abs_diff(soft.value, hard.value) <= 1e-5);
    // The hard score is scaled like soft scores: it is the soft maximum.
    const SoftResult soft_t1 = f.c.query_soft(q);
    CHECK(f.c.query_hard(q).score == soft_t1.max_score);
    // The winner's weight grows monotonically as T falls, and bounds the distance to the hard answer.
    double prev_weight = 0;
    for (const float t : {4.0f, 1.0f, 0.25f, 0.05f, 0.01f}) {
      const SoftResult r = f.c.query_soft(q, {.temperature = t, .top_m = 1});
      REQUIRE(r.top[0].id == hard.id);
      CHECK(r.top[0].weight >= prev_weight);
      CHECK(test::max_abs_diff(r.value, hard.value) <= 2.0 * (1.0 - r.top[0].weight) * test::max_abs(f.values) + 1e-5);
      prev_weight = r.top[0].weight;
    }
  }
}

TEST_CASE("hard retrieval returns the smallest id among tied keys", "[collection]") {
  Collection c({3, 1, Metric::dot, {}});
  const std::vector<float> best = {1, 1, 0}, other = {0, 1, 0};
  c.upsert(50, best, std::vector<float>{50});
  c.upsert(9, other, std::vector<float>{9});
  c.upsert(20, best, std::vector<float>{20});
  c.upsert(70, best, std::vector<float>{70});
  const auto q = std::vector<float>{1, 0.5f, 0};
  CHECK(c.query_hard(q).id == 20);
  c.remove(20);
  CHECK(c.query_hard(q).id == 50);
  const HardBatchResult batch = c.query_hard_batch(q);
  CHECK(batch.ids == std::vector<std::uint64_t>{50});
}

TEST_CASE("cosine collections normalise keys at insert and queries at query time", "[collection]") {
  Collection c({3, 1, Metric::cosine, {}});
  const auto id_small = c.add(std::vector<float>{1, 0.1f, 0}, std::vector<float>{1});
  c.add(std::vector<float>{100, 90, 0}, std::vector<float>{2});  // long, but a wider angle
  const Entry e = c.get(id_small);
  double norm = 0;
  for (float x : e.key) norm += static_cast<double>(x) * x;
  CHECK(norm == Approx(1.0).epsilon(1e-6));
  // By dot product the long key wins; by angle the short one does, whatever the query's length.
  CHECK(c.query_hard(std::vector<float>{1000, 0, 0}).id == id_small);
  const HardResult h = c.query_hard(std::vector<float>{0.001f, 0, 0});
  CHECK(h.id == id_small);
  CHECK(h.score == Approx(e.key[0] / std::sqrt(3.0f)));
  Collection dot({3, 1, Metric::dot, {}});
  dot.add(std::vector<float>{1, 0.1f, 0}, std::vector<float>{1});
  const auto id_long = dot.add(std::vector<float>{100, 90, 0}, std::vector<float>{2});
  CHECK(dot.query_hard(std::vector<float>{1000, 0, 0}).id == id_long);
}

TEST_CASE("batched queries equal looped single queries", "[collection]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  const std::size_t d = 24, dv = 6, nq = 70;
  Filled f(2500, d, dv);
  const auto qs = test::normal_floats(nq * d, 17);
  const SoftBatchResult soft = f.c.query_soft_batch(qs, {.temperature = 0.7f});
  const HardBatchResult hard = f.c.query_hard_batch(qs);
  REQUIRE(soft.values.size() == nq * dv);
  for (std::size_t b = 0; b < nq; ++b) {
    const std::span<const float> q(qs.data() + b * d, d);
    const SoftResult one = f.c.query_soft(q, {.temperature = 0.7f});
    CHECK(soft.lse[b] == Approx(one.lse).epsilon(1e-5));
    CHECK(soft.max_score[b] == Approx(one.max_score).epsilon(1e-5));
    for (std::size_t j = 0; j < dv; ++j) CHECK(soft.values[b * dv + j] == Approx(one.value[j]).margin(1e-5));
    const HardResult h = f.c.query_hard(q);
    CHECK(hard.ids[b] == h.id);
    CHECK(hard.scores[b] == Approx(h.score).epsilon(1e-5));
    CHECK(std::vector<float>(hard.values.begin() + b * dv, hard.values.begin() + (b + 1) * dv) == h.value);
  }
}

TEST_CASE("a collection can be moved", "[collection]") {
  Filled f(10, 4, 2);
  Collection moved = std::move(f.c);
  CHECK(moved.size() == 10);
  CHECK(moved.get(3).value == std::vector<float>(f.values.begin() + 6, f.values.begin() + 8));
}

// Storage grows geometrically. Reserving exactly size + n per batch once copied the whole collection
// on every write: 20,000 one-row adds at 1 KiB a row then copy ~200 GB (minutes); grown
// geometrically they copy ~40 MB. The bound is 100x what the linear cost takes on a loaded machine.
TEST_CASE("many small writes cost linear time: storage grows geometrically, at every precision", "[collection][timing]") {
  for (const Precision p : {Precision::f32, Precision::f16}) {
    CollectionConfig config{128, 128, Metric::dot, {}, {}};
    config.key_precision = p;
    config.value_precision = p;
    Collection c(config);
    const std::vector<float> key(128, 0.5f), value(128, 0.25f);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20000; ++i) (void)c.add(key, value);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(c.size() == 20000);
    CHECK(seconds < 10.0);
  }
}

TEST_CASE("tune_scans keeps one of its candidate prefetch settings and changes no answer", "[kernels]") {
  const std::size_t n = 20000, d = 128, dv = 8;
  Collection c({d, dv});
  c.add_batch(test::normal_floats(n * d, 71), test::normal_floats(n * dv, 72));
  const auto q = test::normal_floats(d, 73);
  const SoftResult soft_before = c.query_soft(q);
  const HardResult hard_before = c.query_hard(q);
  const std::string chose = tune_scans();
  INFO(chose);
  CHECK(chose.find("key stream prefetched") == 0);
  const std::string now = scan_tuning();
  const bool known_ahead = now.find(" 2048 bytes ahead") != std::string::npos || now.find(" 4096 bytes ahead") != std::string::npos ||
                           now.find(" 8192 bytes ahead") != std::string::npos;
  CHECK(known_ahead);
  const bool known_stride = now.find("rows of 256 bytes") != std::string::npos || now.find("rows of 1024 bytes") != std::string::npos ||
                            now.find("every line of every key row") != std::string::npos;
  CHECK(known_stride);
  const SoftResult soft_after = c.query_soft(q);
  CHECK(soft_after.value == soft_before.value);  // bit for bit: prefetching moves no arithmetic
  CHECK(soft_after.lse == soft_before.lse);
  CHECK(c.query_hard(q).id == hard_before.id);
}

TEST_CASE("the key-stream prefetch stride changes no answer, at every precision and row size", "[kernels]") {
  // Each CPU vendor starts with its own stride (scan_tuning.hpp): page apart from 256-byte rows on AMD, every
  // line elsewhere. Both must give the same bits, for rows below, at and above the 256-byte threshold.
  detail::scan::ScanTuning& t = detail::scan::tuning();
  const std::uint32_t before = t.page_stride_from;
  for (const std::size_t d : {32, 64, 128, 512})
    for (const Precision p : {Precision::f32, Precision::f16, Precision::bf16, Precision::i8}) {
      CollectionConfig config{d, 16};
      config.key_precision = p;
      Collection c(config);
      const std::size_t n = 3000;
      c.add_batch(test::normal_floats(n * d, 81), test::normal_floats(n * 16, 82));
      const auto q = test::normal_floats(d, 83);
      t.page_stride_from = 256;
      const SoftResult soft_page = c.query_soft(q);
      const HardResult hard_page = c.query_hard(q);
      t.page_stride_from = detail::scan::kEveryLine;
      const SoftResult soft_line = c.query_soft(q);
      INFO("d = " << d << ", key precision " << static_cast<int>(p));
      CHECK(soft_line.value == soft_page.value);
      CHECK(soft_line.lse == soft_page.lse);
      CHECK(c.query_hard(q).id == hard_page.id);
    }
  t.page_stride_from = before;
}

TEST_CASE("the id map agrees with a reference map through inserts, overwrites and erases of every id pattern", "[collection][ids]") {
  // Consecutive ids, ids that share their low bits (multiples of 2^20), ids near 2^64 - 2 and random ids,
  // mixed: runs of colliding homes are where a backward-shift erase can lose an id.
  std::mt19937_64 rng(77);
  for (int pattern = 0; pattern < 4; ++pattern) {
    detail::IdMap map;
    std::unordered_map<std::uint64_t, std::uint64_t> reference;
    const auto id_at = [&](std::uint64_t i) -> std::uint64_t {
      switch (pattern) {
        case 0: return i;
        case 1: return i << 20;
        case 2: return kReservedId - 1 - i;
        default: return rng() % 3 == 0 ? i : rng() >> (rng() % 64);
      }
    };
    std::size_t wrong = 0;  // emplace / erase results unlike the reference's
    for (std::size_t step = 0; step < 60000; ++step) {
      const std::uint64_t id = id_at(rng() % 5000);
      if (id == kReservedId) continue;
      const std::uint64_t row = rng();
      switch (rng() % 4) {
        case 0: wrong += map.emplace(id, row) != reference.emplace(id, row).second; break;
        case 1: map.set(id, row), reference[id] = row; break;
        default: wrong += map.erase(id) != (reference.erase(id) == 1); break;
      }
      if (step % 997 == 0) map.reserve(map.size() + rng() % 3000);  // rehashes at times, mid-stream
    }
    INFO("pattern " << pattern << ", " << reference.size() << " ids");
    CHECK(wrong == 0);
    REQUIRE(map.size() == reference.size());
    std::size_t mismatched = 0;
    for (const auto& [id, row] : reference) {
      const std::uint64_t* got = map.find(id);
      if (got == nullptr || *got != row) ++mismatched;
    }
    CHECK(mismatched == 0);
    std::size_t extra = 0;  // ids the map holds and the reference does not
    for (std::uint64_t i = 0; i < 5000; ++i) {
      const std::uint64_t id = id_at(i);
      if (id != kReservedId && map.contains(id) != reference.contains(id)) ++extra;
    }
    CHECK(extra == 0);
    // kReservedId (the empty slots' mark) is never held, found or erased.
    CHECK_FALSE(map.contains(kReservedId));
    CHECK_FALSE(map.erase(kReservedId));
    CHECK_FALSE(map.emplace(kReservedId, 1));
    CHECK(map.size() == reference.size());
  }
}
