// Pruned soft retrieval with the flat index: equals the softmax over the true top-k, and its tail bound holds.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <numeric>

#include "index/shared_scores.hpp"
#include "pruning.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

// n points around `clusters` well-separated centres (spread 10, noise 0.1) or, with clusters = 0, uniform normal.
std::vector<float> make_keys(std::size_t n, std::size_t d, std::size_t clusters, std::uint64_t seed) {
  if (clusters == 0) return test::normal_floats(n * d, seed);
  const auto centres = test::normal_floats(clusters * d, seed, 10.0f);
  auto keys = test::normal_floats(n * d, seed + 1, 0.1f);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) keys[i * d + j] += centres[(i % clusters) * d + j];
  return keys;
}

// An ivf index built at once over n keys of width d (make_keys' clusters, ids 0 to n - 1), with its rows.
struct BuiltLists {
  std::vector<float> keys;
  std::vector<std::uint64_t> ids;
  detail::RowSpan all;
  std::unique_ptr<detail::PruningIndex> index;
  BuiltLists(std::size_t n, std::size_t d, std::size_t clusters, std::uint64_t seed)
      : keys(make_keys(n, d, clusters, seed)), ids(n), all{keys.data(), nullptr, ids.data(), n, d, 0} {
    std::iota(ids.begin(), ids.end(), std::uint64_t{0});
    index = detail::make_pruning_index({d, 1, Metric::dot, {}, {.kind = IndexKind::ivf}});
    index->put(ids, keys.data(), all);
    index->build_now(all);
    REQUIRE(index->lists() != nullptr);
  }
  BuiltLists(const BuiltLists&) = delete;  // (all points into keys and ids)
  BuiltLists& operator=(const BuiltLists&) = delete;
};

// Exact softmax restricted to the k best keys, and the true mass outside them, in double.
struct TopKReference {
  std::vector<double> value;
  double omitted_mass = 0;
  std::vector<std::size_t> rows;  // the true top-k rows
};

TopKReference top_k_reference(const std::vector<float>& q, const std::vector<float>& keys, const std::vector<float>& values,
                              std::size_t n, std::size_t d, std::size_t dv, double scale, std::size_t k) {
  const auto full = test::soft_reference(q.data(), keys.data(), values.data(), n, d, dv, scale);
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](std::size_t a, std::size_t b) { return full.scores[a] > full.scores[b]; });
  TopKReference ref;
  ref.rows.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
  double kept = 0;
  ref.value.assign(dv, 0.0);
  for (std::size_t r : ref.rows) kept += full.weights[r];
  for (std::size_t r : ref.rows)
    for (std::size_t j = 0; j < dv; ++j) ref.value[j] += full.weights[r] / kept * values[r * dv + j];
  ref.omitted_mass = 1.0 - kept;
  return ref;
}

// A walk's start counted list by list (bounds ub, live members live, count lists), and a check that a
// gathered one (BoundsSummary, finished) equals it, its cold bins within 1/8 nat above the cold mass.
struct CountedStart {
  double top = -std::numeric_limits<double>::infinity(), cold_max = top;
  std::uint64_t rows = 0, hot_rows = 0;
  std::uint32_t most = 1;
  std::size_t lists = 0;
  std::vector<std::uint32_t> hot;
  long double cold_mass = 0;  // sum over the cold lists of live e^{ub - top}
};

CountedStart count_start(const double* ub, const std::uint32_t* live, std::size_t count) {
  CountedStart s;
  for (std::size_t c = 0; c < count; ++c)
    if (live[c] != 0) s.top = std::max(s.top, std::isfinite(ub[c]) ? ub[c] : s.top), s.rows += live[c], s.most = std::max(s.most, live[c]), ++s.lists;
  for (std::size_t c = 0; c < count; ++c) {
    if (live[c] == 0) continue;
    if (ub[c] >= s.top - detail::kHotNats) {
      s.hot.push_back(static_cast<std::uint32_t>(c)), s.hot_rows += live[c];
    } else {
      s.cold_max = std::max(s.cold_max, ub[c]);
      s.cold_mass += live[c] * std::exp(static_cast<long double>(ub[c]) - s.top);
    }
  }
  return s;
}

void check_start(detail::BoundsSummary& gathered, const CountedStart& s) {
  std::sort(gathered.hot.begin(), gathered.hot.end());
  CHECK(gathered.top == s.top);
  CHECK(gathered.hot == s.hot);
  CHECK(gathered.cold_max == s.cold_max);
  CHECK(gathered.rows == s.rows);
  CHECK(gathered.hot_rows == s.hot_rows);
  CHECK(gathered.most == s.most);
  CHECK(gathered.lists == s.lists);
  const double binned = gathered.cold_bins.mass(s.top, [](double edge, double shift) { return std::exp(edge - shift); });
  CHECK(binned >= static_cast<double>(s.cold_mass) * (1 - 1e-12));
  CHECK(binned <= static_cast<double>(s.cold_mass) * std::exp(0.125) * (1 + 1e-12));
}

}  // namespace

TEST_CASE("the tail bound matches its formula and stays finite at extreme scores", "[pruning]") {
  using detail::tail_bound;
  CHECK(tail_bound(10, 10, 0.0, 0.0) == 0.0);
  CHECK(tail_bound(10, 12, 0.0, 0.0) == 0.0);
  // n = 100, k = 10, s_k = 1, Z_k = e^3: (90 e) / (e^3 + 90 e).
  const double expected = 90 * std::exp(1.0) / (std::exp(3.0) + 90 * std::exp(1.0));
  CHECK(tail_bound(100, 10, 1.0, 3.0) == Approx(expected).epsilon(1e-12));
  // Scores of 1e4 would overflow exp(); the log-space form does not.
  CHECK(tail_bound(1000000, 32, 1e4, 1e4 + 50) == Approx(std::exp(std::log(999968.0) - 50)).epsilon(1e-9));
  CHECK(tail_bound(1000000, 32, -1e4, -1e4 + 2) > 0.99);
}

TEST_CASE("flat pruning equals the softmax over the true top-k and its bound covers the omitted mass", "[pruning]") {
  const std::size_t n = 4000, d = 32, dv = 6;
  for (const std::size_t clusters : {0u, 40u}) {
    const auto keys = make_keys(n, d, clusters, 3 + clusters);
    const auto values = test::normal_floats(n * dv, 4);
    Collection c({d, dv, Metric::dot, {}, IndexKind::flat});
    c.add_batch(keys, values);
    for (std::uint64_t seed = 0; seed < 40; ++seed) {
      // Queries near a stored key (clustered) or random (uniform), at a few temperatures and k.
      auto q = test::normal_floats(d, 500 + seed, clusters ? 0.2f : 1.0f);
      if (clusters) for (std::size_t j = 0; j < d; ++j) q[j] += keys[(seed * 37 % n) * d + j];
      const float t = std::array<float, 3>{0.5f, 1.0f, 4.0f}[seed % 3];
      const std::size_t k = std::array<std::size_t, 4>{1, 16, 100, 333}[seed % 4];
      const std::size_t threads = std::array<std::size_t, 3>{1, 2, 5}[(seed / 4) % 3];  // row slices the search is cut into
      INFO("clusters " << clusters << ", query " << seed << ", T = " << t << ", k = " << k << ", threads " << threads);
      const SoftResult r = c.query_soft(q, {.temperature = t, .top_m = k, .threads = threads, .top_k = k});
      const double scale = 1.0 / (std::sqrt(static_cast<double>(d)) * t);
      const TopKReference ref = top_k_reference(q, keys, values, n, d, dv, scale, k);
      CHECK(r.candidates == k);
      CHECK(r.tail_bound_guaranteed);
      CHECK(test::max_abs_diff(r.value, ref.value) <= 1e-4 * test::max_abs(values));
      CHECK(r.tail_bound >= ref.omitted_mass - 1e-9);
      CHECK(r.tail_bound <= 1.0);
      // The candidates are the true top-k (as a set).
      std::vector<std::uint64_t> got, want(ref.rows.begin(), ref.rows.end());
      for (const Contributor& x : r.top) got.push_back(x.id);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      CHECK(got == want);
    }
  }
}

TEST_CASE("the bound is tiny on well-separated clusters", "[pruning]") {
  const std::size_t n = 20000, d = 32, dv = 4, clusters = 100;  // 200 points per cluster
  const auto keys = make_keys(n, d, clusters, 9);
  Collection c({d, dv, Metric::dot, {}, IndexKind::flat});
  c.add_batch(keys, test::normal_floats(n * dv, 10));
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    std::vector<float> q(keys.begin() + static_cast<std::ptrdiff_t>(seed * 101 * d),
                         keys.begin() + static_cast<std::ptrdiff_t>((seed * 101 + 1) * d));
    const SoftResult r = c.query_soft(q, {.top_k = 256});
    CHECK(r.tail_bound < 1e-3);
  }
}

TEST_CASE("adaptive epsilon meets its target with the flat index", "[pruning]") {
  const std::size_t n = 8000, d = 24, dv = 3;
  for (const std::size_t clusters : {0u, 80u}) {
    const auto keys = make_keys(n, d, clusters, 21);
    const auto values = test::normal_floats(n * dv, 22);
    Collection c({d, dv, Metric::dot, {}, IndexKind::flat});
    c.add_batch(keys, values);
    for (const float eps : {0.1f, 1e-2f, 1e-4f}) {
      for (std::uint64_t seed = 0; seed < 8; ++seed) {
        auto q = test::normal_floats(d, 900 + seed, clusters ? 0.1f : 1.0f);
        if (clusters) for (std::size_t j = 0; j < d; ++j) q[j] += keys[(seed * 13) * d + j];
        INFO("clusters " << clusters << ", epsilon " << eps << ", query " << seed);
        const SoftResult r = c.query_soft(q, {.temperature = 0.5f, .epsilon = eps});
        CHECK(r.tail_bound <= eps);
        if (r.candidates < n) {  // the prefix of one wide pass is exactly a fresh top-k pass
          const SoftResult same_k = c.query_soft(q, {.temperature = 0.5f, .top_k = r.candidates});
          CHECK(same_k.value == r.value);
          CHECK(same_k.lse == r.lse);
          CHECK(same_k.tail_bound == r.tail_bound);
        }
        const double scale = 1.0 / (std::sqrt(static_cast<double>(d)) * 0.5);
        if (r.candidates < n) {
          const TopKReference ref = top_k_reference(q, keys, values, n, d, dv, scale, r.candidates);
          CHECK(ref.omitted_mass <= eps);
          CHECK(test::max_abs_diff(r.value, ref.value) <= 1e-4 * test::max_abs(values));
        } else {
          CHECK(r.tail_bound == 0.0);  // fell back to the exact scan
        }
      }
    }
  }
}

TEST_CASE("removed and replaced entries never appear in pruned answers", "[pruning]") {
  const std::size_t n = 3000, d = 16, dv = 2;
  const auto keys = make_keys(n, d, 30, 31);
  Collection c({d, dv, Metric::dot, {}, IndexKind::flat});
  c.add_batch(keys, test::normal_floats(n * dv, 32));
  const std::vector<float> q(keys.begin(), keys.begin() + d);  // near entry 0's cluster
  const SoftResult before = c.query_soft(q, {.top_m = 64, .top_k = 64});
  // Remove half of the candidates; move the other half to the bottom of the ranking with a new value.
  for (std::size_t i = 0; i < before.top.size(); ++i) {
    const std::uint64_t id = before.top[i].id;
    if (i % 2 == 0) {
      c.remove(id);
    } else {
      std::vector<float> far(q);  // -100 q: the lowest possible score for this query
      for (float& x : far) x *= -100.0f;
      c.upsert(id, far, std::vector<float>{1e6f, 1e6f});
    }
  }
  const SoftResult after = c.query_soft(q, {.top_m = 64, .top_k = 64});
  REQUIRE(after.top.size() == 64);
  for (const Contributor& x : after.top)
    for (const Contributor& old : before.top) CHECK(x.id != old.id);
  CHECK(std::fabs(after.value[0]) < 1e3);  // no replaced value blended in
}

TEST_CASE("pruning parameters are validated", "[pruning][errors]") {
  Collection plain({2, 1, Metric::dot, {}});
  plain.add(std::vector<float>{1, 0}, std::vector<float>{1});
  const std::vector<float> q = {1, 0};
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode{};
  };
  CHECK(code_of([&] { (void)plain.query_soft(q, {.top_k = 4}); }) == ErrorCode::invalid_argument);
  Collection flat({2, 1, Metric::dot, {}, IndexKind::flat});
  flat.add(std::vector<float>{1, 0}, std::vector<float>{1});
  CHECK(code_of([&] { (void)flat.query_soft(q, {.top_k = 0}); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { (void)flat.query_soft(q, {.epsilon = 0.0f}); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { (void)flat.query_soft(q, {.epsilon = 1.5f}); }) == ErrorCode::invalid_argument);
  CHECK(code_of([&] { (void)flat.query_soft(q, {.top_k = 2, .epsilon = 0.1f}); }) == ErrorCode::invalid_argument);
  // k larger than the collection is the exact answer, with nothing omitted.
  const SoftResult r = flat.query_soft(q, {.top_k = 50});
  CHECK(r.candidates == 1);
  CHECK(r.tail_bound == 0.0);
}

TEST_CASE("the sampled check bounds omitted mass that the k-th score does not", "[pruning][check]") {
  // Candidates that an approximate index could return: rows of low score, while half of the omitted
  // rows score far higher. The estimate from the k-th score misses that mass; the check does not.
  const std::size_t n = 20000, d = 8, k = 32;
  std::vector<float> keys(n * d, 0.0f);
  std::vector<std::uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = 0; i < n; ++i) keys[i * d] = i % 2 == 0 ? 2.0f : 1.0f;  // even rows score higher
  std::vector<std::size_t> candidates;
  for (std::size_t i = 0; i < k; ++i) candidates.push_back(2 * i + 1);  // odd (low) rows only
  const std::vector<float> q = {1, 0, 0, 0, 0, 0, 0, 0};
  const detail::RowSpan span{keys.data(), nullptr, ids.data(), n, d, 0};
  for (std::string_view name : available_simd_paths()) {
    INFO("path " << name);
    const detail::KernelTable& kernels = *detail::kernels_named(name);
    for (double scale : {0.5, 3.0}) {
      INFO("scale " << scale);
      const double lse_k = std::log(static_cast<double>(k)) + scale * 1.0;
      const double truth = (n / 2.0 * std::exp(2.0 * scale) + (n / 2.0 - k) * std::exp(scale)) /
                           (n / 2.0 * std::exp(2.0 * scale) + (n / 2.0) * std::exp(scale));
      const double estimate = detail::tail_bound(n, k, scale * 1.0, lse_k);
      const double checked = detail::sampled_tail(kernels, q.data(), static_cast<float>(scale), span, candidates, scale * 1.0, lse_k, 256);
      CHECK(estimate < truth);  // the unchecked estimate is violated
      CHECK(checked >= truth);  // the checked bound holds
      CHECK(checked <= 1.0);
    }
  }
}

TEST_CASE("the sampled check is exact when every omitted row fits in the sample", "[pruning][check]") {
  const std::size_t n = 300, d = 6, dv = 2;
  const auto keys = make_keys(n, d, 0, 41);
  const auto values = test::normal_floats(n * dv, 42);
  std::vector<std::uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  const detail::RowSpan span{keys.data(), values.data(), ids.data(), n, d, dv};
  const auto q = test::normal_floats(d, 43);
  const float scale = 0.7f;
  const auto full = test::soft_reference(q.data(), keys.data(), values.data(), n, d, dv, scale);
  std::vector<std::size_t> candidates;
  for (std::size_t i = 0; i < n; i += 3) candidates.push_back(i);  // any 100 rows
  double kept = 0, lse_k = -INFINITY, kth = INFINITY;
  for (std::size_t r : candidates) {
    kept += full.weights[r];
    lse_k = std::max(lse_k, full.scores[r]);
    kth = std::min(kth, full.scores[r]);
  }
  lse_k = std::log(kept) + full.lse;  // log of the candidates' sum of e^s
  for (std::string_view name : available_simd_paths()) {
    INFO("path " << name);
    const double checked = detail::sampled_tail(*detail::kernels_named(name), q.data(), scale, span, candidates, kth, lse_k, 256);
    CHECK(checked == Approx(1.0 - kept).epsilon(1e-5));
  }
}

TEST_CASE("an approximate index with the sampled check reports a bound at least its estimate", "[pruning][check]") {
  const std::size_t n = 3000, d = 16, dv = 2;
  const auto keys = make_keys(n, d, 30, 51);
  // The graph alone (its certified lists never train: ivf_train_size at its maximum) answers soft queries.
  CollectionConfig config{d, dv, Metric::dot, {}, {.kind = IndexKind::hnsw, .hnsw_m = 8, .ivf_train_size = ConfigLimits::kMaxIvfTrainSize}};
  Collection c(config);
  c.add_batch(keys, test::normal_floats(n * dv, 52));
  c.wait_until_indexed();
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    const auto q = test::normal_floats(d, 60 + seed);
    const SoftResult plain = c.query_soft(q, {.top_k = 32, .ef_search = 32, .check_sample = 0});
    const SoftResult checked = c.query_soft(q, {.top_k = 32, .ef_search = 32, .check_sample = 256});
    REQUIRE(plain.searched_with == IndexKind::hnsw);
    CHECK_FALSE(checked.tail_bound_guaranteed);
    CHECK(checked.tail_bound >= plain.tail_bound);
    CHECK(checked.value == plain.value);  // the check changes the bound, never the answer
    // With epsilon, the checked bound is what must meet it (or the exact scan answers).
    const SoftResult adaptive = c.query_soft(q, {.epsilon = 0.05f, .ef_search = 32, .check_sample = 256});
    CHECK((adaptive.tail_bound <= 0.05 || adaptive.candidates == n));
  }
  CollectionConfig flat_config{d, dv, Metric::dot, {}, {.kind = IndexKind::flat}};
  Collection flat(flat_config);
  flat.add_batch(keys, test::normal_floats(n * dv, 52));
  const auto q = test::normal_floats(d, 70);
  CHECK(flat.query_soft(q, {.top_k = 32, .check_sample = 256}).tail_bound ==
        flat.query_soft(q, {.top_k = 32}).tail_bound);  // flat: already a guarantee, nothing to check
}

// 1,500 clustered rows (d = 8, ids 0..n-1) as an index sees them, and an hnsw configuration for them.
struct HnswRows {
  static constexpr std::size_t n = 1500, d = 8;
  std::vector<float> keys;
  std::vector<std::uint64_t> ids = std::vector<std::uint64_t>(n);
  detail::RowSpan all;
  CollectionConfig config{d, 1, Metric::dot, {}, {.kind = IndexKind::hnsw, .hnsw_m = 8, .hnsw_ef_construction = 16}};
  explicit HnswRows(std::uint64_t seed) : keys(make_keys(n, d, 30, seed)) {
    std::iota(ids.begin(), ids.end(), std::uint64_t{0});
    all.keys = keys.data();
    all.ids = ids.data();
    all.rows = n;
    all.dim = d;
  }
};

TEST_CASE("hnsw's index state holds its graph and its certified lists, and state from before the lists loads with lists built", "[pruning][persistence]") {
  const HnswRows rows(81);
  const std::size_t n = rows.n, d = rows.d;
  const auto& keys = rows.keys;
  const auto& ids = rows.ids;
  const detail::RowSpan& all = rows.all;
  const CollectionConfig& config = rows.config;
  const auto built = detail::make_pruning_index(config);
  built->put(ids, keys.data(), all);
  built->build_now(all);
  REQUIRE(built->ready());
  REQUIRE(built->lists() != nullptr);
  const std::vector<std::byte> state = built->save();
  // The layout: a u64 header, then the graph's and the lists' bytes, each after its u64 length.
  auto u64_at = [&](std::size_t at) {
    std::uint64_t v = 0;
    std::memcpy(&v, state.data() + at, sizeof v);
    return v;
  };
  const std::uint64_t graph_size = u64_at(8);
  REQUIRE(16 + graph_size + 8 <= state.size());
  const std::uint64_t lists_size = u64_at(16 + graph_size);
  REQUIRE(16 + graph_size + 8 + lists_size == state.size());
  const std::span<const std::byte> graph(state.data() + 16, graph_size);

  const auto q = test::normal_floats(d, 82);
  const float scale = 1.0f;
  const auto search = [&](const detail::PruningIndex& index) { return index.search(q.data(), &scale, 1, all, {.k = 10, .ef_search = 10})[0]; };
  {  // the whole state: the same graph, lists ready without a build
    const auto loaded = detail::make_pruning_index(config);
    REQUIRE(loaded->load(state, all));
    CHECK(loaded->lists() != nullptr);
    CHECK(search(*loaded) == search(*built));
    CHECK(loaded->save() == state);
  }
  {  // the graph's bytes alone, as written before the lists existed: the graph loads, the lists are built
    const auto loaded = detail::make_pruning_index(config);
    REQUIRE(loaded->load(graph, all));
    CHECK(loaded->lists() != nullptr);
    CHECK(search(*loaded) == search(*built));
  }
  {  // truncated or padded: refused, nothing changed
    const auto loaded = detail::make_pruning_index(config);
    CHECK_FALSE(loaded->load(std::span<const std::byte>(state.data(), state.size() - 1), all));
    std::vector<std::byte> padded = state;
    padded.push_back(std::byte{0});
    CHECK_FALSE(loaded->load(padded, all));
    CHECK_FALSE(loaded->ready());
  }
}

TEST_CASE("hnsw's certified lists are built first and serve, hard queries included, until the graph is built", "[pruning][persistence]") {
  const HnswRows rows(83);
  const std::size_t n = rows.n, d = rows.d;
  const auto& keys = rows.keys;
  const auto& ids = rows.ids;
  const detail::RowSpan& all = rows.all;
  const CollectionConfig& config = rows.config;
  const auto index = detail::make_pruning_index(config);
  index->put(ids, keys.data(), all);
  REQUIRE(index->build_due());
  CHECK_FALSE(index->ready());
  CHECK(index->kind() == IndexKind::exact);
  // The first build: the lists.
  auto build = index->start_build(all);
  REQUIRE(build);
  build->run();
  index->finish_build(std::move(build));
  REQUIRE(index->ready());
  CHECK(index->lists() != nullptr);
  CHECK(index->kind() == IndexKind::ivf);
  CHECK(index->exact_top_k());
  // Their search is the exact top-k (best first, ties to the smaller id), against the double reference.
  const auto q = test::normal_floats(d, 84);
  const float scale = 1.0f;
  std::vector<std::pair<double, std::uint64_t>> by_score;
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < d; ++j) s += static_cast<double>(q[j]) * keys[i * d + j];
    by_score.emplace_back(-s, i);
  }
  std::sort(by_score.begin(), by_score.end());
  const auto found = index->search(q.data(), &scale, 1, all, {.k = 5})[0];
  REQUIRE(found.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) CHECK(found[i] == by_score[i].second);
  // A batch's bounds, from one pass over the centroids, are each query's own, bit for bit.
  const auto qs = test::normal_floats(3 * d, 85);
  const std::vector<float> factors{1.0f, 0.5f, 3.0f};
  std::vector<double> batch, one;
  std::vector<detail::BoundsSummary> summaries_batch;
  index->lists()->bounds_batch(qs.data(), factors.data(), 3, d, batch, summaries_batch);
  REQUIRE(summaries_batch.size() == 3);
  const std::size_t count = index->lists()->list_count();
  REQUIRE(batch.size() == 3 * count);
  const std::uint32_t* live = index->lists()->live_counts();
  for (std::size_t i = 0; i < 3; ++i) {
    detail::BoundsSummary summary;
    index->lists()->bounds(qs.data() + i * d, factors[i], one, summary);
    CHECK(std::equal(one.begin(), one.end(), batch.begin() + static_cast<std::ptrdiff_t>(i * count)));
    // What the bounds pass gathered on both scan threads for a walk's start, against every list in turn:
    // what bounds() gathered for the query, and what the batch's pass gathered for each of its queries.
    const CountedStart counted = count_start(one.data(), live, count);
    CHECK(counted.hot.size() < counted.lists);  // (the check sees cold lists too)
    REQUIRE(counted.cold_mass > 0);
    for (detail::BoundsSummary* gathered : {&summary, &summaries_batch[i]}) check_start(*gathered, counted);
    // Asked without bins (as the top-k search asks), the pass gathers the rest and keeps the request.
    detail::BoundsSummary unbinned;
    unbinned.bin_cold = false;
    index->lists()->bounds(qs.data() + i * d, factors[i], one, unbinned);
    CHECK_FALSE(unbinned.bin_cold);
    CHECK(unbinned.cold_max == counted.cold_max);
    CHECK(unbinned.cold_bins.mass(counted.top, [](double edge, double shift) { return std::exp(edge - shift); }) == 0.0);
  }
  // Then the graph, which takes the hard queries over.
  REQUIRE(index->build_due());
  build = index->start_build(all);
  REQUIRE(build);
  build->run();
  index->finish_build(std::move(build));
  CHECK(index->kind() == IndexKind::hnsw);
  CHECK_FALSE(index->exact_top_k());
  CHECK(index->lists() != nullptr);
  CHECK_FALSE(index->build_due());
}

TEST_CASE("a batch's bounds equal each query's own bit for bit at widths that pair rows, fill vectors and leave tails", "[pruning]") {
  // (i8 centroids: each query's exact integer products, taken a tile of rows at a time for the batch.)
  for (const std::size_t d : {16u, 40u, 128u, 136u}) {
    INFO("d = " << d);
    const BuiltLists built(2500, d, 40, 95 + d);
    const auto& index = built.index;
    const std::size_t nq = 5, count = index->lists()->list_count();
    const auto qs = test::normal_floats(nq * d, 96 + d);
    const std::vector<float> factors{1.0f, 0.25f, 3.0f, 1e-3f, 17.0f};
    std::vector<double> batch, one;
    std::vector<detail::BoundsSummary> summaries;
    index->lists()->bounds_batch(qs.data(), factors.data(), nq, d, batch, summaries);
    for (std::size_t i = 0; i < nq; ++i) {
      detail::BoundsSummary summary;
      index->lists()->bounds(qs.data() + i * d, factors[i], one, summary);
      CHECK(std::equal(one.begin(), one.end(), batch.begin() + static_cast<std::ptrdiff_t>(i * count)));
    }
  }
}

TEST_CASE("list bounds from the integer centroid pass hold every member's score for queries of any dynamic range", "[pruning]") {
  // The pass quantises each query to int16 and adds the error to the bounds: queries whose coordinates
  // span 40 orders of magnitude (most quantise to 0), subnormal ones, a zero query, negative factors
  // excluded (split_scale gives positive ones) but tiny and huge factors in; every live member's kernel
  // score and its exact score (double) must lie at or below its list's bound. (How tight the bounds are
  // shows in how far the walks go: the certified tests' and the pruning bench's.)
  for (const std::size_t d : {1u, 7u, 128u, 600u}) {
    const BuiltLists built(3000, d, 30, 120 + d);
    const std::vector<float>& keys = built.keys;
    const detail::CertifiedLists& lists = *built.index->lists();
    std::vector<std::vector<float>> queries;
    queries.push_back(test::normal_floats(d, 121));
    std::vector<float> wide = test::normal_floats(d, 122);
    for (std::size_t j = 0; j < d; ++j) wide[j] *= std::pow(10.0f, -static_cast<float>(j % 40));
    wide[0] = 3e4f;
    queries.push_back(wide);
    std::vector<float> tiny(d);
    for (std::size_t j = 0; j < d; ++j) tiny[j] = (j % 3 == 0 ? -1.0f : 1.0f) * 1e-40f * static_cast<float>(j + 1);
    queries.push_back(tiny);
    queries.emplace_back(d, 0.0f);
    for (const auto& q : queries)
      for (const float factor : {1.0f, 1e-3f, 40.0f}) {
        std::vector<double> ub;
        detail::BoundsSummary summary;
        lists.bounds(q.data(), factor, ub, summary);
        REQUIRE(ub.size() == lists.list_count());
        for (std::size_t c = 0; c < lists.list_count(); ++c) {
          std::vector<std::uint64_t> members;
          std::vector<float> scores;
          lists.score_list(c, q.data(), factor, members, scores);
          if (members.empty()) continue;
          INFO("d = " << d << ", factor " << factor << ", list " << c);
          for (std::size_t i = 0; i < members.size(); ++i) {
            double exact = 0;
            for (std::size_t j = 0; j < d; ++j) exact += static_cast<double>(q[j]) * keys[members[i] * d + j];
            exact *= factor;
            REQUIRE(static_cast<double>(scores[i]) <= ub[c]);
            REQUIRE(exact <= ub[c]);
          }
        }
      }
  }
}

TEST_CASE("a failed list build is not retried before the next write, and the next write's build serves", "[pruning]") {
  const std::size_t n = 3000, d = 8;
  const std::vector<float> keys = make_keys(n + 1, d, 30, 93);
  std::vector<std::uint64_t> ids(n + 1);
  std::iota(ids.begin(), ids.end(), std::uint64_t{0});
  const detail::RowSpan all{keys.data(), nullptr, ids.data(), n, d, 0};
  const auto index = detail::make_pruning_index({d, 1, Metric::dot, {}, {.kind = IndexKind::ivf}});
  index->put(std::span(ids).first(n), keys.data(), all);
  REQUIRE(index->build_due());
  // A build that produced no lists (as one whose k-means threw): finished without running.
  index->finish_build(index->start_build(all));
  CHECK_FALSE(index->ready());
  CHECK_FALSE(index->build_due());
  CHECK(index->start_build(all) == nullptr);
  // One more key: due again; finishing with no build at all (journaling idle) records no failure, and
  // the next build serves.
  const detail::RowSpan more{keys.data(), nullptr, ids.data(), n + 1, d, 0};
  index->put(std::span(ids).subspan(n, 1), keys.data() + n * d, more);
  REQUIRE(index->build_due());
  index->finish_build(nullptr);
  CHECK(index->build_due());
  auto build = index->start_build(more);
  REQUIRE(build);
  build->run();
  index->finish_build(std::move(build));
  CHECK(index->ready());
  CHECK(index->lists() != nullptr);
  CHECK_FALSE(index->build_due());
}

TEST_CASE("a batch's shared list reads hand each query the scores its own read gives, and read a list once for similar queries", "[pruning]") {
  const std::size_t d = 16;
  const BuiltLists built(6000, d, 30, 91);
  const std::vector<float>& keys = built.keys;
  const detail::CertifiedLists& lists = *built.index->lists();
  const std::size_t count = lists.list_count();
  REQUIRE(count > 20);
  // Six queries near one key (cosine ~0.99 to each other), then three unrelated ones, then one near the first again.
  const std::size_t nq = 10;
  std::vector<float> qs = test::normal_floats(nq * d, 92);
  for (std::size_t i = 0; i < nq; ++i) {
    if (i >= 6 && i < 9) continue;
    for (std::size_t k = 0; k < d; ++k) qs[i * d + k] = keys[17 * d + k] + 0.05f * qs[i * d + k];
  }
  const std::vector<float> factors(nq, 2.0f);
  std::vector<double> bounds;
  std::vector<detail::BoundsSummary> summaries;
  lists.bounds_batch(qs.data(), factors.data(), nq, d, bounds, summaries);
  const std::uint32_t* live = lists.live_counts();
  detail::SharedListScores shared(lists, qs.data(), factors.data(), nq, d, bounds.data(), summaries.data());
  // Each query asks for its 12 lists of largest bound, in decreasing bound as a walk does.
  std::size_t asked = 0;
  for (std::size_t i = 0; i < nq; ++i) {
    std::vector<std::pair<double, std::size_t>> order;
    for (std::size_t c = 0; c < count; ++c)
      if (live[c] != 0) order.emplace_back(-bounds[i * count + c], c);
    std::sort(order.begin(), order.end());
    for (std::size_t r = 0; r < 12 && r < order.size(); ++r, ++asked) {
      const std::size_t c = order[r].second;
      std::vector<std::uint64_t> got_ids{7}, own_ids{7};  // appended after what is there
      std::vector<float> got{1.5f}, own{1.5f};
      const double got_error = shared.for_query(i).score_list(c, got_ids, got);
      const double own_error = lists.score_list(c, qs.data() + i * d, factors[i], own_ids, own);
      INFO("query " << i << ", list " << c);
      CHECK(got_ids == own_ids);
      CHECK(std::equal(got.begin(), got.end(), own.begin(), own.end(), [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; }));
      CHECK(got_error == own_error);
    }
  }
  CHECK(shared.own_reads() + shared.shared_reads() == asked);
  // The similar queries took most of their lists from the first one's reads; the unrelated ones read their own.
  // (Queries 1-5 and 9 ask for 72 lists, most of them the first query's; at least half must be shared.)
  CHECK(shared.shared_reads() >= 6 * 12 / 2);
  CHECK(shared.own_reads() >= 3 * 12 + 12);
}

namespace {

// sum of rows e^{ub - shift} in long double, and BoundBins' bound on it with exact exponentials.
long double exact_mass(const std::vector<double>& ub, const std::vector<std::uint64_t>& rows, double shift) {
  long double sum = 0;
  for (std::size_t i = 0; i < ub.size(); ++i) sum += rows[i] * std::exp(static_cast<long double>(ub[i]) - shift);
  return sum;
}

double binned_mass(const detail::BoundBins& bins, double shift) {
  return bins.mass(shift, [](double edge, double at) { return std::exp(edge - at); });
}

}  // namespace

TEST_CASE("bound bins hold at least every row's mass, within 1/8 nat while the bounds span under 100 nats, in any order and merged", "[pruning]") {
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const auto uniform = [&] { return unit(gen); };
  // Bounds of a few shapes: spread over 20 nats, rising (each re-anchors the bins), falling, on bin edges,
  // far apart (the lowest bin takes what lies 128 nats below), large (past the inline path's 2^30).
  const std::vector<std::pair<const char*, std::function<double(std::size_t)>>> shapes{
      {"spread", [&](std::size_t) { return 20.0 * uniform(); }},
      {"rising", [](std::size_t i) { return -50.0 + 0.01 * static_cast<double>(i); }},
      {"falling", [](std::size_t i) { return 30.0 - 0.01 * static_cast<double>(i); }},
      {"edges", [](std::size_t i) { return static_cast<double>(i % 160) / 8 - 10; }},
      {"far apart", [&](std::size_t i) { return i % 2 == 0 ? 400.0 * uniform() - 200 : -3e5; }},
      {"large", [&](std::size_t) { return 0x1p40 + 30.0 * uniform(); }},
      {"tiny spread", [&](std::size_t) { return 1e-9 * uniform(); }}};
  for (const auto& [name, make] : shapes) {
    INFO(name);
    std::vector<double> ub(5000);
    std::vector<std::uint64_t> rows(ub.size());
    for (std::size_t i = 0; i < ub.size(); ++i) ub[i] = make(i), rows[i] = 1 + i % 37;
    const double high = *std::max_element(ub.begin(), ub.end()), low = *std::min_element(ub.begin(), ub.end());
    const long double exact = exact_mass(ub, rows, high);
    // One bins for all, and three parts (every third bound) merged.
    detail::BoundBins all, merged;
    std::array<detail::BoundBins, 3> parts;
    for (std::size_t i = 0; i < ub.size(); ++i) all.add(ub[i], rows[i]), parts[i % 3].add(ub[i], rows[i]);
    for (const auto& part : parts) merged.merge(part);
    for (const detail::BoundBins* bins : {&all, &merged}) {
      const double mass = binned_mass(*bins, high);
      CHECK(mass >= static_cast<double>(exact) * (1 - 1e-12));
      if (high - low < 100) CHECK(mass <= static_cast<double>(exact) * std::exp(0.125) * (1 + 1e-12));
    }
    all.clear();
    CHECK(binned_mass(all, high) == 0.0);
  }
  // A bound too large for a key: the mass is unbounded; far below a key's range: in the lowest key,
  // whose edge lies above it (here, so far above that its mass overflows: still not below the truth).
  detail::BoundBins huge, deep;
  huge.add(1.0, 3);
  huge.add(1e300, 1);
  CHECK(std::isinf(binned_mass(huge, 0.0)));
  deep.add(-1e300, 5);
  CHECK(binned_mass(deep, -1e300) >= 5.0);
  // Bins anchored more than 128 nats apart: merged either way, the lower ones land in the lowest bin.
  detail::BoundBins low, high, low_then_high, high_then_low;
  for (int i = 0; i < 100; ++i) low.add(-300.0 + 0.1 * i, 2), high.add(200.0 + 0.1 * i, 3);
  low_then_high.merge(low), low_then_high.merge(high);
  high_then_low.merge(high), high_then_low.merge(low);
  long double both = 0;
  for (int i = 0; i < 100; ++i) both += 2 * std::exp(static_cast<long double>(-300.0 + 0.1 * i - 210)) + 3 * std::exp(static_cast<long double>(0.1 * i - 10));
  for (const detail::BoundBins* bins : {&low_then_high, &high_then_low}) {
    std::uint64_t rows = 0;
    const double mass = bins->mass(210.0, [](double edge, double at) { return std::exp(edge - at); }, &rows);
    CHECK(rows == 500);
    CHECK(mass >= static_cast<double>(both) * (1 - 1e-12));
    CHECK(mass <= static_cast<double>(both) * std::exp(0.125) * (1 + 1e-12) + 200 * std::exp(-128.0 - 10 + 0.2));
  }
  // Cleared, the bins anchor afresh: bounds far below the old ones are binned within 1/8 nat again.
  high.clear();
  CHECK(binned_mass(high, 0.0) == 0.0);
  for (int i = 0; i < 100; ++i) high.add(-1000.0 + 0.1 * i, 1);
  long double fresh = 0;
  for (int i = 0; i < 100; ++i) fresh += std::exp(static_cast<long double>(0.1 * i - 10));
  CHECK(binned_mass(high, -990.0) >= static_cast<double>(fresh) * (1 - 1e-12));
  CHECK(binned_mass(high, -990.0) <= static_cast<double>(fresh) * std::exp(0.125) * (1 + 1e-12));
  // A moved-from bins is empty, and takes rows anew.
  detail::BoundBins moved = std::move(high);
  CHECK(binned_mass(high, 0.0) == 0.0);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  high.add(1.0, 4);
  CHECK(binned_mass(high, 0.0) >= 4 * std::exp(1.0));
  CHECK(binned_mass(moved, -990.0) >= static_cast<double>(fresh) * (1 - 1e-12));
}

TEST_CASE("a walk's start gathered in parts, in any split, equals one counted list by list, with infinite bounds and cold-only parts", "[pruning]") {
  // 3,000 lists: bounds spread over 60 nats, a few +inf (always hot), some emptied (-inf, no member), and
  // the highest bounds all in the last third, so the first parts hold only lists that end cold.
  const std::size_t count = 3000;
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> spread(-40.0, 20.0);
  std::vector<double> ub(count);
  std::vector<std::uint32_t> live(count);
  for (std::size_t c = 0; c < count; ++c) ub[c] = spread(gen), live[c] = 1 + static_cast<std::uint32_t>(c % 50);
  for (std::size_t c = 2000; c < count; c += 97) ub[c] = 60.0 + static_cast<double>(c % 7);
  for (const std::size_t c : {17u, 1500u, 2999u}) ub[c] = std::numeric_limits<double>::infinity();
  for (std::size_t c = 3; c < count; c += 211) ub[c] = -std::numeric_limits<double>::infinity(), live[c] = 0;
  const CountedStart counted = count_start(ub.data(), live.data(), count);
  REQUIRE(counted.top == 66.0);
  for (const std::size_t parts : {1u, 2u, 3u, 7u, 64u}) {
    INFO(parts << " parts");
    detail::BoundsSummary merged;
    for (std::size_t p = 0; p < parts; ++p) {
      detail::BoundsSummary part;
      const std::size_t begin = count * p / parts, end = count * (p + 1) / parts;
      for (std::size_t a = begin; a < end; a += 100) part.add(ub.data(), live.data(), a, std::min<std::size_t>(100, end - a));
      merged.merge(part);
    }
    merged.finish(ub.data(), live.data());
    check_start(merged, counted);
  }
  // Without bins (a top-k search's pass), nothing is binned.
  detail::BoundsSummary plain;
  plain.bin_cold = false;
  plain.add(ub.data(), live.data(), 0, count);
  plain.finish(ub.data(), live.data());
  CHECK(plain.cold_max == counted.cold_max);
  CHECK(binned_mass(plain.cold_bins, counted.top) == 0.0);
}

TEST_CASE("a peaked walk bounds its cold lists by their bins: the rest is near its exact mass without visiting them", "[pruning]") {
  // One list at the top (30), three within 16 nats of it, and 50,000 lists of 20 rows about 35 nats below
  // the top (normal, deviation 3): cold, their largest bound 10. By the largest bound alone they would
  // weigh 10^6 e^10; by their bins, within 1/4 nat of their own mass (about 10^6 e^-0.5).
  const std::size_t lists = 50004;
  std::vector<double> ub(lists);
  std::vector<std::uint32_t> live(lists, 20);
  std::mt19937_64 gen(11);
  std::normal_distribution<double> spread(-5.0, 3.0);
  for (std::size_t c = 4; c < lists; ++c) ub[c] = std::min(spread(gen), 9.0);
  ub[100] = 10.0;
  ub[0] = 30.0, ub[1] = 25.0, ub[2] = 20.0, ub[3] = 15.0;
  detail::ListWalk walk(ub.data(), live.data(), lists);
  for (std::size_t expected = 0; expected < 4; ++expected) CHECK(walk.next() == expected);
  long double exact = 0;
  for (std::size_t c = 4; c < lists; ++c) exact += live[c] * std::exp(static_cast<long double>(ub[c]));
  const double log_exact = std::log(static_cast<double>(exact));
  CHECK(walk.log_rest() >= log_exact);
  CHECK(walk.log_rest() <= log_exact + 0.26);  // a bin's edge and a bucket's, 1/8 nat each
  CHECK(walk.log_rest() < std::log(1e6) + 10.0 - 8);
  CHECK(walk.next_bound() == 10.0);
  // Walking on, the lists come in decreasing bound, and the rest stays above what is left.
  CHECK(walk.next() == 100);
  exact -= live[100] * std::exp(static_cast<long double>(ub[100]));
  for (int step = 0; step < 200; ++step) {
    const double next = walk.next_bound();
    const std::size_t c = walk.next();
    CHECK(ub[c] == next);
    exact -= live[c] * std::exp(static_cast<long double>(ub[c]));
  }
  CHECK(walk.log_rest() >= std::log(static_cast<double>(exact)) - 1e-12);
  CHECK(walk.log_rest() <= std::log(static_cast<double>(exact)) + 0.26);
  // A walk whose summary bins nothing (a top-k search's) bounds the same cold lists at their largest bound.
  detail::BoundsSummary plain;
  plain.bin_cold = false;
  plain.add(ub.data(), live.data(), 0, lists);
  plain.finish(ub.data(), live.data());
  detail::ListWalk coarse(ub.data(), live.data(), lists, &plain);
  for (std::size_t expected = 0; expected < 4; ++expected) CHECK(coarse.next() == expected);
  const double all_at_max = std::log(static_cast<double>(lists - 4) * 20) + 10.0;
  CHECK(coarse.log_rest() >= all_at_max);
  CHECK(coarse.log_rest() <= all_at_max + 0.126);
  // Summaries merged from a binned part and an unbinned one: the bins miss rows, so the walk does not use them.
  detail::BoundsSummary binned_part, mixed;
  binned_part.add(ub.data(), live.data(), 0, lists / 2);
  detail::BoundsSummary unbinned_part;
  unbinned_part.bin_cold = false;
  unbinned_part.add(ub.data(), live.data(), lists / 2, lists - lists / 2);
  mixed.merge(binned_part);
  mixed.merge(unbinned_part);
  mixed.finish(ub.data(), live.data());
  detail::ListWalk merged_walk(ub.data(), live.data(), lists, &mixed);
  for (std::size_t expected = 0; expected < 4; ++expected) CHECK(merged_walk.next() == expected);
  CHECK(merged_walk.log_rest() >= all_at_max);
}

TEST_CASE("a list walk's bound on the unvisited mass follows the highest unvisited bound down, however far below the first", "[pruning]") {
  // One wide list bounded 1,000 nats up (its rows may score far less), one at 500 and 50,000 lists of 20
  // rows at 100: once the first two are visited the rest weigh at most 10^6 e^100. The buckets floor
  // everything 128 nats below their shift at e^-128: counted from the first bound (1,000) that floor
  // alone would be 10^6 e^872.
  const std::size_t lists = 50002;
  std::vector<double> ub(lists, 100.0);
  std::vector<std::uint32_t> live(lists, 20);
  ub[7] = 1000.0, live[7] = 2;
  ub[9] = 500.0;
  live[11] = 0, ub[11] = -std::numeric_limits<double>::infinity();  // an emptied list: not counted
  detail::ListWalk walk(ub.data(), live.data(), lists);
  const double rest_all = std::log(2.0) + 1000.0;
  CHECK(walk.log_rest() >= rest_all);
  CHECK(walk.next() == 7);
  CHECK(walk.log_rest() >= std::log(20.0) + 500.0);
  // (Lists far below the top wait cold, bounded by their bins: list 9's 20 rows at 500, the others'
  // 10^6 at most 128 nats below it, until the walk reaches them.)
  CHECK(walk.log_rest() <= std::log(20.0) + 500.0 + 0.26);
  CHECK(walk.next() == 9);
  const double rest = std::log(49999.0 * 20) + 100.0;  // (list 11 is empty)
  CHECK(walk.log_rest() >= rest);
  CHECK(walk.log_rest() <= rest + 0.126);  // each term rounded up by at most 1/8 nat
  CHECK(walk.next_bound() == 100.0);
  // The verdict on a budget uses the same buckets: 10 lists in reach leave the rest above e-12 of e^120.
  CHECK_FALSE(walk.can_meet(0, 1e-12, 10 * 20, 120.0, 120.0));
  CHECK(walk.can_meet(0, 1e-3, 10 * 20, 130.0, 130.0));
  CHECK(walk.rows_left() == 49999 * 20);
}

TEST_CASE("a walk over many hot lists heaps a few first and still visits every list in decreasing bound", "[pruning]") {
  // 20,000 lists within 16 nats of the top (spread attention: all hot), ties among them, one unbounded,
  // one emptied, and 500 cold ones far below. The walk heaps the highest few hundred at once and the rest
  // when it reaches them: the order is that of the pairs (bound, list) sorted down, every bound on the way
  // as next_bound() said, the rest's mass bounded as before, and unvisited() lists exactly the others.
  const std::size_t hot = 20000, lists = hot + 500;
  std::vector<double> ub(lists);
  std::vector<std::uint32_t> live(lists);
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> within(-15.9, 0.0);
  std::uniform_int_distribution<std::uint32_t> members(1, 40);
  for (std::size_t c = 0; c < lists; ++c) {
    ub[c] = c < hot ? std::round(within(gen) * 64) / 64 : -60.0 - static_cast<double>(c % 7);  // (ties: bounds on a 1/64 grid)
    live[c] = members(gen);
  }
  ub[3] = std::numeric_limits<double>::infinity();
  live[17] = 0;
  std::vector<std::pair<double, std::uint32_t>> order;
  for (std::size_t c = 0; c < lists; ++c)
    if (live[c] != 0) order.emplace_back(ub[c], static_cast<std::uint32_t>(c));
  std::sort(order.rbegin(), order.rend());
  detail::ListWalk walk(ub.data(), live.data(), lists);
  std::size_t left_rows = 0;
  for (const auto& entry : order) left_rows += live[entry.second];
  for (std::size_t i = 0; i < order.size(); ++i) {
    REQUIRE_FALSE(walk.done());
    if (i % 997 == 1 || i == 300) {  // the rest's bound against its exact mass (finite once list 3 is visited)
      long double exact = 0;
      for (std::size_t j = i; j < order.size(); ++j) exact += live[order[j].second] * std::exp(static_cast<long double>(order[j].first));
      const double log_exact = std::log(static_cast<double>(exact));
      CHECK(walk.log_rest() >= log_exact - 1e-12);
      CHECK(walk.log_rest() <= log_exact + 0.26);
      std::vector<std::pair<double, std::uint32_t>> rest;
      walk.unvisited(rest);
      std::sort(rest.rbegin(), rest.rend());
      CHECK(rest.size() == order.size() - i);
      CHECK(std::equal(rest.begin(), rest.end(), order.begin() + static_cast<std::ptrdiff_t>(i), order.end()));
      CHECK(walk.rows_left() == left_rows);
    }
    CHECK(walk.next_bound() == order[i].first);
    const std::size_t c = walk.next();
    REQUIRE(c == order[i].second);
    left_rows -= live[c];
  }
  CHECK(walk.done());
  // A verdict asked early heaps every list first and agrees with the walk that had them all at once: the
  // 100 lists in reach of 100 x 40 rows leave far more than 1e-6 of the rest.
  detail::ListWalk early(ub.data(), live.data(), lists);
  for (int i = 0; i < 5; ++i) CHECK(early.next() == order[static_cast<std::size_t>(i)].second);
  CHECK_FALSE(early.can_meet(0, 1e-6, 100 * 40, 1.0, 1.0));
  for (std::size_t i = 5; i < 1000; ++i) REQUIRE(early.next() == order[i].second);
}
