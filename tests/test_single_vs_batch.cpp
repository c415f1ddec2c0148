// Property: a single query, the same query in a batch, and the double-precision reference agree to
// float rounding, or single and batch fail with the same typed error (issue 11), on every kernel
// path, over random inputs spanning the float range and adversarial ones (cancellation, ties,
// denormals, values near FLT_MAX, scores below -FLT_MAX).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>

#include "reference.hpp"
#include "kernel_paths.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;

namespace {

constexpr double kFloatMax = std::numeric_limits<float>::max();
constexpr double kUnit = 1.0 / (1 << 24);  // float's unit roundoff

using test::ForcedPath;
using test::any_path;

float clamp_float(double x) { return static_cast<float>(std::clamp(x, -kFloatMax, kFloatMax)); }

// One generated input: n entries, nq queries, a scale.
struct Input {
  std::string name;
  std::size_t n = 0, d = 0, dv = 0, nq = 3;
  float scale = 1;
  std::vector<float> keys, values, queries;
};

// Each query's reference: exact scores, and how far float rounding may move each of them.
struct Expectation {
  test::SoftReference ref;
  double slack = 0;           // max over rows of the score error float rounding allows
  bool overflow = false;      // the answer is certainly unrepresentable
  bool ambiguous = false;     // rounding decides whether it is representable: not checked
};

// The factor split_scale gives this query (the documented rule: the query's largest |q_i| brought
// near 1 by a power of two, clamped so that scale * 2^e stays a normal float).
double score_factor(const float* q, std::size_t d, float scale) {
  double largest = 0;
  for (std::size_t j = 0; j < d; ++j) largest = std::max(largest, std::fabs(static_cast<double>(q[j])));
  if (largest == 0) return scale;
  const int scale_exp = std::ilogb(static_cast<double>(scale));
  return std::ldexp(static_cast<double>(scale), std::clamp(std::ilogb(largest), -126 - scale_exp, 127 - scale_exp));
}

Expectation expect(const Input& in, std::size_t b) {
  const float* q = in.queries.data() + b * in.d;
  const double factor = score_factor(q, in.d, in.scale);
  Expectation e;
  e.ref = test::soft_reference(q, in.keys.data(), in.values.data(), in.n, in.d, in.dv, in.scale);
  double top_low = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < in.n; ++i) {
    double magnitude = 0, key_l1 = 0;
    for (std::size_t j = 0; j < in.d; ++j) {
      magnitude += std::fabs(static_cast<double>(q[j]) * in.keys[i * in.d + j]);
      key_l1 += std::fabs(static_cast<double>(in.keys[i * in.d + j]));
    }
    // Dot products in any order: (d + 2) u of the sum of |products|, plus the scaling's rounding;
    // products and split query elements that fall among the denormals lose up to 2^-149 each.
    const double denormals = factor * std::ldexp(static_cast<double>(in.d) + key_l1, -149);
    const double slack = in.scale * magnitude * (static_cast<double>(in.d) + 2) * kUnit + denormals + 1e-30;
    e.slack = std::max(e.slack, slack);
    top_low = std::max(top_low, e.ref.scores[i] - slack);
  }
  const double top_high = e.ref.max_score + e.slack;
  e.overflow = top_low > kFloatMax * 1.01 || top_high < -kFloatMax * 1.01;
  e.ambiguous = !e.overflow && (top_high > kFloatMax * 0.99 || top_low < -kFloatMax * 0.99);
  return e;
}

template <class F>
std::optional<ErrorCode> error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return std::nullopt;
}

// A soft answer (one query) against its reference.
void check_soft(const Expectation& e, double lse, float max_score, const float* value, const Input& in) {
  CHECK(std::fabs(lse - e.ref.lse) <= e.slack + 1e-6 * std::fabs(e.ref.lse) + 2e-5);
  CHECK(std::fabs(max_score - e.ref.max_score) <= e.slack + 1e-6 * std::fabs(e.ref.max_score) + 1e-30);
  // The weights move by at most a factor e^{+-2 slack}; the blend adds N u of rounding.
  double vmax = 0;
  for (float v : in.values) vmax = std::max(vmax, std::fabs(static_cast<double>(v)));
  const double tol = (std::expm1(std::min(2 * e.slack, 700.0)) + 1e-4) * vmax;
  for (std::size_t j = 0; j < in.dv; ++j) {
    REQUIRE(std::isfinite(value[j]));
    CHECK(std::fabs(value[j] - e.ref.value[j]) <= tol);
    double lo = kFloatMax, hi = -kFloatMax;  // a blend stays inside the values' range
    for (std::size_t i = 0; i < in.n; ++i) lo = std::min(lo, double(in.values[i * in.dv + j])), hi = std::max(hi, double(in.values[i * in.dv + j]));
    CHECK(value[j] >= lo - 1e-6 * vmax);
    CHECK(value[j] <= hi + 1e-6 * vmax);
  }
}

// A hard answer against its reference: the winner's true score is within rounding of the best.
void check_hard(const Expectation& e, std::uint64_t id, float score) {
  REQUIRE(id < e.ref.scores.size());
  CHECK(e.ref.scores[id] >= e.ref.max_score - 2 * e.slack - 1e-6 * std::fabs(e.ref.max_score));
  CHECK(std::fabs(score - e.ref.scores[id]) <= e.slack + 1e-6 * std::fabs(e.ref.scores[id]) + 1e-30);
}

void run(const Input& in) {
  INFO("case " << in.name << ", n " << in.n << ", d " << in.d << ", scale " << in.scale);
  Collection c({in.d, in.dv, Metric::dot, {}});
  c.add_batch(in.keys, in.values);  // ids 0..n-1 = rows of the reference
  const QueryOptions o{.scale = in.scale};
  std::vector<Expectation> expected;
  std::optional<ErrorCode> first_soft_error, first_hard_error;
  bool any_ambiguous = false;
  for (std::size_t b = 0; b < in.nq; ++b) {
    INFO("query " << b);
    expected.push_back(expect(in, b));
    const Expectation& e = expected.back();
    any_ambiguous = any_ambiguous || e.ambiguous;
    const std::vector<float> q(in.queries.begin() + static_cast<std::ptrdiff_t>(b * in.d),
                               in.queries.begin() + static_cast<std::ptrdiff_t>((b + 1) * in.d));
    std::optional<SoftResult> soft;
    std::optional<HardResult> hard;
    const auto soft_error = error_of([&] { soft = c.query_soft(q, o); });
    const auto hard_error = error_of([&] { hard = c.query_hard(q, o); });
    if (!first_soft_error) first_soft_error = soft_error;
    if (!first_hard_error) first_hard_error = hard_error;
    CHECK(soft_error == hard_error);  // one rule for soft and hard
    if (e.ambiguous) continue;
    if (e.overflow) {
      CHECK(soft_error == ErrorCode::numeric_overflow);
      continue;
    }
    REQUIRE_FALSE(soft_error);
    check_soft(e, soft->lse, soft->max_score, soft->value.data(), in);
    check_hard(e, hard->id, hard->score);
  }
  std::optional<SoftBatchResult> soft;
  std::optional<HardBatchResult> hard;
  const auto soft_error = error_of([&] { soft = c.query_soft_batch(in.queries, o); });
  const auto hard_error = error_of([&] { hard = c.query_hard_batch(in.queries, o); });
  if (any_ambiguous) return;
  // A batch fails as its first failing query does, and answers as each single query does.
  CHECK(soft_error == first_soft_error);
  CHECK(hard_error == first_hard_error);
  if (soft_error || hard_error) return;
  for (std::size_t b = 0; b < in.nq; ++b) {
    INFO("batch query " << b);
    check_soft(expected[b], soft->lse[b], soft->max_score[b], soft->values.data() + b * in.dv, in);
    check_hard(expected[b], hard->ids[b], hard->scores[b]);
  }
}

Input random_input(std::mt19937_64& rng, int key_exp, int query_exp, int scale_exp) {
  Input in;
  in.name = "random 1e" + std::to_string(key_exp) + " 1e" + std::to_string(query_exp) + " 1e" + std::to_string(scale_exp);
  const std::size_t ns[] = {1, 2, 17, 300};
  const std::size_t ds[] = {1, 3, 8, 33};
  in.n = ns[rng() % 4];
  in.d = ds[rng() % 4];
  in.dv = 1 + rng() % 5;
  in.scale = static_cast<float>(std::pow(10.0, scale_exp));
  std::normal_distribution<double> normal;
  for (std::size_t i = 0; i < in.n * in.d; ++i) in.keys.push_back(clamp_float(normal(rng) * std::pow(10.0, key_exp)));
  for (std::size_t i = 0; i < in.nq * in.d; ++i) in.queries.push_back(clamp_float(normal(rng) * std::pow(10.0, query_exp)));
  const double value_exp = (rng() % 2 == 0) ? 0.0 : 37.0;
  for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(clamp_float(normal(rng) * std::pow(10.0, value_exp)));
  return in;
}

}  // namespace

TEST_CASE("single and batched queries agree with the reference across the float range", "[numerics][property]") {
  const ForcedPath path(any_path());
  std::mt19937_64 rng(2026);
  for (int key_exp : {-38, -30, -20, -5, 0, 5, 20, 30})
    for (int query_exp : {-30, -10, 0, 10, 30})
      for (int scale_exp : {-30, -10, 0, 10, 30}) run(random_input(rng, key_exp, query_exp, scale_exp));
}

TEST_CASE("single and batched queries agree on adversarial inputs", "[numerics][property]") {
  const ForcedPath path(any_path());
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  for (float scale : {1e-30f, 1e-3f, 1.0f, 100.0f, 1e20f}) {
    {  // cancellation: every q . k is 0 exactly, the float sums are noise
      Input in{"cancellation", 64, 96, 2, 2, scale, {}, {}, {}};
      for (std::size_t i = 0; i < in.n; ++i) {
        std::vector<float> k(in.d);
        for (std::size_t j = 0; j < in.d; ++j) k[j] = (j % 2 == 0 ? 1e4f : -1e4f) * (1 + static_cast<float>(i) / 64);
        std::shuffle(k.begin(), k.end(), rng);
        in.keys.insert(in.keys.end(), k.begin(), k.end());
      }
      in.queries.assign(in.nq * in.d, 1.0f);
      for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(normal(rng));
      run(in);
    }
    {  // ties: every key equal, values differ
      Input in{"ties", 50, 4, 3, 3, scale, std::vector<float>(200, 0.5f), {}, {}};
      for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(normal(rng));
      for (std::size_t i = 0; i < in.nq * in.d; ++i) in.queries.push_back(normal(rng));
      run(in);
    }
    {  // denormal keys and queries
      Input in{"denormals", 40, 5, 2, 3, scale, {}, {}, {}};
      for (std::size_t i = 0; i < in.n * in.d; ++i) in.keys.push_back(normal(rng) * 1e-41f);
      for (std::size_t i = 0; i < in.nq * in.d; ++i) in.queries.push_back(normal(rng) * 1e-42f);
      for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(normal(rng));
      run(in);
    }
    {  // values at FLT_MAX: the float accumulator overflows, the answer does not
      Input in{"huge values", 300, 6, 2, 3, scale, {}, {}, {}};
      for (std::size_t i = 0; i < in.n * in.d; ++i) in.keys.push_back(normal(rng) * 1e-3f);
      for (std::size_t i = 0; i < in.nq * in.d; ++i) in.queries.push_back(normal(rng));
      for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(i % 2 == 0 ? 3.3e38f : -3.3e38f * std::min(std::fabs(normal(rng)) / 4, 1.0f));
      run(in);
    }
    {  // some scores far below -FLT_MAX (weight 0, never the argmax), the rest ordinary
      Input in{"below -FLT_MAX", 30, 4, 2, 2, scale, {}, {}, {}};
      for (std::size_t i = 0; i < in.n * in.d; ++i) in.keys.push_back(i < 10 * in.d ? -3e38f : normal(rng));
      in.queries.assign(in.nq * in.d, 1e10f);
      for (std::size_t i = 0; i < in.n * in.dv; ++i) in.values.push_back(normal(rng));
      run(in);
    }
  }
}
