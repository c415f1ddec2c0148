// Numerics at the edges of float (issue 11, issue 10 items 7 and 9), on every kernel path: each
// defect as a regression test, and single vs batch as a property over random and adversarial inputs.
#include <catch2/catch.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>

#include "reference.hpp"
#include "kernel_paths.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"

using namespace softkv;

namespace {

constexpr float kFloatMax = std::numeric_limits<float>::max();

using test::ForcedPath;
using test::any_path;

// The code of the softkv::Error f throws, or nothing.
template <class F>
std::optional<ErrorCode> error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return std::nullopt;
}

std::vector<float> row_of(const std::vector<float>& m, std::size_t d, std::size_t i) {
  return {m.begin() + static_cast<std::ptrdiff_t>(i * d), m.begin() + static_cast<std::ptrdiff_t>((i + 1) * d)};
}

bool close(double got, double want, double rel) { return std::fabs(got - want) <= rel * std::max(1.0, std::fabs(want)); }

CollectionConfig with_index(IndexKind kind, std::size_t d, std::size_t dv, Metric metric = Metric::dot) {
  CollectionConfig c{d, dv, metric, {}, {}};
  c.index.kind = kind;
  c.index.ivf_train_size = 500;
  c.index.ivf_nlist = 8;
  c.index.hnsw_ef_construction = 40;
  return c;
}

// The softmax mass outside `candidates`, measured with the collection's own exact scan (every
// entry's weight as a contributor).
double omitted_mass(const Collection& c, const std::vector<float>& q, float scale, const std::set<std::uint64_t>& candidates) {
  const SoftResult all = c.query_soft(q, {.scale = scale, .top_m = c.size()});
  REQUIRE(all.top.size() == c.size());
  double omitted = 0;
  for (const Contributor& x : all.top)
    if (!candidates.contains(x.id)) omitted += std::exp(static_cast<double>(x.score) - all.lse);
  return omitted;
}

// Checks a flat pruned answer: its candidates are the true top k by (score, smaller id) of the
// exact scan, and the mass the exact scan puts outside them is within the bound.
void check_flat_bound(const Collection& c, const std::vector<float>& q, float scale, std::size_t k) {
  const SoftResult pruned = c.query_soft(q, {.scale = scale, .top_m = k, .top_k = k});
  REQUIRE(pruned.searched_with == IndexKind::flat);
  REQUIRE(pruned.tail_bound_guaranteed);
  REQUIRE(pruned.top.size() == k);
  std::set<std::uint64_t> candidates;
  for (const Contributor& x : pruned.top) candidates.insert(x.id);
  const SoftResult exact = c.query_soft(q, {.scale = scale, .top_m = k});
  std::set<std::uint64_t> best;
  for (const Contributor& x : exact.top) best.insert(x.id);
  CHECK(candidates == best);
  const double omitted = omitted_mass(c, q, scale, candidates);
  INFO("omitted " << omitted << ", bound " << pruned.tail_bound);
  CHECK(omitted <= pruned.tail_bound * (1 + 1e-6) + 1e-12);
}

}  // namespace

// ---- A: cosine normalisation of tiny and huge rows ------------------------------------------------

TEST_CASE("cosine normalises tiny, denormal and huge keys and queries to finite unit vectors", "[numerics]") {
  const ForcedPath path(any_path());
  Collection c({3, 1, Metric::cosine, {}});
  const std::vector<std::vector<float>> keys = {
      {1e-39f, 0, 0}, {0, 1e-45f, 0}, {0, 0, 3e38f}, {-3e38f, 3e38f, 0}, {1e-38f, -2e-38f, 2e-38f}};
  const auto ids = c.add_batch(std::vector<float>{1e-39f, 0, 0, 0, 1e-45f, 0, 0, 0, 3e38f, -3e38f, 3e38f, 0, 1e-38f, -2e-38f, 2e-38f},
                               std::vector<float>{1, 2, 3, 4, 5});
  for (std::size_t i = 0; i < keys.size(); ++i) {
    INFO("key " << i);
    const Entry e = c.get(ids[i]);
    double norm2 = 0, ref2 = 0, dot = 0;
    for (std::size_t j = 0; j < 3; ++j) {
      REQUIRE(std::isfinite(e.key[j]));
      norm2 += static_cast<double>(e.key[j]) * e.key[j];
      ref2 += static_cast<double>(keys[i][j]) * keys[i][j];
      dot += static_cast<double>(e.key[j]) * keys[i][j];
    }
    CHECK(std::fabs(norm2 - 1) <= 1e-6);
    CHECK(dot / std::sqrt(ref2) == Approx(1.0).epsilon(1e-6));  // same direction
  }
  // A tiny query means the same as its unit vector: the answer equals the unit query's.
  for (const float tiny : {1e-39f, 1e-45f, 3e38f}) {
    INFO("query scale " << tiny);
    const SoftResult got = c.query_soft(std::vector<float>{tiny, 0, 0}, {.scale = 4.0f});
    const SoftResult unit = c.query_soft(std::vector<float>{1, 0, 0}, {.scale = 4.0f});
    CHECK(got.lse == unit.lse);
    CHECK(got.value == unit.value);
    CHECK(c.query_hard(std::vector<float>{tiny, 0, 0}).id == ids[0]);
    const SoftBatchResult batch = c.query_soft_batch(std::vector<float>{tiny, 0, 0, 1, 0, 0}, {.scale = 4.0f});
    CHECK(close(batch.lse[0], batch.lse[1], 1e-6));
  }
}

TEST_CASE("a query that cannot be normalised gets invalid_argument on every query call", "[numerics][errors]") {
  Collection c({2, 1, Metric::cosine, {}});
  c.add(std::vector<float>{1, 0}, std::vector<float>{1});
  const std::vector<float> zero{0, 0};
  CHECK(error_of([&] { (void)c.query_soft(zero); }) == ErrorCode::invalid_argument);
  CHECK(error_of([&] { (void)c.query_hard(zero); }) == ErrorCode::invalid_argument);
  CHECK(error_of([&] { (void)c.query_soft_batch(std::vector<float>{1, 0, 0, 0}); }) == ErrorCode::invalid_argument);
  CHECK(error_of([&] { (void)c.query_hard_batch(std::vector<float>{1, 0, 0, 0}); }) == ErrorCode::invalid_argument);
  // A zero key is refused and nothing of its batch is stored.
  CHECK(error_of([&] { c.add_batch(std::vector<float>{1, 1, 0, 0}, std::vector<float>{2, 3}); }) == ErrorCode::invalid_argument);
  CHECK(c.size() == 1);
}

// ---- B: the blend of huge values --------------------------------------------------------------------

TEST_CASE("values near FLT_MAX / N blend to their representable answer, never inf", "[numerics]") {
  const ForcedPath path(any_path());
  struct Case {
    std::size_t n;
    float value;
  };
  for (const Case& k : {Case{2, 3e38f}, Case{1000, 1e37f}, Case{300, -kFloatMax}, Case{5000, 2e35f}}) {
    INFO("n = " << k.n << ", v = " << k.value);
    Collection c({2, 2, Metric::dot, {}, {.kind = IndexKind::flat}});
    std::vector<float> keys(k.n * 2, 1.0f), values(k.n * 2);
    for (std::size_t i = 0; i < k.n; ++i) values[2 * i] = k.value, values[2 * i + 1] = -k.value * 0.5f;
    c.add_batch(keys, values);
    const std::vector<float> q{1, 1};
    for (const SoftResult& r : {c.query_soft(q), c.query_soft(q, {.threads = 3}), c.query_soft(q, {.top_k = k.n / 2 + 1})}) {
      CHECK(r.value[0] == Approx(k.value).epsilon(1e-6));
      CHECK(r.value[1] == Approx(-k.value * 0.5f).epsilon(1e-6));
    }
    const SoftBatchResult b = c.query_soft_batch(std::vector<float>{1, 1, 0.5f, 0.5f});
    for (std::size_t i : {0u, 2u}) {
      CHECK(b.values[i] == Approx(k.value).epsilon(1e-6));
      CHECK(b.values[i + 1] == Approx(-k.value * 0.5f).epsilon(1e-6));
    }
  }
  // Mixed huge values with unequal weights against the double reference.
  const std::size_t n = 700, d = 4, dv = 3;
  auto keys = test::normal_floats(n * d, 5);
  auto values = test::normal_floats(n * dv, 6);
  for (float& v : values) v = std::clamp(v * 1.5e38f, -kFloatMax, kFloatMax);
  Collection c({d, dv, Metric::dot, 0.3f});
  c.add_batch(keys, values);
  const auto q = test::normal_floats(d, 7);
  const auto ref = test::soft_reference(q.data(), keys.data(), values.data(), n, d, dv, 0.3);
  const SoftResult r = c.query_soft(q);
  const SoftBatchResult b = c.query_soft_batch(q);
  for (std::size_t j = 0; j < dv; ++j) {
    CHECK(std::fabs(r.value[j] - ref.value[j]) <= 1e-4 * kFloatMax);
    CHECK(std::fabs(b.values[j] - ref.value[j]) <= 1e-4 * kFloatMax);
  }
}

// ---- C, D, issue 10 item 9: one scoring rule for single, batch and hard -----------------------------

TEST_CASE("q . k beyond the float range with a small scale answers, and unrepresentable scores fail the same everywhere",
          "[numerics]") {
  const ForcedPath path(any_path());
  Collection c({1, 1, Metric::dot, {}});
  c.add(std::vector<float>{1e20f}, std::vector<float>{10});
  c.add(std::vector<float>{2e20f}, std::vector<float>{20});
  const std::vector<float> q{1e20f};
  // True scores 1e40 and 2e40 at the default scale 1: no float holds them.
  CHECK(error_of([&] { (void)c.query_soft(q); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)c.query_hard(q); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)c.query_soft_batch(q); }) == ErrorCode::numeric_overflow);
  CHECK(error_of([&] { (void)c.query_hard_batch(q); }) == ErrorCode::numeric_overflow);
  // scale 1e-30: scores 1e10 and 2e10, representable; id 1 wins by a margin of 1e10.
  const QueryOptions small{.scale = 1e-30f};
  const HardResult h = c.query_hard(q, small);
  CHECK(h.id == 1);
  CHECK(h.score == Approx(2e10).epsilon(1e-6));
  const HardBatchResult hb = c.query_hard_batch(q, small);
  CHECK(hb.ids[0] == 1);
  CHECK(hb.scores[0] == h.score);
  const SoftResult s = c.query_soft(q, small);
  CHECK(s.lse == Approx(2e10).epsilon(1e-6));
  CHECK(s.value[0] == 20.0f);
  const SoftBatchResult sb = c.query_soft_batch(q, small);
  CHECK(sb.lse[0] == Approx(2e10).epsilon(1e-6));
  CHECK(sb.values[0] == 20.0f);
}

TEST_CASE("a huge scale with a huge query and a tiny key is not folded into an overflow", "[numerics]") {
  const ForcedPath path(any_path());
  Collection c({1, 1, Metric::dot, {}});
  c.add(std::vector<float>{1e-38f}, std::vector<float>{3});
  const std::vector<float> q{1e20f};
  const QueryOptions o{.scale = 1e20f};  // scale * q overflows; scale * (q . k) = 100
  CHECK(c.query_soft(q, o).lse == Approx(100).epsilon(1e-5));
  CHECK(c.query_soft_batch(q, o).lse[0] == Approx(100).epsilon(1e-5));
  CHECK(c.query_hard(q, o).score == Approx(100).epsilon(1e-5));
  CHECK(c.query_hard_batch(q, o).scores[0] == Approx(100).epsilon(1e-5));
}

TEST_CASE("hard retrieval with overflowing scores is numeric_overflow, exact, indexed and batched", "[numerics]") {
  const ForcedPath path(any_path());
  for (IndexKind kind : {IndexKind::exact, IndexKind::flat, IndexKind::hnsw}) {
    INFO("index " << static_cast<int>(kind));
    Collection c(with_index(kind, 4, 1));
    for (float x : {1e30f, 2e30f, -1e30f}) c.add(std::vector<float>(4, x), std::vector<float>{x});
    c.wait_until_indexed();
    const std::vector<float> q(4, 1e30f);
    CHECK(error_of([&] { (void)c.query_soft(q); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)c.query_hard(q); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)c.query_hard(q, {.exact = true}); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)c.query_hard_batch(q); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)c.query_soft_batch(q); }) == ErrorCode::numeric_overflow);
    // Scores that all fall below -FLT_MAX have no softmax and no argmax either.
    const std::vector<float> neg(4, -1e30f);
    Collection only_positive({4, 1, Metric::dot, {}});
    only_positive.add(std::vector<float>(4, 1e30f), std::vector<float>{1});
    CHECK(error_of([&] { (void)only_positive.query_soft(neg); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)only_positive.query_hard(neg); }) == ErrorCode::numeric_overflow);
    CHECK(error_of([&] { (void)only_positive.query_hard_batch(neg); }) == ErrorCode::numeric_overflow);
  }
}

// ---- E: the flat bound by construction ----------------------------------------------------------------

TEST_CASE("the flat tail bound holds on ill-conditioned scores (every q . k = 0 exactly)", "[numerics][pruning]") {
  const ForcedPath path(any_path());
  const std::size_t n = 200, d = 768;
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> magnitude(0.5e4f, 2e4f);
  std::vector<float> keys(n * d);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = magnitude(rng);
    float* k = keys.data() + i * d;
    for (std::size_t j = 0; j < d; ++j) k[j] = j < d / 2 ? x : -x;
    std::shuffle(k, k + d, rng);
  }
  Collection c({d, 2, Metric::dot, {}, {.kind = IndexKind::flat}});
  c.add_batch(keys, test::normal_floats(n * 2, 3));
  const std::vector<float> q(d, 1.0f);
  for (std::size_t k : {1u, 16u, 64u, 199u}) {
    INFO("k = " << k);
    check_flat_bound(c, q, 100.0f, k);
  }
}

TEST_CASE("the flat bound holds with ties, duplicates, cosine and removed entries", "[numerics][pruning]") {
  const ForcedPath path(any_path());
  const std::size_t d = 16, dv = 3, n = 400;
  for (Metric metric : {Metric::dot, Metric::cosine}) {
    INFO("metric " << static_cast<int>(metric));
    Collection c(with_index(IndexKind::flat, d, dv, metric));
    auto keys = test::normal_floats(n * d, 9);
    // 60 copies of one key (ties straddling every k below), ids not in row order.
    const auto best = test::normal_floats(d, 10, 3.0f);
    for (std::size_t i = 0; i < n; i += 7)
      if (i / 7 < 60) std::copy(best.begin(), best.end(), keys.begin() + static_cast<std::ptrdiff_t>(i * d));
    std::vector<std::uint64_t> ids(n);
    for (std::size_t i = 0; i < n; ++i) ids[i] = (i * 7919) % 1000 + 1;
    c.upsert_batch(ids, keys, test::normal_floats(n * dv, 11));
    for (std::size_t i = 0; i < n; i += 5) c.remove(ids[i]);  // tombstones everywhere
    for (float scale : {0.1f, 1.0f, 30.0f}) {
      for (std::size_t k : {1u, 7u, 16u, 59u, 100u}) {
        INFO("scale " << scale << ", k = " << k);
        check_flat_bound(c, best, scale, k);
        check_flat_bound(c, test::normal_floats(d, k), scale, k);
      }
    }
  }
}

// ---- F: ties to the smallest id through every index ---------------------------------------------------

TEST_CASE("hard retrieval breaks ties by the smallest id on every path, indexes included", "[numerics][indexes]") {
  const ForcedPath path(any_path());
  const std::size_t n = 1000, d = 8;
  auto keys = test::normal_floats(n * d, 21);
  std::vector<float> best(d, 0.0f);
  best[0] = 40.0f;
  std::set<std::uint64_t> tied;
  for (std::size_t i = 58; i < n && tied.size() < 50; i += 17) {
    std::copy(best.begin(), best.end(), keys.begin() + static_cast<std::ptrdiff_t>(i * d));
    tied.insert(i);
  }
  for (IndexKind kind : {IndexKind::exact, IndexKind::flat, IndexKind::hnsw, IndexKind::ivf}) {
    INFO("index " << static_cast<int>(kind));
    Collection c(with_index(kind, d, 1));
    c.add_batch(keys, std::vector<float>(n, 1.0f));  // ids = rows
    c.wait_until_indexed();
    const HardResult h = c.query_hard(best);
    CHECK(h.searched_with == (kind == IndexKind::flat ? IndexKind::exact : kind));
    CHECK(h.id == *tied.begin());
    CHECK(c.query_hard_batch(best).ids[0] == *tied.begin());
    if (kind != IndexKind::exact) {
      const SoftResult s = c.query_soft(best, {.top_m = 3, .top_k = 16});
      if (kind == IndexKind::flat)
        for (std::size_t i = 0; i < 3; ++i) CHECK(s.top[i].id == *std::next(tied.begin(), static_cast<std::ptrdiff_t>(i)));
    }
  }
}

// ---- issue 10 item 7: effort and top_m at the ends of their types ------------------------------------

TEST_CASE("ef_search, nprobe, top_k and top_m at the ends of their range are clamped, never wrong", "[numerics][indexes]") {
  const std::size_t n = 600, d = 8;
  const auto keys = test::normal_floats(n * d, 31);
  for (IndexKind kind : {IndexKind::hnsw, IndexKind::ivf}) {
    INFO("index " << static_cast<int>(kind));
    Collection c(with_index(kind, d, 2));
    c.add_batch(keys, test::normal_floats(n * 2, 32));
    c.wait_until_indexed();
    for (std::uint64_t effort : {std::uint64_t{1} << 31, (std::uint64_t{1} << 32) - 1, std::uint64_t{1} << 63,
                                 std::numeric_limits<std::uint64_t>::max()}) {
      INFO("effort " << effort);
      for (std::size_t i = 0; i < 5; ++i) {
        const auto q = test::normal_floats(d, 100 + i);
        const QueryOptions o{.ef_search = effort, .nprobe = effort};
        const HardResult exact = c.query_hard(q, {.exact = true});
        const HardResult indexed = c.query_hard(q, o);
        CHECK(indexed.searched_with == kind);
        CHECK(indexed.id == exact.id);  // the widest search is exhaustive
        CHECK(indexed.score == exact.score);
        QueryOptions pruned = o;
        pruned.top_k = 5;
        pruned.top_m = 5;
        const SoftResult s = c.query_soft(q, pruned);
        CHECK(s.candidates == 5);
        CHECK(s.top.front().id == exact.id);
      }
    }
  }
  Collection c({d, 2, Metric::dot, {}, {.kind = IndexKind::flat}});
  c.add_batch(keys, test::normal_floats(n * 2, 32));
  for (std::size_t m : {std::size_t{1} << 31, (std::size_t{1} << 31) - 1, std::numeric_limits<std::size_t>::max()}) {
    INFO("top_m " << m);
    const auto q = test::normal_floats(d, 7);
    CHECK(c.query_soft(q, {.top_m = m}).top.size() == n);
    CHECK(c.query_soft(q, {.top_m = m, .top_k = 10}).top.size() == 10);
    const SoftResult all = c.query_soft(q, {.top_m = m, .top_k = m});  // k >= N: the exact scan
    CHECK(all.candidates == n);
    CHECK(all.top.size() == n);
  }
}

TEST_CASE("an allocation failure during a query is resource_exhausted", "[numerics][errors]") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' allocators abort on a failed allocation instead of throwing std::bad_alloc.
  WARN("not run under a sanitizer");
  return;
#endif
  Collection c({64, 1, Metric::dot, {}});
  c.add(std::vector<float>(64, 1.0f), std::vector<float>{1});
  const std::vector<float> queries(std::size_t{64} << 20, 0.5f);  // 256 MiB of queries: the copy cannot fit
  std::size_t vm_kib = 0;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kib = std::stoul(line.substr(7));
  }
  REQUIRE(vm_kib > 0);
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_AS, &old) == 0);
  rlimit tight = old;
  tight.rlim_cur = (vm_kib + 64 * 1024) * 1024;  // 64 MiB of headroom
  if (old.rlim_max != RLIM_INFINITY && old.rlim_max < tight.rlim_cur) {
    WARN("the address-space limit is already lower than this test needs: not run");
    return;
  }
  REQUIRE(setrlimit(RLIMIT_AS, &tight) == 0);
  const auto code = error_of([&] { (void)c.query_soft_batch(queries); });
  const auto hard = error_of([&] { (void)c.query_hard_batch(queries); });
  setrlimit(RLIMIT_AS, &old);
  CHECK(code == ErrorCode::resource_exhausted);
  CHECK(hard == ErrorCode::resource_exhausted);
  CHECK(to_string(ErrorCode::resource_exhausted) == "resource_exhausted");
}

// ---- dot products beyond the float range with a representable score (outside probe, 2026-11-24) ----

namespace {

// The double reference of a multi-head soft query (heads = 1: the plain one): head j softmaxes
// scale * (q_j . k_j) over key slice j and blends value slice j.
struct HeadsReference {
  std::vector<double> value;            // dv
  std::vector<std::vector<double>> scores;  // heads x n
  std::vector<double> lse;              // heads
  std::vector<std::uint64_t> best;      // heads: argmax (ties to the smaller id)
  double slack = 0;                     // the most float rounding may move a score
};

HeadsReference heads_reference(const float* q, const std::vector<float>& keys, const std::vector<float>& values, std::size_t n,
                               std::size_t d, std::size_t dv, std::size_t heads, double scale) {
  const std::size_t dh = d / heads, dvh = dv / heads;
  HeadsReference ref;
  ref.value.assign(dv, 0.0);
  for (std::size_t j = 0; j < heads; ++j) {
    std::vector<double> s(n);
    double top = -std::numeric_limits<double>::infinity();
    std::uint64_t best = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double dot = 0, magnitude = 0;
      for (std::size_t t = j * dh; t < (j + 1) * dh; ++t) {
        dot += static_cast<double>(q[t]) * keys[i * d + t];
        magnitude += std::fabs(static_cast<double>(q[t]) * keys[i * d + t]);
      }
      s[i] = scale * dot;
      // A float sum in any order errs by (dh + 2) u of the sum of |products|; a sum redone in double
      // errs far less.
      ref.slack = std::max(ref.slack, scale * magnitude * static_cast<double>(dh + 2) * 0x1p-24);
      if (s[i] > top) top = s[i], best = i;
    }
    double z = 0;
    for (std::size_t i = 0; i < n; ++i) z += std::exp(s[i] - top);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t c = j * dvh; c < (j + 1) * dvh; ++c) ref.value[c] += std::exp(s[i] - top) / z * values[i * dv + c];
    ref.lse.push_back(top + std::log(z));
    ref.best.push_back(best);
    ref.scores.push_back(std::move(s));
  }
  return ref;
}

}  // namespace

TEST_CASE("dot products that leave the float range are summed again in double: every path answers as the float64 reference",
          "[numerics]") {
  const ForcedPath path(any_path());
  const Precision kp = GENERATE(Precision::f32, Precision::bf16, Precision::i8);
  const std::size_t heads = GENERATE(std::size_t{1}, std::size_t{2}, std::size_t{8});  // 8 x 32: the joint multi-head path
  INFO("key precision " << static_cast<int>(kp) << ", heads " << heads);
  // Keys up to FLT_MAX / 8 with random signs, query elements in [1, 2): most float sums q . k over a
  // slice leave the float range, upwards, downwards, or into NaN where the two meet; the scale FLT_MIN
  // brings every true score to within ~20 of 0.
  const std::size_t n = 48, d = 256, dv = 16;
  const float scale = std::numeric_limits<float>::min();
  std::mt19937_64 rng(2026 + heads);
  std::uniform_real_distribution<float> magnitude(0.25f, 1.0f), query(1.0f, 1.99f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> keys(n * d);
  for (float& k : keys) k = (negative(rng) ? -1.0f : 1.0f) * magnitude(rng) * (kFloatMax / 8);
  const std::vector<float> values = test::normal_floats(n * dv, 17);
  std::vector<float> queries(3 * d);
  for (float& x : queries) x = (negative(rng) ? -1.0f : 1.0f) * query(rng);
  CollectionConfig config{d, dv, Metric::dot, scale};
  config.key_precision = kp;
  config.heads = heads;
  Collection c(config);
  c.add_batch(keys, values);
  std::vector<float> stored(n * d);  // the keys as stored (rounded to bf16, quantised to i8): the reference's
  for (std::size_t i = 0; i < n; ++i) std::ranges::copy(c.get(i).key, stored.begin() + static_cast<std::ptrdiff_t>(i * d));
  std::size_t overflowing = 0;  // float sums that leave the range: the case under test must occur
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < heads; ++j) {
      float sum = 0;
      for (std::size_t t = j * (d / heads); t < (j + 1) * (d / heads); ++t) sum += queries[t] * stored[i * d + t];
      overflowing += std::isfinite(sum) ? 0 : 1;
    }
  }
  CHECK(overflowing >= n * heads / 8);

  const SoftBatchResult batch = c.query_soft_batch(queries);
  const HardBatchResult hard_batch = c.query_hard_batch(queries);
  for (std::size_t b = 0; b < 3; ++b) {
    INFO("query " << b);
    const std::span<const float> q(queries.data() + b * d, d);
    const HeadsReference ref = heads_reference(q.data(), stored, values, n, d, dv, heads, scale);
    const double tol = std::expm1(2 * ref.slack) * 3 + 1e-5;  // values are normal: |v| < ~3.5 here
    INFO("slack " << ref.slack);
    auto check_value = [&](std::span<const float> value) {
      REQUIRE(value.size() == dv);
      for (std::size_t c2 = 0; c2 < dv; ++c2) CHECK(std::fabs(value[c2] - ref.value[c2]) <= tol);
    };
    // Soft: single, split over threads, with contributors, in a batch.
    for (std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
      const SoftResult s = c.query_soft(q, {.top_m = 4, .threads = threads});
      check_value(s.value);
      CHECK(std::fabs(s.lse - ref.lse[0]) <= ref.slack + 1e-5);
      for (const Contributor& t : s.top) CHECK(std::isfinite(t.score));
      if (heads == 1) {
        REQUIRE(s.top.size() == 4);
        CHECK(std::fabs(s.top[0].score - ref.scores[0][s.top[0].id]) <= ref.slack + 1e-5);
      } else {
        REQUIRE(s.heads.size() == heads);
        for (std::size_t j = 0; j < heads; ++j) CHECK(std::fabs(s.heads[j].lse - ref.lse[j]) <= ref.slack + 1e-5);
      }
    }
    check_value(std::span<const float>(batch.values).subspan(b * dv, dv));
    CHECK(std::fabs(batch.lse[b] - ref.lse[0]) <= ref.slack + 1e-5);
    // Hard: the winner's true score within rounding of the best, single and batched.
    const HardResult h = c.query_hard(q);
    for (std::size_t j = 0; j < heads; ++j) {
      const std::uint64_t id = heads == 1 ? h.id : h.head_ids[j];
      const std::uint64_t in_batch = heads == 1 ? hard_batch.ids[b] : hard_batch.head_ids[b * heads + j];
      CHECK(ref.scores[j][id] >= ref.scores[j][ref.best[j]] - 2 * ref.slack);
      CHECK(ref.scores[j][in_batch] >= ref.scores[j][ref.best[j]] - 2 * ref.slack);
    }
    // A mask (the masked scans' own walks): the best row of head 0 excluded.
    const std::uint64_t best = ref.best[0];
    const HardResult masked_hard = c.query_hard(q, {.exclude_ids = {best}});
    CHECK((heads == 1 ? masked_hard.id : masked_hard.head_ids[0]) != best);
    const SoftResult masked = c.query_soft(q, {.top_m = 2, .exclude_ids = {best}});
    for (const Contributor& t : masked.top) CHECK(t.id != best);
    CHECK(std::isfinite(masked.lse));
    CHECK(masked.lse <= ref.lse[0] + ref.slack + 1e-5);
  }
  if (heads == 1) {  // the flat index's fused score + top-k pass: every row a candidate
    CollectionConfig flat = config;
    flat.index.kind = IndexKind::flat;
    Collection f(flat);
    f.add_batch(keys, values);
    const HeadsReference ref = heads_reference(queries.data(), stored, values, n, d, dv, 1, scale);
    const SoftResult s = f.query_soft(std::span<const float>(queries.data(), d), {.top_k = n});
    for (std::size_t c2 = 0; c2 < dv; ++c2) CHECK(std::fabs(s.value[c2] - ref.value[c2]) <= std::expm1(2 * ref.slack) * 3 + 1e-5);
  }
}

TEST_CASE("a dot product that overflows downwards where the scale makes the score representable keeps its weight",
          "[numerics]") {
  // The outside probe's case: scale 1e-37, rows of 64 x 5.0e36 and 64 x 5.4e36, a query of -1s. Each
  // float sum passes -FLT_MAX, the scores are -32 and -34.56: weights 0.928 and 0.072, not 1 and 0.
  const ForcedPath path(any_path());
  Collection c({64, 1, Metric::dot, 1e-37f});
  c.add(std::vector<float>(64, 5.0e36f), std::vector<float>{1});
  c.add(std::vector<float>(64, 5.4e36f), std::vector<float>{0});
  const std::vector<float> q(64, -1.0f);
  const double scale = static_cast<double>(1e-37f);
  const double s0 = -scale * 64 * static_cast<double>(5.0e36f), s1 = -scale * 64 * static_cast<double>(5.4e36f);
  const double w0 = 1 / (1 + std::exp(s1 - s0));
  const SoftResult r = c.query_soft(q, {.top_m = 2});
  CHECK(r.value[0] == Approx(w0).epsilon(1e-5));
  REQUIRE(r.top.size() == 2);
  CHECK(r.top[1].id == 1);
  CHECK(r.top[1].weight == Approx(1 - w0).epsilon(1e-4));
  CHECK(r.top[1].score == Approx(s1).epsilon(1e-6));
  CHECK(c.query_soft_batch(q).values[0] == Approx(w0).epsilon(1e-5));
  CHECK(c.query_hard(q).id == 0);
  CHECK(c.query_hard(q).score == Approx(s0).epsilon(1e-6));
  // The other way up the same sums overflow upwards: scores +32 and +34.56, representable as well.
  const std::vector<float> up(64, 1.0f);
  CHECK(c.query_hard(up).id == 1);
  CHECK(c.query_soft(up).value[0] == Approx(1 - w0).epsilon(1e-4));
  CHECK(c.query_hard_batch(up).ids[0] == 1);
}

TEST_CASE("blocks, thread parts and masked runs whose every score is below -FLT_MAX weigh 0, not NaN", "[numerics]") {
  // 256 rows (a whole block) scoring -6e38 before the one row scoring 3e38: the soft answer is that
  // row's value, on every path; the outside probe found numeric_overflow here (exp(-inf - -inf)).
  const ForcedPath path(any_path());
  Collection c({1, 1, Metric::dot, 3e38f});
  std::vector<float> keys(257, -2.0f), values(257, 0.0f);
  keys[256] = 1.0f, values[256] = 1.0f;
  c.add_batch(keys, values);
  const std::vector<float> q{1.0f};
  for (std::size_t threads : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
    INFO("threads " << threads);
    const SoftResult r = c.query_soft(q, {.top_m = 2, .threads = threads});
    CHECK(r.value[0] == 1.0f);
    CHECK(r.lse == Approx(3e38).epsilon(1e-6));
    REQUIRE(r.top.size() == 2);
    CHECK(r.top[0].id == 256);
    CHECK(r.top[1].weight == 0.0f);
    CHECK(r.top[1].score == -std::numeric_limits<float>::infinity());
  }
  CHECK(c.query_soft(q, {.exclude_ids = {3}}).value[0] == 1.0f);  // the masked walk
  const SoftBatchResult b = c.query_soft_batch(std::vector<float>{1.0f, 1.0f});
  CHECK(b.values[0] == 1.0f);
  CHECK(b.values[1] == 1.0f);
  // Two rows, two parts: the second part holds only the row below -FLT_MAX.
  Collection two({1, 1, Metric::dot, 3e38f});
  two.add_batch(std::vector<float>{1.0f, -2.0f}, std::vector<float>{1.0f, 2.0f});
  CHECK(two.query_soft(q, {.threads = 2}).value[0] == 1.0f);
  // Multi-head: head 1's first block is all below -FLT_MAX, head 0's is not.
  CollectionConfig heads{2, 2, Metric::dot, 3e38f};
  heads.heads = 2;
  Collection h(heads);
  std::vector<float> hk(2 * 257), hv(2 * 257, 0.0f);
  for (std::size_t i = 0; i < 257; ++i) hk[2 * i] = 1.0f, hk[2 * i + 1] = i < 256 ? -2.0f : 1.0f;
  hv[2 * 256 + 1] = 1.0f;
  h.add_batch(hk, hv);
  const SoftResult hr = h.query_soft(std::vector<float>{1.0f, 1.0f});
  CHECK(hr.value[0] == 0.0f);
  CHECK(hr.value[1] == 1.0f);
  CHECK(h.query_soft_batch(std::vector<float>{1.0f, 1.0f}).values[1] == 1.0f);
}

TEST_CASE("a batch whose float blend overflows is blended again in double with its own max, not NaN", "[numerics]") {
  // Values near FLT_MAX and scores near 1e30: the batch kernel's scores round differently from the
  // single-query kernel's that the double pass uses, so the batch's max cannot shift those (the outside
  // probe found NaN values on the batch and coalesced paths).
  const ForcedPath path(any_path());
  const std::size_t d = 64;
  const auto k = test::normal_floats(d, 41);
  auto q = test::normal_floats(d, 42);
  double dot = 0;
  for (std::size_t i = 0; i < d; ++i) dot += double(q[i]) * k[i];
  if (dot < 0)
    for (float& x : q) x = -x, dot = -dot;
  const float scale = static_cast<float>(1e30 / std::fabs(dot));
  Collection c({d, 1, Metric::dot, scale});
  std::vector<float> keys(3 * d), values{0.9f * kFloatMax, 0.9f * kFloatMax, -0.5f * kFloatMax};
  for (std::size_t r = 0; r < 2; ++r) std::copy(k.begin(), k.end(), keys.begin() + static_cast<std::ptrdiff_t>(r * d));
  for (std::size_t i = 0; i < d; ++i) keys[2 * d + i] = -k[i];  // scores -1e30: weight 0
  c.add_batch(keys, values);
  std::vector<float> two(q);
  two.insert(two.end(), q.begin(), q.end());
  CHECK(c.query_soft(q).value[0] == Approx(0.9f * kFloatMax).epsilon(1e-6));
  const SoftBatchResult b = c.query_soft_batch(two);
  CHECK(b.values[0] == Approx(0.9f * kFloatMax).epsilon(1e-6));
  CHECK(b.values[1] == Approx(0.9f * kFloatMax).epsilon(1e-6));
  const SoftBatchResult masked = c.query_soft_batch(two, {.exclude_ids = {2}});
  CHECK(masked.values[0] == Approx(0.9f * kFloatMax).epsilon(1e-6));
}

TEST_CASE("the flat tail bound is 0, not NaN, when the k-th candidate scores below -FLT_MAX", "[numerics][pruning]") {
  const ForcedPath path(any_path());
  Collection c(with_index(IndexKind::flat, 1, 1));
  c.add_batch(std::vector<float>{1, -2, -3, -4}, std::vector<float>{1, 2, 3, 4});
  const SoftResult r = c.query_soft(std::vector<float>{1.0f}, {.scale = 3e38f, .top_k = 3});
  CHECK(r.tail_bound == 0.0);
  CHECK(r.value[0] == 1.0f);
}

namespace {

// n floats of random sign and magnitude in [1e37, 4e37]: keys whose products overflow float sums.
std::vector<float> keys_near_flt_max(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.25f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> keys(n);
  for (float& k : keys) k = (negative(rng) ? -1.0f : 1.0f) * magnitude(rng) * 4e37f;
  return keys;
}

}  // namespace

TEST_CASE("hnsw and ivf over keys near FLT_MAX build, search and persist without overflow", "[numerics][pruning]") {
  // FAISS sums in float: on keys of 1e37 its k-means aborted the process (outside probe) and HNSW's
  // inner products overflowed. It now gets the keys times a power of two; the answers must be those
  // of the exact scan when the search visits everything.
  const std::size_t n = 600, d = 8;
  const std::vector<float> keys = keys_near_flt_max(n * d, 77);
  std::vector<float> values(n);
  std::iota(values.begin(), values.end(), 0.0f);
  std::vector<float> q(keys.begin() + 123 * d, keys.begin() + 124 * d);  // row 123's own direction
  for (float& x : q) x /= 4e37f;
  std::size_t best = 0;
  double top = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < d; ++j) s += double(q[j]) * keys[i * d + j];
    if (s > top) top = s, best = i;
  }
  const float scale = static_cast<float>(20.0 / top);  // the best score is 20
  // ivf; hnsw (its certified lists answer soft queries, the graph hard ones); hnsw's graph alone (lists never trained).
  for (const auto& [kind, graph_only] : {std::pair{IndexKind::ivf, false}, std::pair{IndexKind::hnsw, false}, std::pair{IndexKind::hnsw, true}}) {
    INFO("index " << static_cast<int>(kind) << (graph_only ? ", graph alone" : ""));
    const IndexKind soft_kind = graph_only ? IndexKind::hnsw : IndexKind::ivf;
    test::TempDir dir;
    CollectionConfig config = with_index(kind, d, 1);
    if (graph_only) config.index.ivf_train_size = ConfigLimits::kMaxIvfTrainSize;
    config.scale = scale;
    {
      Database db(dir.path);
      db.create_collection("c", config);
      db.add("c", keys, values);
      const auto c = db.collection("c");
      c->wait_until_indexed();
      const QueryOptions wide{.top_k = 20, .ef_search = n, .nprobe = 8};
      const SoftResult pruned = c->query_soft(q, wide);
      CHECK(pruned.searched_with == soft_kind);
      CHECK(pruned.top.empty());
      const SoftResult exact = c->query_soft(q, {.top_m = 20});
      std::set<std::uint64_t> want;
      for (const Contributor& t : exact.top) want.insert(t.id);
      const SoftResult listed = c->query_soft(q, {.top_m = 20, .top_k = 20, .ef_search = n, .nprobe = 8});
      std::set<std::uint64_t> got;
      for (const Contributor& t : listed.top) got.insert(t.id);
      CHECK(got == want);  // the index found the exact top 20
      CHECK(c->query_hard(q, {.ef_search = n, .nprobe = 8}).id == best);
      db.snapshot();
    }
    Database again(dir.path);  // the index (and the scaling FAISS holds it at) loads from the snapshot
    const auto c = again.collection("c");
    CHECK(c->query_hard(q, {.ef_search = n, .nprobe = 8}).id == best);
    CHECK(c->query_soft(q, {.top_k = 20, .ef_search = n, .nprobe = 8}).searched_with == soft_kind);
  }
  // IVF built on keys of ~1e30, then rows 1000 times larger added: still inside what FAISS is given
  // unclamped (2^20 times the largest element built on), so a search of every list finds the exact top 20.
  CollectionConfig config = with_index(IndexKind::ivf, d, 1);
  config.scale = 1e-30f;
  Collection c(config);
  std::vector<float> small(keys), large(keys.begin(), keys.begin() + 300 * d);
  for (float& x : small) x *= 1e30f / 4e37f;
  for (float& x : large) x *= 1e33f / 4e37f * 0.999f;
  c.add_batch(small, values);
  c.wait_until_indexed();
  c.add_batch(large, std::vector<float>(300, -1.0f));
  const SoftResult exact = c.query_soft(q, {.top_m = 20});
  const SoftResult listed = c.query_soft(q, {.top_m = 20, .top_k = 20, .nprobe = 8});
  CHECK(listed.searched_with == IndexKind::ivf);
  REQUIRE(listed.top.size() == 20);
  for (std::size_t i = 0; i < 20; ++i) CHECK(listed.top[i].id == exact.top[i].id);
}

TEST_CASE("a pruned query whose scale and elements are both tiny reaches hnsw and ivf far from unit size and still finds the exact top 20", "[numerics][pruning]") {
  // scale 1e-30 and query elements near 1e-30: the split that keeps the scale factor normal stops at
  // 2^26 times the query, so the query the index gets is ~1e-22, not in [1, 2); keys near 4e37 keep
  // the scores (~1e-22) finite and distinct. A search that visits everything must find the exact top 20.
  const std::size_t n = 600, d = 8;
  const std::vector<float> keys = keys_near_flt_max(n * d, 91);
  std::vector<float> values(n);
  std::iota(values.begin(), values.end(), 0.0f);
  std::vector<float> q(keys.begin() + 321 * d, keys.begin() + 322 * d);
  for (float& x : q) x = x / 4e37f * 1e-30f;  // (1e-30f / 4e37f would underflow to 0)
  std::vector<std::pair<double, std::uint64_t>> by_score;  // the double reference ranking
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < d; ++j) s += double(q[j]) * keys[i * d + j];
    by_score.emplace_back(s, i);
  }
  std::sort(by_score.begin(), by_score.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::set<std::uint64_t> want;
  for (std::size_t i = 0; i < 20; ++i) want.insert(by_score[i].second);
  for (IndexKind kind : {IndexKind::ivf, IndexKind::hnsw}) {
    INFO("index " << static_cast<int>(kind));
    CollectionConfig config = with_index(kind, d, 1);
    config.scale = 1e-30f;
    Collection c(config);
    c.add_batch(keys, values);
    c.wait_until_indexed();
    const SoftResult exact = c.query_soft(q, {.top_m = 20});
    REQUIRE(std::isfinite(exact.lse));
    REQUIRE(exact.max_score > 0.0f);
    REQUIRE(exact.max_score < 1e-15f);  // the scores really are tiny
    const SoftResult listed = c.query_soft(q, {.top_m = 20, .top_k = 20, .ef_search = n, .nprobe = 8});
    CHECK(listed.searched_with == IndexKind::ivf);  // hnsw too: its certified lists
    std::set<std::uint64_t> got;
    for (const Contributor& t : listed.top) got.insert(t.id);
    CHECK(got == want);
    if (kind == IndexKind::hnsw) {  // and its graph alone (lists that never train)
      config.index.ivf_train_size = ConfigLimits::kMaxIvfTrainSize;
      Collection g(config);
      g.add_batch(keys, values);
      g.wait_until_indexed();
      const SoftResult graph = g.query_soft(q, {.top_m = 20, .top_k = 20, .ef_search = n});
      CHECK(graph.searched_with == IndexKind::hnsw);
      got.clear();
      for (const Contributor& t : graph.top) got.insert(t.id);
      CHECK(got == want);
    }
    CHECK(c.query_hard(q, {.ef_search = n, .nprobe = 8}).id == by_score[0].second);
  }
}
