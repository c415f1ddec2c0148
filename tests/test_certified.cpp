// The certified inverted lists (IndexKind::ivf): exact top-k, a guaranteed tail bound on every data regime,
// bounds kept through writes, snapshots and concurrent writers, and the planner's fallback to the exact scan.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <thread>

#include "reference.hpp"
#include "regimes.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {


// The true mass outside a result's candidates (top_m covers them all), in double, for keys given by id.
double true_omitted(const Collection& c, const std::vector<float>& q, double scale, const SoftResult& r) {
  const std::size_t d = c.config().dim;
  std::set<std::uint64_t> candidates;
  for (const Contributor& x : r.top) candidates.insert(x.id);
  REQUIRE(candidates.size() == r.candidates);
  double m = -INFINITY;
  std::vector<std::pair<double, bool>> s;
  for (std::uint64_t id : c.ids()) {
    const Entry e = c.get(id);
    double dot = 0;
    for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * e.key[j];
    s.emplace_back(scale * dot, candidates.count(id) == 0);
    m = std::max(m, s.back().first);
  }
  double all = 0, out = 0;
  for (const auto& [x, omitted] : s) {
    all += std::exp(x - m);
    if (omitted) out += std::exp(x - m);
  }
  return out / all;
}

std::set<std::uint64_t> ids_of(const SoftResult& r) {
  std::set<std::uint64_t> out;
  for (const Contributor& x : r.top) out.insert(x.id);
  return out;
}

CollectionConfig ivf_config(std::size_t d, std::size_t dv, std::size_t nlist = 0) {
  CollectionConfig config{d, dv, Metric::dot, {}, {}};
  config.index.kind = IndexKind::ivf;
  config.index.ivf_nlist = nlist;
  config.index.ivf_train_size = std::max<std::size_t>(500, nlist);
  return config;
}

std::vector<float> q_of(const std::vector<float>& qs, std::size_t b, std::size_t d) {
  return {qs.begin() + static_cast<std::ptrdiff_t>(b * d), qs.begin() + static_cast<std::ptrdiff_t>((b + 1) * d)};
}

constexpr std::size_t kAll = std::numeric_limits<std::size_t>::max();

// Every answer's true omitted mass is within its (guaranteed) bound; a top_k answer's candidates are the
// exact top-k (the flat index's, ties to the smaller id).
void check_answers(const Collection& c, const Collection& flat, const std::vector<float>& qs, std::size_t nq, float temperature) {
  const std::size_t d = c.config().dim;
  const double scale = c.resolve_scale({.temperature = temperature});
  for (std::size_t b = 0; b < nq; ++b) {
    const auto q = q_of(qs, b, d);
    for (const std::size_t k : {std::size_t{1}, std::size_t{7}, std::size_t{64}}) {
      const SoftResult r = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .top_k = k});
      const SoftResult f = flat.query_soft(q, {.temperature = temperature, .top_m = kAll, .top_k = k});
      INFO("query " << b << ", top_k " << k << ", T " << temperature);
      CHECK(r.tail_bound_guaranteed);
      CHECK(r.searched_with == IndexKind::ivf);
      CHECK(ids_of(r) == ids_of(f));
      CHECK(true_omitted(c, q, scale, r) <= r.tail_bound * (1 + 1e-6) + 1e-12);
    }
    for (const float eps : {0.2f, 1e-3f, 1e-7f}) {
      const SoftResult r = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .epsilon = eps});
      INFO("query " << b << ", epsilon " << eps << ", T " << temperature);
      CHECK(r.tail_bound_guaranteed);
      CHECK(r.tail_bound <= eps);
      CHECK(true_omitted(c, q, scale, r) <= r.tail_bound * (1 + 1e-6) + 1e-12);
    }
  }
}

}  // namespace

TEST_CASE("certified lists (ivf, and hnsw's beside its graph): the exact top-k and a guaranteed tail bound on every data regime", "[certified][pruning]") {
  // hnsw: its graph's own bound was an estimate that failed on out-of-distribution queries (regime 2: 8 and
  // 24 of 60 answers below the true omitted mass, docs/PRUNING.md); the lists kept beside it answer instead.
  const std::size_t n = 2000, d = 16, dv = 3, nq = 4;
  const int kind = GENERATE(0, 1, 2, 3);
  const IndexKind index = GENERATE(IndexKind::ivf, IndexKind::hnsw);
  const test::Regime regime = test::make_regime(kind, n, d, nq, (index == IndexKind::ivf ? 100 : 300) + static_cast<std::uint64_t>(kind));
  INFO(regime.name << ", index " << static_cast<int>(index));
  const auto values = test::normal_floats(n * dv, 7);
  CollectionConfig config = ivf_config(d, dv);
  if (index == IndexKind::hnsw) config.index = {.kind = IndexKind::hnsw, .hnsw_m = 8, .hnsw_ef_construction = 16};
  Collection c(config);
  c.add_batch(regime.keys, values);
  c.wait_until_indexed();
  CollectionConfig flat_config{d, dv, Metric::dot, {}, {.kind = IndexKind::flat}};
  Collection flat(flat_config);
  flat.add_batch(regime.keys, values);
  for (const float t : {0.1f, 1.0f}) check_answers(c, flat, regime.queries, nq, t);
  CHECK(c.query_hard(q_of(regime.queries, 0, d)).searched_with == index);  // hnsw: hard queries still go through the graph
}

TEST_CASE("certified lists: deep walks over hundreds of lists (cold ones warmed) stay exact and bounded", "[certified][pruning]") {
  // 20,000 rows in ~625 lists, small enough (under the planner's 1 MiB) to be walked to the end: spread
  // attention and tight epsilons visit most lists, the cold ones (16 nats below the top) included.
  const std::size_t n = 20000, d = 8, dv = 1, nq = 3;
  const int kind = GENERATE(0, 3);
  const test::Regime regime = test::make_regime(kind, n, d, nq, 500 + static_cast<std::uint64_t>(kind));
  INFO(regime.name);
  const auto values = test::normal_floats(n * dv, 11);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, values);
  c.wait_until_indexed();
  CollectionConfig flat_config{d, dv, Metric::dot, {}, {.kind = IndexKind::flat}};
  Collection flat(flat_config);
  flat.add_batch(regime.keys, values);
  check_answers(c, flat, regime.queries, nq, 1.0f);
  const SoftResult deep = c.query_soft(q_of(regime.queries, 0, d), {.temperature = 1.0f, .epsilon = 1e-7f});
  if (kind == 0) CHECK(deep.rows_scored > n / 2);  // spread: the walk really went past the first lists
}

TEST_CASE("certified lists split lists of several clusters when clusters are smaller than a list", "[certified][pruning]") {
  // 600 clusters of 10 rows in d = 32 (centres N(0, 1), noise 0.15: separate clusters), 6,000 rows in
  // ~187 lists of 32: the median list holds three clusters. Splitting by the median radius left them
  // (a probe: 28,000 rows in clusters of ~14 then read every row); by the 10th percentile each list is a
  // cluster, and a query near a key reads about its own cluster.
  const std::size_t clusters = 600, per = 10, n = clusters * per, d = 32, nq = 10;
  const auto centres = test::normal_floats(clusters * d, 61);
  std::vector<float> keys = test::normal_floats(n * d, 62, 0.15f);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) keys[i * d + j] += centres[(i * 7 % clusters) * d + j];
  Collection c(ivf_config(d, 1));
  c.add_batch(keys, std::vector<float>(n, 1.0f));
  c.wait_until_indexed();
  const auto noise = test::normal_floats(nq * d, 63, 0.05f);
  std::vector<std::size_t> rows;
  for (std::size_t b = 0; b < nq; ++b) {
    std::vector<float> q(keys.begin() + static_cast<std::ptrdiff_t>(b * 97 * d), keys.begin() + static_cast<std::ptrdiff_t>((b * 97 + 1) * d));
    for (std::size_t j = 0; j < d; ++j) q[j] += noise[b * d + j];
    const SoftResult r = c.query_soft(q, {.temperature = 0.1f, .top_k = 8});
    CHECK(r.searched_with == IndexKind::ivf);
    CHECK(r.tail_bound_guaranteed);
    rows.push_back(r.rows_scored);
  }
  std::sort(rows.begin(), rows.end());
  INFO("rows scored, median " << rows[nq / 2] << ", largest " << rows.back());
  CHECK(rows[nq / 2] <= 4 * per);
}

TEST_CASE("certified IVF: hard queries return the exact best key through the lists", "[certified][pruning]") {
  const std::size_t n = 3000, d = 12;
  const test::Regime regime = test::make_regime(1, n, d, 6, 5);
  Collection c(ivf_config(d, 1));
  c.add_batch(regime.keys, test::normal_floats(n, 3));
  c.wait_until_indexed();
  for (std::size_t b = 0; b < 6; ++b) {
    const auto q = q_of(regime.queries, b, d);
    const HardResult h = c.query_hard(q);
    CHECK(h.searched_with == IndexKind::ivf);
    CHECK(h.id == c.query_hard(q, {.exact = true}).id);
  }
}

TEST_CASE("certified IVF: bounds hold after adds far outside a list and upserts and removes and a snapshot", "[certified][pruning]") {
  const std::size_t n = 2500, d = 16, dv = 2;
  const test::Regime regime = test::make_regime(1, n, d, 4, 31);
  const auto values = test::normal_floats(n * dv, 32);
  Collection c(ivf_config(d, dv));
  CollectionConfig flat_config{d, dv, Metric::dot, {}, {.kind = IndexKind::flat}};
  Collection flat(flat_config);
  c.add_batch(regime.keys, values);
  flat.add_batch(regime.keys, values);
  c.wait_until_indexed();
  // Keys far outside every list (30x a stored key), replacements moved to other clusters, removals.
  for (std::uint64_t i = 0; i < 40; ++i) {
    std::vector<float> far(regime.keys.begin() + static_cast<std::ptrdiff_t>(i * 11 * d),
                           regime.keys.begin() + static_cast<std::ptrdiff_t>((i * 11 + 1) * d));
    for (float& x : far) x *= 30.0f;
    const std::vector<float> v{1.0f * static_cast<float>(i), -1.0f};
    c.upsert(10000 + i, far, v);
    flat.upsert(10000 + i, far, v);
    const auto moved = q_of(regime.keys, (i * 37 + 3) % n, d);
    c.upsert(i * 5, moved, v);
    flat.upsert(i * 5, moved, v);
    c.remove(i * 5 + 1);
    flat.remove(i * 5 + 1);
  }
  c.wait_until_indexed();
  // Queries at the far keys (their own single lists), and the regime's queries.
  std::vector<float> qs = regime.queries;
  for (std::uint64_t i = 0; i < 3; ++i) {
    const Entry e = c.get(10000 + i * 7);
    qs.insert(qs.end(), e.key.begin(), e.key.end());
    for (std::size_t j = qs.size() - d; j < qs.size(); ++j) qs[j] /= 30.0f;
  }
  check_answers(c, flat, qs, qs.size() / d, 0.5f);
  // A snapshot's image restores the lists (loaded, not rebuilt) and the same exact top-k, bit for bit.
  std::string note;
  const Collection restored = Collection::restore(c.image(), &note);
  CHECK(note == "loaded its index");
  for (std::size_t b = 0; b < qs.size() / d; ++b) {
    const auto q = q_of(qs, b, d);
    const SoftResult a = c.query_soft(q, {.top_m = 16, .top_k = 16});
    const SoftResult r = restored.query_soft(q, {.top_m = 16, .top_k = 16});
    CHECK(r.searched_with == IndexKind::ivf);
    CHECK(r.value == a.value);
    CHECK(ids_of(r) == ids_of(a));
  }
  check_answers(restored, flat, qs, qs.size() / d, 0.5f);
}

TEST_CASE("certified IVF: queries during concurrent writes see only live rows and stay exact afterwards", "[certified][concurrency]") {
  const std::size_t n = 3000, d = 8, dv = 1;
  const test::Regime regime = test::make_regime(2, n, d, 8, 41);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, test::normal_floats(n * dv, 42));
  c.wait_until_indexed();
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (std::uint64_t i = 0; i < 400; ++i) {
      auto key = q_of(regime.keys, (i * 17) % n, d);
      for (float& x : key) x *= 1.0f + static_cast<float>(i % 5);
      c.upsert(i, key, std::vector<float>{0.5f});
      if (i % 3 == 0) c.remove(n - 1 - i);
    }
    stop = true;
  });
  std::size_t answered = 0;
  while (!stop) {
    const auto q = q_of(regime.queries, answered % 8, d);
    const SoftResult r = c.query_soft(q, {.top_m = 5, .top_k = 5});
    CHECK(r.tail_bound_guaranteed);
    CHECK(r.candidates == 5);
    ++answered;
  }
  writer.join();
  c.wait_until_indexed();
  for (std::size_t b = 0; b < 8; ++b) {
    const auto q = q_of(regime.queries, b, d);
    // exact = true scans every row: its 10 heaviest contributors are the 10 best scores.
    CHECK(ids_of(c.query_soft(q, {.top_m = 10, .top_k = 10})) == ids_of(c.query_soft(q, {.top_m = 10, .exact = true})));
  }
}

TEST_CASE("certified IVF: answers during concurrent rewrites of the same rows stay within their bounds against the truth", "[certified][concurrency]") {
  // The writer upserts rows with the key and value they already hold (members leave their list and join
  // one again, lists widen), so the truth stays what it was: every answer given meanwhile is checked against it.
  const std::size_t n = 3000, d = 8, dv = 1, nq = 6;
  const test::Regime regime = test::make_regime(1, n, d, nq, 45);
  const auto values = test::normal_floats(n * dv, 46);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, values);
  c.wait_until_indexed();
  const float temperature = 0.5f;
  const double scale = c.resolve_scale({.temperature = temperature});
  // Each query's true scores by id (ids are 0..n-1 in add order), and its exact top 5 (ties to the smaller id).
  std::vector<std::vector<double>> truth(nq, std::vector<double>(n));
  std::vector<std::set<std::uint64_t>> top5(nq);
  for (std::size_t b = 0; b < nq; ++b) {
    std::vector<std::pair<double, std::uint64_t>> order;
    for (std::size_t i = 0; i < n; ++i) {
      double dot = 0;
      for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(regime.queries[b * d + j]) * regime.keys[i * d + j];
      truth[b][i] = scale * dot;
      order.emplace_back(-truth[b][i], i);
    }
    std::sort(order.begin(), order.end());
    for (std::size_t i = 0; i < 5; ++i) top5[b].insert(order[i].second);
  }
  const auto omitted = [&](std::size_t b, const SoftResult& r) {
    const std::set<std::uint64_t> kept = ids_of(r);
    const double m = *std::max_element(truth[b].begin(), truth[b].end());
    double all = 0, out = 0;
    for (std::size_t i = 0; i < n; ++i) {
      all += std::exp(truth[b][i] - m);
      if (kept.count(i) == 0) out += std::exp(truth[b][i] - m);
    }
    return out / all;
  };
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (std::size_t round = 0; round < 3; ++round)
      for (std::size_t i = 0; i < n; i += 7) c.upsert(i, q_of(regime.keys, i, d), std::vector<float>{values[i]});
    stop = true;
  });
  std::size_t answered = 0;
  while (!stop || answered < 2 * nq) {
    const std::size_t b = answered % nq;
    const auto q = q_of(regime.queries, b, d);
    const SoftResult k = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .top_k = 5});
    const SoftResult e = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .epsilon = 1e-4f});
    INFO("answer " << answered << ", query " << b);
    CHECK(k.tail_bound_guaranteed);
    CHECK(ids_of(k) == top5[b]);
    CHECK(omitted(b, k) <= k.tail_bound * (1 + 1e-6) + 1e-12);
    CHECK(e.tail_bound_guaranteed);
    CHECK(e.tail_bound <= 1e-4);
    CHECK(omitted(b, e) <= e.tail_bound * (1 + 1e-6) + 1e-12);
    ++answered;
  }
  writer.join();
  CHECK(answered >= 2 * nq);
}

TEST_CASE("certified IVF: tied keys give the exact top-k with ties to the smaller id", "[certified][pruning]") {
  // Every key three times (ids i, i + m, i + 2m): equal kernel scores, so a top-k cut inside a triple
  // must keep its smaller ids, as the flat index and the exact order do.
  const std::size_t m = 700, d = 8, dv = 1, nq = 5;
  const test::Regime regime = test::make_regime(1, m, d, nq, 47);
  std::vector<float> keys;
  for (int copy = 0; copy < 3; ++copy) keys.insert(keys.end(), regime.keys.begin(), regime.keys.end());
  const auto values = test::normal_floats(3 * m * dv, 48);
  Collection c(ivf_config(d, dv));
  c.add_batch(keys, values);
  c.wait_until_indexed();
  for (std::size_t b = 0; b < nq; ++b) {
    const auto q = q_of(regime.queries, b, d);
    std::vector<std::pair<double, std::uint64_t>> order;
    for (std::size_t i = 0; i < 3 * m; ++i) {
      double dot = 0;
      for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * keys[i * d + j];
      order.emplace_back(-dot, i);
    }
    std::sort(order.begin(), order.end());
    for (const std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
      const SoftResult r = c.query_soft(q, {.top_m = kAll, .top_k = k});
      std::set<std::uint64_t> expected;
      for (std::size_t i = 0; i < k; ++i) expected.insert(order[i].second);
      INFO("query " << b << ", top_k " << k);
      CHECK(r.searched_with == IndexKind::ivf);
      CHECK(ids_of(r) == expected);
      // The hard answer is the smallest id among the best key's copies.
      if (k == 1) CHECK(c.query_hard(q).id == order[0].second);
    }
  }
}

TEST_CASE("certified lists: random regimes, sizes, temperatures and options keep the top-k exact and the bound above the truth", "[certified][pruning]") {
  // 10 draws (fixed seed) of regime, n, d, nlist, temperature, top_k and epsilon; each answer against the
  // exact order and the true omitted mass in double.
  std::uint64_t state = 0x5eed;
  const auto next = [&](std::uint64_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % bound;
  };
  for (int draw = 0; draw < 10; ++draw) {
    const int kind = static_cast<int>(next(4));
    const std::size_t n = 600 + next(3400), d = 2 + next(31), dv = 1 + next(3), nq = 3;
    const std::size_t nlist = next(3) == 0 ? 1 + next(n / 4) : 0;
    const float temperature = static_cast<float>(std::pow(10.0, -1.5 + 2.0 * static_cast<double>(next(1000)) / 1000));
    const std::size_t top_k = 1 + next(std::min<std::size_t>(n, 200));
    const float eps = static_cast<float>(std::pow(10.0, -8.0 + 7.5 * static_cast<double>(next(1000)) / 1000));
    const test::Regime regime = test::make_regime(kind, n, d, nq, 600 + static_cast<std::uint64_t>(draw));
    Collection c(ivf_config(d, dv, nlist));
    c.add_batch(regime.keys, test::normal_floats(n * dv, 700 + static_cast<std::uint64_t>(draw)));
    c.wait_until_indexed();
    const double scale = c.resolve_scale({.temperature = temperature});
    for (std::size_t b = 0; b < nq; ++b) {
      const auto q = q_of(regime.queries, b, d);
      std::vector<std::pair<double, std::uint64_t>> order;
      for (std::size_t i = 0; i < n; ++i) {
        double dot = 0;
        for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * regime.keys[i * d + j];
        order.emplace_back(-dot, i);
      }
      std::sort(order.begin(), order.end());
      INFO("draw " << draw << ": " << regime.name << ", n " << n << ", d " << d << ", nlist " << nlist << ", T " << temperature << ", top_k "
                   << top_k << ", epsilon " << eps << ", query " << b);
      const SoftResult k = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .top_k = top_k});
      CHECK(k.searched_with == IndexKind::ivf);  // (collections this small are walked to the end, never scanned)
      CHECK(k.tail_bound_guaranteed);
      REQUIRE(k.top.size() == top_k);
      // The exact top-k by double score, unless the k-th and the next are within float rounding of each other.
      const bool clear_cut = top_k == n || order[top_k - 1].first + 1e-4 * (1 + std::fabs(order[top_k].first)) < order[top_k].first;
      if (clear_cut) {
        std::set<std::uint64_t> expected;
        for (std::size_t i = 0; i < top_k; ++i) expected.insert(order[i].second);
        CHECK(ids_of(k) == expected);
      }
      CHECK(true_omitted(c, q, scale, k) <= k.tail_bound * (1 + 1e-6) + 1e-12);
      const SoftResult e = c.query_soft(q, {.temperature = temperature, .top_m = kAll, .epsilon = eps});
      CHECK(e.tail_bound_guaranteed);
      CHECK(e.tail_bound <= eps);
      CHECK(true_omitted(c, q, scale, e) <= e.tail_bound * (1 + 1e-6) + 1e-12);
    }
  }
}

TEST_CASE("certified IVF: option and configuration extremes", "[certified][pruning]") {
  const std::size_t n = 1200, d = 8, dv = 2;
  const test::Regime regime = test::make_regime(1, n, d, 2, 51);
  const auto values = test::normal_floats(n * dv, 52);
  CollectionConfig flat_config{d, dv, Metric::dot, {}, {.kind = IndexKind::flat}};
  Collection flat(flat_config);
  flat.add_batch(regime.keys, values);
  for (const std::size_t nlist : {std::size_t{1}, std::size_t{3}, n}) {
    INFO("nlist " << nlist);
    Collection c(ivf_config(d, dv, nlist));
    c.add_batch(regime.keys, values);
    c.wait_until_indexed();
    check_answers(c, flat, regime.queries, 2, 1.0f);
    const auto q = q_of(regime.queries, 0, d);
    // top_k at and past the size: the exact scan; epsilon at the smallest positive float: still bounded.
    for (const std::size_t k : {n - 1, n, kAll}) {
      const SoftResult r = c.query_soft(q, {.top_m = 3, .top_k = k});
      CHECK(r.candidates == std::min(k, n));
      CHECK(r.tail_bound_guaranteed);
    }
    const SoftResult tiny = c.query_soft(q, {.epsilon = std::numeric_limits<float>::denorm_min()});
    CHECK(tiny.tail_bound <= std::numeric_limits<float>::denorm_min());
  }
}

TEST_CASE("the planner answers with the exact scan when pruning would cost more than it", "[certified][planner]") {
  // 20,000 rows of 128 bytes: past kPlannerMinBytes, so the budget (1/32 of the rows) applies.
  const std::size_t n = 20000, d = 16, dv = 16;
  const auto keys = test::normal_floats(n * d, 61), values = test::normal_floats(n * dv, 62);
  const auto q = test::normal_floats(d, 63);
  for (const IndexKind kind : {IndexKind::ivf, IndexKind::flat, IndexKind::hnsw}) {
    INFO("index " << static_cast<int>(kind));
    CollectionConfig config = ivf_config(d, dv);
    config.index.kind = kind;
    config.index.hnsw_m = 8;
    config.index.hnsw_ef_construction = 16;
    Collection c(config);
    c.add_batch(keys, values);
    c.wait_until_indexed();
    // Spread attention (Gaussian, T = 1): no small candidate set holds 1 - 1e-3 of the mass.
    const SoftResult r = c.query_soft(q, {.epsilon = 1e-3f});
    CHECK(r.searched_with == IndexKind::exact);
    CHECK(r.candidates == n);
    CHECK(r.tail_bound == 0.0);
    // A top_k round costing more than the scan (flat reads half the bytes, plus k gathers; hnsw k x M nodes).
    const SoftResult big = c.query_soft(q, {.top_k = n / 2});
    CHECK(big.candidates == n);
  }
  // Clustered keys at a low temperature: the certified lists answer from a few lists.
  const test::Regime regime = test::make_regime(1, n, d, 3, 64);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, values);
  c.wait_until_indexed();
  for (std::size_t b = 0; b < 3; ++b) {
    const SoftResult r = c.query_soft(q_of(regime.queries, b, d), {.temperature = 0.05f, .epsilon = 1e-3f});
    CHECK(r.searched_with == IndexKind::ivf);
    CHECK(r.candidates < n / 16);
    CHECK(r.tail_bound <= 1e-3);
    CHECK(r.tail_bound_guaranteed);
  }
}

// A stream of answers after the planner began skipping an attempt: the first was not served by it, one
// within 16 was (the try), and every later one was too (an answer ends the skipping).
template <class T, class Served>
void check_skipped_then_resumed(const std::vector<T>& answers, Served served) {
  const auto first = std::find_if(answers.begin(), answers.end(), served);
  REQUIRE(first != answers.end());
  CHECK(first - answers.begin() >= 1);
  CHECK(first - answers.begin() <= 15);
  CHECK(std::all_of(first, answers.end(), served));
}

TEST_CASE("the planner stops trying walks after 8 fallbacks in a row, tries one in 16, walks again once one answers", "[certified][planner]") {
  // 20,000 rows of 128 bytes (past kPlannerMinBytes): spread queries (Gaussian, T = 1) fall back to the
  // scan; then peaked queries (near stored keys, T = 0.05), which a walk answers.
  const std::size_t n = 20000, d = 16, dv = 16;
  const test::Regime regime = test::make_regime(1, n, d, 4, 65);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, test::normal_floats(n * dv, 66));
  c.wait_until_indexed();
  const auto spread = test::normal_floats(d, 67);
  for (int i = 0; i < 8; ++i) CHECK(c.query_soft(spread, {.temperature = 20.0f, .epsilon = 1e-3f}).searched_with == IndexKind::exact);
  // Skipping now: peaked queries get the exact scan (still exact, bound 0) until the one query in 16 that walks.
  std::vector<IndexKind> kinds;
  for (int i = 0; i < 20; ++i) {
    const SoftResult r = c.query_soft(q_of(regime.queries, static_cast<std::size_t>(i) % 4, d), {.temperature = 0.05f, .epsilon = 1e-3f});
    CHECK(r.tail_bound_guaranteed);
    if (r.searched_with == IndexKind::exact) CHECK(r.candidates == n);
    kinds.push_back(r.searched_with);
  }
  check_skipped_then_resumed(kinds, [](IndexKind k) { return k == IndexKind::ivf; });  // walked
}

TEST_CASE("error_target: the planner stops sampling after 8 samples in a row fell back to the scan, and samples again once one answers",
          "[certified][planner][estimate]") {
  // 20,000 Gaussian rows of 128 bytes, no index: peaked queries (stored keys, T = 0.05) defeat a sample of
  // row blocks (the exact scan answers); spread queries (Gaussian, T = 1) are what a sample estimates.
  const std::size_t n = 20000, d = 16, dv = 16;
  const auto keys = test::normal_floats(n * d, 71);
  Collection c({d, dv});
  c.add_batch(keys, test::normal_floats(n * dv, 72));
  for (std::size_t i = 0; i < 8; ++i) {
    const SoftResult r = c.query_soft(q_of(keys, i * 1000, d), {.temperature = 0.05f, .error_target = 0.01f});
    REQUIRE(r.rows_scored == n);  // the sample handed the query on
  }
  std::vector<std::size_t> scored;
  for (int i = 0; i < 20; ++i) {
    const auto spread = test::normal_floats(d, 73 + static_cast<std::uint64_t>(i));
    const SoftResult r = c.query_soft(spread, {.error_target = 0.1f});
    CHECK(r.error_estimate <= 0.1);
    scored.push_back(r.rows_scored);
  }
  check_skipped_then_resumed(scored, [&](std::size_t rows) { return rows < n / 4; });  // sampled
}

TEST_CASE("error_target: a walk whose rows the sample used is not a miss: spread queries keep walking, peaked ones walk at once",
          "[certified][planner][estimate]") {
  // Spread queries (Gaussian, T = 1): the walk finds no list that holds the mass and leaves the rows it
  // visited to the sample (scored exactly, left out of its blocks), which answers: the planner must not
  // stop walking for that, or a later sample would go without them. Then peaked queries (near stored
  // keys, T = 0.05) are answered by their walks from the first one on. (A walk whose sample then fails
  // is a miss: tests/test_estimate.cpp, "a walk that hands its rows to a sample ...".)
  const std::size_t n = 40000, d = 16, dv = 16;
  const test::Regime regime = test::make_regime(1, n, d, 4, 75);
  Collection c(ivf_config(d, dv));
  c.add_batch(regime.keys, test::normal_floats(n * dv, 76));
  c.wait_until_indexed();
  for (int i = 0; i < 12; ++i) {
    const SoftResult r = c.query_soft(test::normal_floats(d, 77 + static_cast<std::uint64_t>(i)), {.error_target = 0.1f});
    REQUIRE(r.searched_with == IndexKind::exact);  // not from the lists alone
    CHECK(r.rows_scored < n);                       // but from the sample
    CHECK(r.error_estimate <= 0.1);
  }
  for (int i = 0; i < 8; ++i) {
    const SoftResult r = c.query_soft(q_of(regime.queries, static_cast<std::size_t>(i) % 4, d), {.temperature = 0.05f, .error_target = 0.01f});
    CHECK(r.error_estimate <= 0.01);
    CHECK(r.searched_with == IndexKind::ivf);  // walked
  }
}
