// HNSW, IVF and automatic indexes: recall, consistency with writes across rebuilds, untrained fallback.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <set>
#include <thread>

#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

// n points around n / per_cluster centres (spread 10, noise 0.5).
std::vector<float> clustered(std::size_t n, std::size_t d, std::size_t per_cluster, std::uint64_t seed) {
  const std::size_t clusters = std::max<std::size_t>(1, n / per_cluster);
  const auto centres = test::normal_floats(clusters * d, seed, 10.0f);
  auto keys = test::normal_floats(n * d, seed + 1, 0.5f);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) keys[i * d + j] += centres[(i % clusters) * d + j];
  return keys;
}

// Ids (= row numbers: entries were added in order from id 0) of the k best keys, exactly.
std::set<std::uint64_t> true_top_k(const std::vector<float>& keys, std::size_t d, const std::vector<float>& q, std::size_t k) {
  const std::size_t n = keys.size() / d;
  std::vector<double> s(n);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) s[i] += static_cast<double>(q[j]) * keys[i * d + j];
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](std::size_t a, std::size_t b) { return s[a] > s[b]; });
  return {order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k)};
}

std::vector<float> row(const std::vector<float>& m, std::size_t d, std::size_t i) {
  return {m.begin() + static_cast<std::ptrdiff_t>(i * d), m.begin() + static_cast<std::ptrdiff_t>((i + 1) * d)};
}

CollectionConfig config_for(IndexKind kind, std::size_t d, std::size_t dv) {
  CollectionConfig c{d, dv, Metric::dot, {}, {}};
  c.index.kind = kind;
  c.index.ivf_train_size = 500;   // small collections in tests
  c.index.auto_threshold = 1000;
  c.index.hnsw_ef_construction = 40;
  return c;
}

}  // namespace

TEST_CASE("HNSW recall@32 is at least 0.95 on clustered data at the default efSearch", "[indexes]") {
  const std::size_t n = 20000, d = 32;
  const auto keys = clustered(n, d, 200, 1);
  CollectionConfig config = config_for(IndexKind::hnsw, d, 1);
  config.index.ivf_train_size = ConfigLimits::kMaxIvfTrainSize;  // its certified lists never train: the graph answers soft queries
  Collection c(config);
  c.add_batch(keys, std::vector<float>(n, 1.0f));
  c.wait_until_indexed();
  double hits = 0;
  const std::size_t queries = 50;
  for (std::uint64_t i = 0; i < queries; ++i) {
    auto q = test::normal_floats(d, 100 + i, 0.5f);
    const auto near = row(keys, d, i * 397 % n);
    for (std::size_t j = 0; j < d; ++j) q[j] += near[j];
    const SoftResult r = c.query_soft(q, {.top_m = 32, .top_k = 32});
    CHECK(r.searched_with == IndexKind::hnsw);
    CHECK_FALSE(r.tail_bound_guaranteed);
    const auto truth = true_top_k(keys, d, q, 32);
    for (const Contributor& x : r.top) hits += truth.count(x.id);
  }
  const double recall = hits / (32.0 * queries);
  INFO("recall@32 = " << recall);
  CHECK(recall >= 0.95);
}

TEST_CASE("removed and replaced ids never appear, before and after a rebuild, for every index", "[indexes]") {
  const std::size_t n = 3000, d = 16, dv = 2;
  for (const IndexKind kind : {IndexKind::flat, IndexKind::hnsw, IndexKind::ivf, IndexKind::automatic}) {
    INFO("index kind " << static_cast<int>(kind));
    const auto keys = clustered(n, d, 100, 7);
    Collection c(config_for(kind, d, dv));
    c.add_batch(keys, std::vector<float>(n * dv, 1.0f));
    c.wait_until_indexed();
    std::set<std::uint64_t> gone;
    // Queries near entries 0..7: take their candidates, remove half, replace the other half with a zero
    // key (score 0, far below any cluster member's) and value 1e6. Then remove enough more to force a
    // rebuild and look again.
    for (int round = 0; round < 2; ++round) {
      for (std::size_t i = 0; i < 8; ++i) {
        const auto q = row(keys, d, i);
        const SoftResult r = c.query_soft(q, {.top_m = 20, .top_k = 20, .nprobe = 64});
        // (hnsw: the certified lists beside the graph answer unmasked soft queries)
        CHECK(r.searched_with == (kind == IndexKind::flat ? kind : IndexKind::ivf));
        for (std::size_t j = 0; j < r.top.size(); ++j) {
          const std::uint64_t id = r.top[j].id;
          if (gone.count(id)) continue;
          if (j % 2 == 0) {
            c.remove(id);
          } else {
            c.upsert(id, std::vector<float>(d, 0.0f), std::vector<float>{1e6f, 1e6f});
          }
          gone.insert(id);
        }
      }
      for (std::size_t i = 0; i < 8; ++i) {
        const auto q = row(keys, d, i);
        const SoftResult r = c.query_soft(q, {.top_m = 20, .top_k = 20, .nprobe = 64});
        for (const Contributor& x : r.top) CHECK(gone.count(x.id) == 0);
        CHECK(r.value[0] < 10.0f);  // no 1e6 value blended in
        const HardResult h = c.query_hard(q, {.nprobe = 64});
        CHECK(gone.count(h.id) == 0);
        const SoftResult adaptive = c.query_soft(q, {.top_m = 5, .epsilon = 0.05f, .nprobe = 64});
        for (const Contributor& x : adaptive.top) CHECK(gone.count(x.id) == 0);
        const SoftResult masked = c.query_soft(q, {.top_m = 20, .top_k = 20, .nprobe = 64, .exclude_ids = {n + 1}});
        for (const Contributor& x : masked.top) CHECK(gone.count(x.id) == 0);
      }
      if (round == 0) {  // past rebuild_fraction (0.25) of dead entries: a rebuild starts in the background,
        for (std::uint64_t id = 1000; id < 2000; ++id)  // and round 1 queries while it may still run
          if (!gone.count(id)) c.remove(id), gone.insert(id);
      }
    }
  }
}

TEST_CASE("IVF before training falls back to the exact scan and says so", "[indexes]") {
  const std::size_t d = 8;
  const auto keys = clustered(800, d, 50, 3);
  for (const IndexKind kind : {IndexKind::ivf, IndexKind::automatic}) {
    Collection c(config_for(kind, d, 1));
    const std::size_t threshold = kind == IndexKind::ivf ? 500 : 1000;
    c.add_batch(std::span<const float>(keys.data(), 400 * d), std::vector<float>(400, 1.0f));
    const auto q = row(keys, d, 5);
    SoftResult r = c.query_soft(q, {.top_k = 10});
    CHECK(r.searched_with == IndexKind::exact);
    CHECK(r.candidates == 400);
    CHECK(r.tail_bound == 0.0);
    CHECK(c.query_hard(q).searched_with == IndexKind::exact);
    // Grow past the training threshold: the index trains (in the background) and answers from then on.
    for (std::size_t i = 400; i < 800; ++i) c.add(row(keys, d, i), std::vector<float>{1.0f});
    c.wait_until_indexed();
    r = c.query_soft(q, {.top_k = 10});
    CHECK(r.searched_with == (c.size() >= threshold ? IndexKind::ivf : IndexKind::exact));
    if (kind == IndexKind::ivf) {
      CHECK(r.candidates == 10);
      CHECK(c.query_hard(q).searched_with == IndexKind::ivf);
    }
  }
}

TEST_CASE("hard retrieval goes through an approximate index unless the query asks for the scan", "[indexes]") {
  const std::size_t n = 5000, d = 16;
  const auto keys = clustered(n, d, 100, 11);
  Collection c(config_for(IndexKind::hnsw, d, 1));
  std::vector<float> values(n);
  std::iota(values.begin(), values.end(), 0.0f);
  c.add_batch(keys, values);
  c.wait_until_indexed();
  std::size_t agree = 0;
  for (std::uint64_t i = 0; i < 40; ++i) {
    const auto q = row(keys, d, i * 97 % n);
    const HardResult via_index = c.query_hard(q);
    const HardResult scanned = c.query_hard(q, {.exact = true});
    CHECK(via_index.searched_with == IndexKind::hnsw);
    CHECK(scanned.searched_with == IndexKind::exact);
    CHECK(via_index.value[0] == static_cast<float>(via_index.id));  // a whole, live entry
    CHECK(via_index.score <= scanned.score);                         // never better than the true best
    agree += via_index.id == scanned.id;
  }
  CHECK(agree >= 38);
}

TEST_CASE("pruned queries stay consistent while another thread writes", "[indexes][concurrency]") {
  const std::size_t n = 4000, d = 16;
  const auto keys = clustered(n, d, 100, 13);
  for (const IndexKind kind : {IndexKind::hnsw, IndexKind::ivf}) {
    Collection c(config_for(kind, d, 2));
    for (std::uint64_t id = 0; id < n; ++id) c.upsert(id, row(keys, d, id), std::vector<float>{1.0f, static_cast<float>(id)});
    c.wait_until_indexed();
    std::atomic<bool> stop{false};
    std::atomic<std::size_t> failures{0}, rounds{0};
    std::thread reader([&] {
      for (std::uint64_t i = 0; !stop.load(); ++i) {
        const auto q = row(keys, d, i % n);
        const SoftResult s = c.query_soft(q, {.top_m = 4, .top_k = 16});
        const HardResult h = c.query_hard(q);
        if (std::fabs(s.value[0] - 1.0f) > 1e-4f) ++failures;        // weights sum to one
        if (h.value[1] != static_cast<float>(h.id)) ++failures;       // a whole row
        ++rounds;
      }
    });
    for (std::uint64_t i = 0; i < 3000; ++i) {
      const std::uint64_t id = (i * 7919) % n;
      if (i % 3 == 0 && c.contains(id)) c.remove(id);
      else c.upsert(id, row(keys, d, (id + i) % n), std::vector<float>{1.0f, static_cast<float>(id)});
    }
    stop = true;
    reader.join();
    INFO(rounds.load() << " reader rounds");
    CHECK(failures.load() == 0);
  }
}

TEST_CASE("queries are answered while an index builds, and writes during the build reach it", "[indexes][concurrency]") {
  const std::size_t n = 60000, d = 32;
  const auto keys = clustered(n, d, 60, 17);
  CollectionConfig config = config_for(IndexKind::ivf, d, 1);
  config.index.ivf_train_size = 0;  // the default: 39 * 16 entries
  Collection c(config);
  std::vector<float> values(n);
  std::iota(values.begin(), values.end(), 0.0f);
  c.add_batch(keys, values);  // returns at once; training and building run in the background
  std::size_t answered_while_building = 0;
  std::set<std::uint64_t> removed;
  for (std::uint64_t i = 0; c.index_building() && i < 200; ++i) {
    const auto q = row(keys, d, i * 31 % n);
    const SoftResult r = c.query_soft(q, {.top_m = 1, .top_k = 8});
    if (r.searched_with == IndexKind::exact) {  // before the swap: the scan, so the exact best
      CHECK(r.candidates == c.size());
      ++answered_while_building;
    }
    c.remove(i * 7);  // journaled for the index being built
    removed.insert(i * 7);
    auto far_ahead = row(keys, d, i * 7);  // 10x the removed key: the top match for a query near it
    for (float& x : far_ahead) x *= 10.0f;
    c.upsert(100000 + i, far_ahead, std::vector<float>{-1.0f});
  }
  c.wait_until_indexed();
  INFO(answered_while_building << " queries answered while the index was building");
  CHECK(answered_while_building > 0);
  CHECK_FALSE(c.index_building());
  for (std::uint64_t id : removed) {
    const auto q = row(keys, d, id);
    const SoftResult r = c.query_soft(q, {.top_m = 8, .top_k = 8, .nprobe = 64});
    CHECK(r.searched_with == IndexKind::ivf);
    for (const Contributor& x : r.top) CHECK(removed.count(x.id) == 0);
    CHECK(r.top.at(0).id == 100000 + id / 7);  // the upsert made during the build is in the new index
  }
}
