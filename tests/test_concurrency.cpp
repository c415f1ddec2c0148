// Queries from several threads while another thread writes: no crash, every answer from some real state.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
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
