// Queries from several threads while another thread writes: no crash, every answer from some real state.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <thread>

#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

constexpr std::size_t kDim = 32;

// Every entry's value is (1, id, key[0]): any torn or half-written row breaks one of these identities.
std::vector<float> value_for(std::uint64_t id, const std::vector<float>& key) {
  return {1.0f, static_cast<float>(id), key[0]};
}

}  // namespace

TEST_CASE("concurrent queries while a writer adds, upserts and removes", "[concurrency]") {
  Collection c({kDim, 3, Metric::dot, {}});
  // Large enough that queries split over the pool, so worker threads read during writes too.
  for (std::uint64_t id = 0; id < 6000; ++id) {
    const auto key = test::normal_floats(kDim, id);
    c.upsert(id, key, value_for(id, key));
  }
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> queries{0}, failures{0};
  auto reader = [&](std::uint64_t seed) {
    std::size_t i = 0;
    while (!stop.load()) {
      const auto q = test::normal_floats(kDim * 4, seed * 1000003 + i++);
      const std::span<const float> one(q.data(), kDim);
      const SoftResult s = c.query_soft(one, {.top_m = 3, .threads = 2});
      const HardResult h = c.query_hard(one);
      const SoftBatchResult sb = c.query_soft_batch(q);
      // Weights sum to one: the blended first component is exactly the constant 1.
      if (std::fabs(s.value[0] - 1.0f) > 1e-4f) ++failures;
      for (std::size_t b = 0; b < 4; ++b)
        if (std::fabs(sb.values[b * 3] - 1.0f) > 1e-4f) ++failures;
      // The hard answer is one whole row: its value names its own id.
      if (h.value[0] != 1.0f || h.value[1] != static_cast<float>(h.id)) ++failures;
      for (const Contributor& t : s.top)
        if (!(t.weight >= 0.0f && t.weight <= 1.0f)) ++failures;
      ++queries;
    }
  };
  std::vector<std::thread> readers;
  for (std::uint64_t t = 0; t < 3; ++t) readers.emplace_back(reader, t + 1);

  std::size_t writes = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  for (std::uint64_t i = 0; std::chrono::steady_clock::now() < until || writes < 200; ++i) {
    const std::uint64_t id = i % 6000;
    const auto key = test::normal_floats(kDim, 7000000 + i);
    if (i % 3 == 0 && c.contains(id) && c.size() > 1) {
      c.remove(id);
    } else {
      c.upsert(id, key, value_for(id, key));
    }
    if (i % 50 == 0) {  // a batch of fresh ids through the batch path
      const auto keys = test::normal_floats(kDim * 8, i);
      std::vector<std::uint64_t> ids;
      std::vector<float> values;
      for (std::size_t r = 0; r < 8; ++r) {
        ids.push_back(6000 + i + r);
        const auto v = value_for(ids.back(), std::vector<float>(keys.begin() + r * kDim, keys.end()));
        values.insert(values.end(), v.begin(), v.end());
      }
      c.upsert_batch(ids, keys, values);
    }
    ++writes;
  }
  stop = true;
  for (std::thread& t : readers) t.join();
  INFO(queries.load() << " query rounds, " << writes << " write rounds");
  CHECK(queries.load() > 0);
  CHECK(failures.load() == 0);
}

TEST_CASE("stress: 8 threads of mixed queries, upserts and removes, then a consistency check", "[concurrency][stress]") {
  for (const IndexKind kind : {IndexKind::exact, IndexKind::ivf}) {
    CollectionConfig config{kDim, 3, Metric::dot, {}, {}};
    config.index.kind = kind;
    config.index.ivf_train_size = 300;  // trains, then rebuilds, while the threads run
    Collection c(config);
    for (std::uint64_t id = 0; id < 400; ++id) {  // a shared, never-touched base so queries always have entries
      const auto key = test::normal_floats(kDim, id);
      c.upsert(1000000 + id, key, value_for(1000000 + id, key));
    }
    constexpr int kThreads = 8;
    std::vector<std::map<std::uint64_t, std::uint64_t>> model(kThreads);  // id -> seed of its current key
    std::atomic<std::size_t> failures{0}, operations{0};
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(t + 1);
        auto& mine = model[t];
        while (std::chrono::steady_clock::now() < until) {
          const std::uint64_t id = std::uint64_t(t) * 1000 + rng() % 200;  // each thread owns its id range
          switch (rng() % 10) {
            case 0: case 1: case 2: case 3: {
              const auto q = test::normal_floats(kDim, rng());
              const SoftResult s = c.query_soft(q, kind == IndexKind::exact ? QueryOptions{.top_m = 2} : QueryOptions{.top_m = 2, .top_k = 16});
              if (std::fabs(s.value[0] - 1.0f) > 1e-4f) ++failures;
              const HardResult h = c.query_hard(q);
              if (h.value[0] != 1.0f || h.value[1] != static_cast<float>(h.id)) ++failures;
              break;
            }
            case 4: case 5: case 6: {
              const std::uint64_t seed = rng();
              const auto key = test::normal_floats(kDim, seed);
              c.upsert(id, key, value_for(id, key));
              mine[id] = seed;
              break;
            }
            default:
              if (mine.erase(id)) c.remove(id);
          }
          ++operations;
        }
      });
    }
    for (auto& th : threads) th.join();
    c.wait_until_indexed();
    // Every thread's ids hold exactly what that thread last wrote, and nothing else exists there.
    for (int t = 0; t < kThreads; ++t) {
      for (std::uint64_t id = std::uint64_t(t) * 1000; id < std::uint64_t(t) * 1000 + 200; ++id) {
        const auto it = model[t].find(id);
        REQUIRE(c.contains(id) == (it != model[t].end()));
        if (it == model[t].end()) continue;
        const auto key = test::normal_floats(kDim, it->second);
        CHECK(c.get(id).key == key);
        CHECK(c.get(id).value == value_for(id, key));
      }
    }
    std::size_t expected = 400;
    for (const auto& m : model) expected += m.size();
    CHECK(c.size() == expected);
    INFO(operations.load() << " operations");
    CHECK(failures.load() == 0);
  }
}
