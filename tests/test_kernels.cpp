// Every kernel path (scalar, sse2, avx2, avx512 where the CPU has them) against a double reference.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "reference.hpp"
#include "scan.hpp"
#include "simd/int_dots.hpp"
#include "simd/kernel_table.hpp"
#include "query/pass_choice.hpp"
#include "simd/tile_gemm.hpp"
#include "softkv/error.hpp"
#include "softkv/simd.hpp"

using namespace softkv;
using namespace softkv::detail;

namespace {

const std::vector<std::size_t> kDims = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 31, 33, 127, 128, 129, 384, 768};

// Owns a random collection slice and its span.
struct Rows {
  std::size_t n, d, dv;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> ids;
  Rows(std::size_t n_, std::size_t d_, std::size_t dv_, std::uint64_t seed)
      : n(n_), d(d_), dv(dv_), keys(test::normal_floats(n_ * d_, seed)), values(test::normal_floats(n_ * dv_, seed + 1)),
        ids(n_) {
    std::iota(ids.begin(), ids.end(), 0);
  }
  [[nodiscard]] RowSpan span() const { return {keys.data(), values.data(), ids.data(), n, d, dv}; }
};

std::vector<const KernelTable*> all_paths() {
  std::vector<const KernelTable*> tables;
  for (std::string_view name : available_simd_paths()) tables.push_back(kernels_named(name));
  return tables;
}

// Checks a merged soft state against the double reference.
void check_soft(const SoftmaxState& st, const test::SoftReference& ref, double value_scale) {
  const double lse = st.lse();
  REQUIRE(std::isfinite(lse));
  CHECK(std::fabs(lse - ref.lse) <= 1e-4 * std::max(1.0, std::fabs(ref.lse)));
  CHECK(std::fabs(st.max - ref.max_score) <= 1e-4 * std::max(1.0, std::fabs(ref.max_score)));
  double err = 0;
  for (std::size_t j = 0; j < ref.value.size(); ++j) err = std::max(err, std::fabs(st.acc[j] / st.sum - ref.value[j]));
  CHECK(err <= 1e-4 * value_scale);
}

}  // namespace

TEST_CASE("the scalar path and the CPU's widest path are available", "[kernels]") {
  const auto paths = available_simd_paths();
  REQUIRE(paths.front() == "scalar");
  CHECK(kernels_named("scalar") != nullptr);
  CHECK(kernels_named("no-such-path") == nullptr);
  CHECK(std::find(paths.begin(), paths.end(), simd_path()) != paths.end());
}

TEST_CASE("dot matches the double reference for every dimension and path", "[kernels]") {
  for (const KernelTable* k : all_paths()) {
    for (std::size_t d : kDims) {
      INFO("path " << k->name << ", d = " << d);
      const auto a = test::normal_floats(d, 11 + d);
      const auto b = test::normal_floats(d, 12 + d);
      double ref = 0, mag = 0;
      for (std::size_t i = 0; i < d; ++i) ref += static_cast<double>(a[i]) * b[i], mag += std::fabs(a[i] * b[i]);
      CHECK(std::fabs(k->dot(a.data(), b.data(), d) - ref) <= 1e-5 * mag + 1e-6);
    }
  }
}

TEST_CASE("soft scan matches the double reference for every dimension, size and path", "[kernels]") {
  for (const KernelTable* k : all_paths()) {
    for (std::size_t d : kDims) {
      for (std::size_t n : {1u, 2u, 255u, 256u, 257u, 1500u}) {
        INFO("path " << k->name << ", d = " << d << ", n = " << n);
        const std::size_t dv = d % 7 + 1 + (d > 100 ? 60 : 0);  // dv differs from d and hits every tail
        Rows rows(n, d, dv, 1000 * d + n);
        const auto q = test::normal_floats(d, 7 * d + n);
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const auto ref = test::soft_reference(q.data(), rows.keys.data(), rows.values.data(), n, d, dv, scale);
        const SoftScan got = soft_scan_split(*k, q.data(), scale, rows.span(), 1, 0);
        check_soft(got.state, ref, test::max_abs(rows.values));
      }
    }
  }
}

TEST_CASE("split-and-merge equals the single pass to float rounding", "[kernels]") {
  Rows rows(20000, 128, 64, 5);
  const auto q = test::normal_floats(128, 6);
  const float scale = 0.2f;
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    const SoftScan one = soft_scan_split(*k, q.data(), scale, rows.span(), 1, 8);
    for (std::size_t parts : {2u, 3u, 7u, 64u}) {
      INFO("parts " << parts);
      const SoftScan split = soft_scan_split(*k, q.data(), scale, rows.span(), parts, 8);
      CHECK(std::fabs(split.state.lse() - one.state.lse()) <= 1e-5 * std::fabs(one.state.lse()) + 1e-5);
      CHECK(split.state.max == one.state.max);
      for (std::size_t j = 0; j < 64; ++j)
        CHECK(std::fabs(split.state.acc[j] / split.state.sum - one.state.acc[j] / one.state.sum) <= 1e-5);
      // The contributors are a property of the scores, not of the split.
      REQUIRE(split.top.size() == one.top.size());
      for (std::size_t i = 0; i < one.top.size(); ++i) CHECK(split.top[i].id == one.top[i].id);
      const ArgMax hs = hard_scan_split(*k, q.data(), 1.0f, rows.span(), parts);
      const ArgMax h1 = hard_scan_split(*k, q.data(), 1.0f, rows.span(), 1);
      CHECK(hs.row == h1.row);
      CHECK(hs.score == h1.score);
    }
  }
}

TEST_CASE("merging an empty part is the identity and never makes NaN", "[kernels]") {
  SoftmaxState empty(3), filled(3);
  filled.max = 2.0f;
  filled.sum = 1.5f;
  filled.acc = {1.0f, -2.0f, 3.0f};
  SoftmaxState a = filled;
  a.merge(empty);
  CHECK(a.max == 2.0f);
  CHECK(a.sum == 1.5f);
  CHECK(a.acc == filled.acc);
  SoftmaxState b = empty;
  b.merge(filled);
  CHECK(b.max == 2.0f);
  CHECK(b.acc == filled.acc);
  SoftmaxState c = empty;
  c.merge(empty);
  CHECK(c.sum == 0.0f);
  CHECK_FALSE(std::isnan(c.max));
}

TEST_CASE("extreme logits neither overflow nor produce NaN", "[kernels]") {
  // Scores near +-1e4: exp would overflow without the running max.
  const std::size_t n = 600, d = 16, dv = 5;
  for (const float sign : {1.0f, -1.0f}) {
    Rows rows(n, d, dv, 77);
    for (float& x : rows.keys) x = std::fabs(x) * sign;  // all scores share a sign
    std::vector<float> q(d, 1.0f);
    const float scale = 1e4f / 16.0f;                   // scores ~ +-1e4
    const auto ref = test::soft_reference(q.data(), rows.keys.data(), rows.values.data(), n, d, dv, scale);
    REQUIRE(std::fabs(ref.max_score) > 2000);
    for (const KernelTable* k : all_paths()) {
      INFO("path " << k->name << ", sign " << sign);
      const SoftScan got = soft_scan_split(*k, q.data(), scale, rows.span(), 3, 0);
      check_soft(got.state, ref, test::max_abs(rows.values));
    }
  }
}

TEST_CASE("batched kernels equal looped single queries", "[kernels]") {
  for (const KernelTable* k : all_paths()) {
    for (std::size_t d : {3u, 16u, 33u, 128u}) {
      for (std::size_t nq : {1u, 3u, 4u, 9u, 20u, 40u, 70u}) {  // 1 to 4 vectors of lanes, and a second chunk
        INFO("path " << k->name << ", d = " << d << ", nq = " << nq);
        const std::size_t dv = d + 5;
        Rows rows(700, d, dv, d + nq);
        const auto qs = test::normal_floats(nq * d, 99 + nq);
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const std::vector<float> scales(nq, scale);
        const auto batch = soft_scan_batch_split(*k, qs.data(), nq, scales.data(), rows.span(), 2);
        for (std::size_t b = 0; b < nq; ++b) {
          const SoftScan one = soft_scan_split(*k, qs.data() + b * d, scale, rows.span(), 1, 0);
          CHECK(std::fabs(batch[b].lse() - one.state.lse()) <= 1e-5 * std::max(1.0, std::fabs(one.state.lse())));
          double err = 0;
          for (std::size_t j = 0; j < dv; ++j)
            err = std::max(err, static_cast<double>(std::fabs(batch[b].acc[j] / batch[b].sum - one.state.acc[j] / one.state.sum)));
          CHECK(err <= 1e-5 * test::max_abs(rows.values));
        }
        // Integer-valued keys and queries: every dot is exact, so argmaxes must agree exactly.
        Rows ints(700, d, dv, 3 * d + nq);
        ints.keys = test::integer_floats(700 * d, d);
        const auto iq = test::integer_floats(nq * d, nq);
        const std::vector<float> ones(nq, 1.0f);
        const auto hard = hard_scan_batch_split(*k, iq.data(), nq, ones.data(), ints.span(), 3);
        for (std::size_t b = 0; b < nq; ++b) {
          const ArgMax one = hard_scan_split(*k, iq.data() + b * d, 1.0f, ints.span(), 1);
          CHECK(hard[b].row == one.row);
          CHECK(hard[b].score == one.score);
        }
      }
    }
  }
}

TEST_CASE("hard scan breaks ties by the smallest id, wherever the row sits", "[kernels]") {
  const std::size_t n = 1000, d = 8, dv = 2;
  Rows rows(n, d, dv, 3);
  std::fill(rows.keys.begin(), rows.keys.end(), 0.0f);
  // Rows 900, 10 and 500 tie for the best score; ids are deliberately not in row order.
  for (std::size_t r = 0; r < n; ++r) rows.ids[r] = 5000 - r;
  for (std::size_t r : {10u, 500u, 900u}) rows.keys[r * d] = 1.0f;
  std::vector<float> q(d, 0.0f);
  q[0] = 1.0f;
  for (const KernelTable* k : all_paths()) {
    for (std::size_t parts : {1u, 2u, 5u}) {
      INFO("path " << k->name << ", parts " << parts);
      const ArgMax best = hard_scan_split(*k, q.data(), 1.0f, rows.span(), parts);
      CHECK(best.row == 900);  // id 4100, the smallest of 4990, 4500, 4100
      const float one = 1.0f;
      const auto batch = hard_scan_batch_split(*k, q.data(), 1, &one, rows.span(), parts);
      CHECK(batch[0].row == 900);
    }
  }
}

TEST_CASE("split_scale moves a power of two between query and scale, exactly", "[kernels][numerics]") {
  std::mt19937_64 rng(5);
  for (float scale : {1e-40f, 1e-30f, 0.125f, 1.0f, 3.0f, 1e20f, 3e38f}) {
    for (double magnitude : {0.0, 1e-44, 1e-30, 1.0, 1e20, 3e38}) {
      INFO("scale " << scale << ", |q| ~ " << magnitude);
      std::vector<float> q = test::normal_floats(9, rng());
      for (float& x : q) x = static_cast<float>(std::clamp(x * magnitude, -3.4e38, 3.4e38));
      std::vector<float> split = q;
      const float factor = split_scale(split, scale);
      float input_largest = 0;
      for (float x : q) input_largest = std::max(input_largest, std::fabs(x));
      if (input_largest > 0) REQUIRE(std::isnormal(factor));  // a zero query keeps the scale as it is
      // factor * q'_i == scale * q_i exactly (in double, where neither product rounds).
      const double moved = static_cast<double>(factor) / scale;
      for (std::size_t i = 0; i < q.size(); ++i)
        if (std::isnormal(split[i]))  // split elements far below the largest may fall among the denormals
          CHECK(static_cast<double>(split[i]) * moved == static_cast<double>(q[i]));
      float largest = 0;
      for (float x : split) largest = std::max(largest, std::fabs(x));
      if (input_largest > 0 && factor < 1e38f && factor > 1e-37f) {  // not clamped: |q'| in [1, 2)
        CHECK(largest >= 1.0f);
        CHECK(largest < 2.0f);
      }
    }
  }
}

TEST_CASE("the fused top-k pass ranks the soft scan's own scores, ties to the smaller id", "[kernels]") {
  const std::size_t n = 3000, d = 33;
  Rows rows(n, d, 2, 17);
  for (std::size_t r = 0; r < n; ++r) rows.ids[r] = (r * 7919) % 10007;  // ids not in row order
  for (std::size_t r = 0; r < n; r += 11) std::copy_n(rows.keys.begin(), d, rows.keys.begin() + static_cast<std::ptrdiff_t>(r * d));  // ties
  const auto q = test::normal_floats(d, 18);
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    std::vector<float> scores(n);
    k->scores(q.data(), 0.3f, rows.span(), scores.data());
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && rows.ids[a] < rows.ids[b]);
    });
    for (std::size_t top : {1u, 40u, 300u, 3000u}) {
      for (std::size_t parts : {1u, 3u}) {
        INFO("k " << top << ", parts " << parts);
        const auto got = top_k_scan(*k, q.data(), 0.3f, rows.span(), top, parts);
        REQUIRE(got.size() == top);
        for (std::size_t i = 0; i < top; ++i) {
          CHECK(got[i].id == rows.ids[order[i]]);
          CHECK(got[i].score == scores[order[i]]);  // bit for bit
        }
      }
    }
    // The soft scan's contributors carry the same bits.
    const SoftScan soft = soft_scan_split(*k, q.data(), 0.3f, rows.span(), 2, 50);
    for (std::size_t i = 0; i < 50; ++i) CHECK(soft.top[i].score == scores[order[i]]);
  }
}

TEST_CASE("batched kernels take one scale per query", "[kernels]") {
  const std::size_t d = 16, dv = 3, nq = 5;
  Rows rows(600, d, dv, 19);
  const auto qs = test::normal_floats(nq * d, 20);
  const std::vector<float> scales = {0.01f, 0.5f, 1.0f, 4.0f, 1e-20f};
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    const auto batch = soft_scan_batch_split(*k, qs.data(), nq, scales.data(), rows.span(), 2);
    const auto hard = hard_scan_batch_split(*k, qs.data(), nq, scales.data(), rows.span(), 2);
    for (std::size_t b = 0; b < nq; ++b) {
      const auto ref = test::soft_reference(qs.data() + b * d, rows.keys.data(), rows.values.data(), 600, d, dv, scales[b]);
      check_soft(batch[b], ref, test::max_abs(rows.values));
      const ArgMax one = hard_scan_split(*k, qs.data() + b * d, scales[b], rows.span(), 1);
      CHECK(hard[b].row == one.row);
      CHECK(hard[b].score == Approx(one.score).epsilon(1e-5));
    }
  }
}

TEST_CASE("hard scans flag +inf scores, redo overflowed sums in double and never pick -inf", "[kernels][numerics]") {
  const std::size_t d = 2;
  std::vector<float> keys = {1, 0, 3e38f, 3e38f, -3e38f, -3e38f, 2, 0};
  std::vector<std::uint64_t> ids = {0, 1, 2, 3};
  const RowSpan span{keys.data(), nullptr, ids.data(), 4, d, 0};
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    const float up[] = {10, 10};  // row 1 overflows to +inf
    ArgMax a = hard_scan_split(*k, up, 1.0f, span, 1);
    CHECK(a.overflow);
    const float mixed[] = {10, -10};  // rows 1 and 2: 3e39 - 3e39 = NaN in float, 0 when summed again in double
    ArgMax b = hard_scan_split(*k, mixed, 1.0f, span, 2);
    CHECK_FALSE(b.overflow);
    CHECK(b.row == 3);  // scores 10, 0, 0, 20
    CHECK(b.score == 20.0f);
    const float down[] = {-10, -10};  // row 1: -inf, never the answer; row 2 (+inf) overflows
    ArgMax c = hard_scan_split(*k, down, 1.0f, span, 1);
    CHECK(c.overflow);
    const RowSpan first_two{keys.data(), nullptr, ids.data(), 2, d, 0};
    ArgMax e = hard_scan_split(*k, down, 1.0f, first_two, 1);  // scores -10 and -inf: row 0 wins
    CHECK_FALSE(e.overflow);
    CHECK(e.row == 0);
    const float batch_q[] = {10, 10, -10, -10, 1, 0};
    const float ones[] = {1, 1, 1};
    const auto h = hard_scan_batch_split(*k, batch_q, 3, ones, first_two, 1);
    CHECK(h[0].overflow);
    CHECK_FALSE(h[1].overflow);
    CHECK(h[1].row == 0);
    CHECK(h[2].row == 1);  // 3e38 beats 1
  }
}

TEST_CASE("the batched hard scan's block screening misses no late tie, overflow or NaN", "[kernels][numerics]") {
  // Eight blocks of rows. Lane 0: the best score first appears early (row 100), then again in a
  // late block with a smaller id (row 1500), which must win. Lane 1: a late row's float dot is NaN
  // (-3e39 + 3e39) where products round before the add, and -inf or +inf where an FMA fuses one of
  // them (it differs between kernels and builds): either way it is summed again in double, to 0, so
  // lane 1 is row 1500 as well. Lane 2: a late +inf. Lane 3: a late tie with a larger id.
  const std::size_t n = 2048, d = 2;
  std::vector<float> keys(n * d, 0.0f);
  std::vector<std::uint64_t> ids(n);
  for (std::size_t r = 0; r < n; ++r) ids[r] = 10000 + r;
  keys[100 * d] = 5.0f;
  keys[1500 * d] = 5.0f;
  ids[1500] = 7;  // the smallest id of the tie
  keys[1800 * d] = -3e38f, keys[1800 * d + 1] = 3e38f;
  keys[300 * d + 1] = -4.0f;   // lane 3's best (id 10300) ...
  keys[1700 * d + 1] = -4.0f;  // ... tied late by a larger id
  const RowSpan span{keys.data(), nullptr, ids.data(), n, d, 0};
  const float queries[] = {1, 0, 10, 10, -10, 10, 0, -1};
  const float ones[] = {1, 1, 1, 1};
  for (const KernelTable* k : all_paths()) {
    for (std::size_t parts : {1u, 3u}) {
      INFO("path " << k->name << ", parts " << parts);
      const auto h = hard_scan_batch_split(*k, queries, 4, ones, span, parts);
      CHECK(h[0].row == 1500);
      CHECK(h[0].score == 5.0f);
      CHECK_FALSE(h[0].overflow);
      CHECK(h[1].row == 1500);
      CHECK(h[1].score == 50.0f);
      CHECK_FALSE(h[1].overflow);
      CHECK(h[2].overflow);
      CHECK(h[3].row == 300);
      CHECK_FALSE(h[3].overflow);
      for (std::size_t b = 0; b < 4; ++b) {
        const ArgMax one = hard_scan_split(*k, queries + b * d, 1.0f, span, parts);
        CHECK(h[b].overflow == one.overflow);
        if (!one.overflow) CHECK(h[b].row == one.row);
      }
    }
  }
}

TEST_CASE("a blend whose float accumulator overflows is redone in double", "[kernels][numerics]") {
  const std::size_t n = 1000, d = 4, dv = 2;
  Rows rows(n, d, dv, 23);
  for (std::size_t i = 0; i < n; ++i) rows.values[i * dv] = 3e38f, rows.values[i * dv + 1] = -1e38f * (1 + i % 3);
  const auto q = test::normal_floats(d, 24);
  const auto ref = test::soft_reference(q.data(), rows.keys.data(), rows.values.data(), n, d, dv, 0.1);
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    const SoftScan s = soft_scan_split(*k, q.data(), 0.1f, rows.span(), 2, 0);
    CHECK_FALSE(std::isfinite(s.state.acc[0]));  // the float accumulator did overflow
    const std::vector<float> v = blended_value(*k, q.data(), 0.1f, rows.span(), s.state);
    CHECK(v[0] == Approx(ref.value[0]).epsilon(1e-6));
    CHECK(v[1] == Approx(ref.value[1]).epsilon(1e-5));
  }
}

// The tile products a batch pass may run (softkv's own on every path; libxsmm's JIT GEMMs on the
// native path where this build has it), each forced in turn.
std::vector<std::string> tile_choices() {
  std::vector<std::string> names = {"softkv"};
  if (have_libxsmm()) names.push_back("libxsmm");
  return names;
}

TEST_CASE("tile products: every choice computes both products as the double reference, at every shape", "[kernels][tiles]") {
  for (const std::string& choice : tile_choices()) {
    force_tile_products(choice);
    const TileProducts tiles = tiles_for(kernels());
    for (std::size_t lanes : {16u, 32u, 64u, 128u})
      for (std::size_t rows : {1u, 7u, 64u, 255u, 256u})
        for (std::size_t d : {1u, 3u, 16u, 129u, 384u}) {
          INFO(choice << ": lanes " << lanes << ", rows " << rows << ", d " << d);
          const auto qt = test::normal_floats(d * lanes, lanes + d), k = test::normal_floats(rows * d, rows + d);
          std::vector<float> s(rows * lanes, std::numeric_limits<float>::quiet_NaN());  // overwritten, never read
          tiles.scores(qt.data(), lanes, k.data(), rows, d, s.data());
          double worst = 0;
          for (std::size_t r = 0; r < rows; ++r)
            for (std::size_t b = 0; b < lanes; ++b) {
              double ref = 0, mag = 0;
              for (std::size_t i = 0; i < d; ++i) {
                ref += static_cast<double>(k[r * d + i]) * qt[i * lanes + b];
                mag += std::fabs(static_cast<double>(k[r * d + i]) * qt[i * lanes + b]);
              }
              worst = std::max(worst, std::fabs(s[r * lanes + b] - ref) / (mag + 1e-30));
            }
          CHECK(worst <= 1e-5);
          // blend: the first nq lanes of w, into an accumulator that already holds something
          const std::size_t dv = d + 2, nq = lanes - 3;
          const auto w = test::normal_floats(rows * lanes, 3 * rows + d), v = test::normal_floats(rows * dv, rows + 5 * d);
          std::vector<float> acc = test::normal_floats(nq * dv, d + 11), before = acc;
          tiles.blend(w.data(), lanes, nq, v.data(), rows, dv, acc.data());
          worst = 0;
          for (std::size_t q = 0; q < nq; ++q)
            for (std::size_t c = 0; c < dv; ++c) {
              double ref = before[q * dv + c], mag = std::fabs(ref);
              for (std::size_t r = 0; r < rows; ++r) {
                ref += static_cast<double>(w[r * lanes + q]) * v[r * dv + c];
                mag += std::fabs(static_cast<double>(w[r * lanes + q]) * v[r * dv + c]);
              }
              worst = std::max(worst, std::fabs(acc[q * dv + c] - ref) / (mag + 1e-30));
            }
          CHECK(worst <= 1e-5);
        }
  }
  for (const KernelTable* k : all_paths())  // libxsmm never stands in on the scalar or sse2 path
    if (k->name == "scalar" || k->name == "sse2") {
      force_tile_products(tile_choices().back());
      CHECK(tiles_for(*k).scores == k->tiles.scores);
      CHECK(tiles_for(*k).blend == k->tiles.blend);
    }
  force_tile_products("auto");
  const std::string report = tile_products();
  CHECK(report.find("scores ") == 0);
  CHECK(report.find("blend ") != std::string::npos);
  if (!have_libxsmm()) CHECK_THROWS_AS(force_tile_products("libxsmm"), Error);
  CHECK_THROWS_AS(force_tile_products("no-such-tiles"), Error);
}

TEST_CASE("tile products: batch passes answer as the double reference and as each other with every choice", "[kernels][tiles]") {
  const KernelTable& k = kernels();
  for (std::size_t d : {1u, 33u, 128u})
    for (std::size_t nq : {1u, 17u, 64u, 70u}) {
      const std::size_t dv = d + 3, n = 700;
      Rows rows(n, d, dv, 5 * d + nq);
      const auto qs = test::normal_floats(nq * d, 7 + nq);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      const std::vector<float> scales(nq, scale);
      std::vector<std::vector<SoftmaxState>> answers;
      for (const std::string& choice : tile_choices()) {
        INFO(choice << ": d " << d << ", nq " << nq);
        force_tile_products(choice);
        answers.push_back(soft_scan_batch_split(k, qs.data(), nq, scales.data(), rows.span(), 2));
        for (std::size_t b = 0; b < nq; ++b) {
          const test::SoftReference ref = test::soft_reference(qs.data() + b * d, rows.keys.data(), rows.values.data(), n, d, dv, scale);
          check_soft(answers.back()[b], ref, test::max_abs(rows.values));
        }
        const std::vector<float> ones(nq, 1.0f);
        Rows ints(n, d, dv, 3 * d + nq);
        ints.keys = test::integer_floats(n * d, d);
        const auto iq = test::integer_floats(nq * d, nq);
        const auto hard = hard_scan_batch_split(k, iq.data(), nq, ones.data(), ints.span(), 2);
        for (std::size_t b = 0; b < nq; ++b) {  // integer dots are exact: the argmax is the single path's
          const ArgMax one = hard_scan_split(k, iq.data() + b * d, 1.0f, ints.span(), 1);
          CHECK(hard[b].row == one.row);
          CHECK(hard[b].score == one.score);
        }
      }
      for (std::size_t a = 1; a < answers.size(); ++a)
        for (std::size_t b = 0; b < nq; ++b) {
          CHECK(std::fabs(answers[a][b].lse() - answers[0][b].lse()) <= 1e-5 * std::max(1.0, std::fabs(answers[0][b].lse())));
          double err = 0;
          for (std::size_t j = 0; j < dv; ++j)
            err = std::max(err, static_cast<double>(std::fabs(answers[a][b].acc[j] / answers[a][b].sum - answers[0][b].acc[j] / answers[0][b].sum)));
          CHECK(err <= 1e-5 * test::max_abs(rows.values));
        }
    }
  force_tile_products("auto");
}

TEST_CASE("interleaved passes: each query's answer is its single query's, bit for bit, on every path, with and without a mask", "[kernels]") {
  for (const KernelTable* k : all_paths()) {
    for (std::size_t d : {3u, 128u, 300u}) {
      const std::size_t dv = d % 5 + 2, n = 2000;
      Rows rows(n, d, dv, 17 * d);
      EligibleRows mask;  // long and short runs, as a tag mask gives them
      for (std::size_t begin = 0; begin < n; begin += 700) {
        mask.runs.push_back({begin, std::min<std::size_t>(600, n - begin)});
        mask.count += mask.runs.back().count;
        if (begin + 650 < n) {
          mask.runs.push_back({begin + 650, 7});
          mask.count += 7;
        }
      }
      for (std::size_t nq : {2u, 5u, 17u})
        for (std::size_t parts : {1u, 2u, 3u})
          for (const EligibleRows* only : std::vector<const EligibleRows*>{nullptr, &mask}) {
            INFO("path " << k->name << ", d " << d << ", nq " << nq << ", parts " << parts << (only ? ", masked" : ""));
            const auto qs = test::normal_floats(nq * d, nq + d);
            std::vector<float> scales(nq);
            for (std::size_t b = 0; b < nq; ++b) scales[b] = 0.1f + 0.05f * static_cast<float>(b);
            const auto soft = soft_scan_each_split(*k, qs.data(), nq, scales.data(), rows.span(), parts, only);
            const auto hard = hard_scan_each_split(*k, qs.data(), nq, scales.data(), rows.span(), parts, only);
            for (std::size_t b = 0; b < nq; ++b) {
              const SoftScan one = soft_scan_split(*k, qs.data() + b * d, scales[b], rows.span(), parts, 0, only);
              CHECK(soft[b].max == one.state.max);
              CHECK(soft[b].sum == one.state.sum);
              CHECK(soft[b].acc == one.state.acc);
              const ArgMax h = hard_scan_split(*k, qs.data() + b * d, scales[b], rows.span(), parts, only);
              CHECK(hard[b].row == h.row);
              CHECK(hard[b].score == h.score);
            }
          }
    }
  }
}

TEST_CASE("pass choice: each way is measured once per pass size, then the cheaper runs and the other one pass in 16", "[kernels]") {
  PassChoice c;
  using Way = PassChoice::Way;
  CHECK(c.choose(1) == Way::batch);
  CHECK(c.choose(PassChoice::kMax + 1) == Way::batch);
  CHECK(c.choose(4) == Way::each);  // not measured yet
  c.note(Way::each, 4, 3000, 1000);
  CHECK(c.choose(4) == Way::batch);
  c.note(Way::batch, 4, 9000, 1000);
  int each = 0, batch = 0;
  for (int i = 0; i < 64; ++i) (c.choose(4) == Way::each ? each : batch)++;
  CHECK(each == 60);  // cheaper: 3 ns a row against 9
  CHECK(batch == 4);  // re-measured one pass in 16
  c.note(Way::each, 4, 20000, 1000);  // each became dearer: 0.75 * 3 + 0.25 * 20 = 7.25 ns, still below 9
  c.note(Way::each, 4, 20000, 1000);  // 0.75 * 7.25 + 5 = 10.4 ns: batch now
  int now_batch = 0;
  for (int i = 0; i < 16; ++i) now_batch += c.choose(4) == Way::batch;
  CHECK(now_batch == 15);
  CHECK(c.choose(5) == Way::each);  // every pass size has its own measurements
}

TEST_CASE("scores_multi redoes overflowed sums in double as scores does, on every path", "[kernels][numerics]") {
  const std::size_t d = 2;
  const std::vector<float> keys = {1, 0, 3e38f, 3e38f, -3e38f, -3e38f, 2, 0, 3e38f, -3e38f};
  const std::vector<std::uint64_t> ids = {0, 1, 2, 3, 4};
  const RowSpan span{keys.data(), nullptr, ids.data(), 5, d, 0};
  const float queries[] = {10, 10, 10, -10, -10, -10, 1, 0, 1e-30f, 1e-30f};  // +inf, NaN redone to 0, -inf, finite, tiny
  const float scales[] = {1.0f, 1.0f, 1.0f, 0.5f, 1e30f};
  for (const KernelTable* k : all_paths()) {
    INFO("path " << k->name);
    std::vector<float> multi(5 * 5), own(5 * 5);
    k->scores_multi(queries, 5, scales, span, multi.data(), 5);
    for (std::size_t i = 0; i < 5; ++i) k->scores(queries + i * d, scales[i], span, own.data() + i * 5);
    for (std::size_t j = 0; j < multi.size(); ++j) {
      INFO("score " << j << ": " << multi[j] << " against " << own[j]);
      CHECK(std::memcmp(&multi[j], &own[j], 4) == 0);
    }
    CHECK(std::isinf(multi[1]));    // query 0, row 1: beyond FLT_MAX
    CHECK(multi[5 + 1] == 0.0f);    // query 1, row 1: 3e39 - 3e39 is NaN in float, 0 in double
    CHECK(multi[5 + 2] == 0.0f);
  }
}

TEST_CASE("integer dot products: every path this CPU runs gives the exact sums at every width, count and extreme", "[kernels]") {
  // int16 queries up to int_query_limit(d) against int8 rows down to -128, exactly as an int64 sum gives
  // them: widths that fill vectors, leave tails of every length and hold none, 0 to 17 rows.
  std::mt19937_64 gen(31);
  std::size_t paths = 0;
  for (const detail::IntDotPath& path : detail::int_dot_paths()) {
    if (!path.supported) continue;
    ++paths;
    for (const std::size_t d : {1u, 2u, 15u, 16u, 17u, 31u, 32u, 33u, 47u, 63u, 64u, 65u, 127u, 128u, 129u, 300u, 1000u}) {
      const std::int32_t limit = detail::int_query_limit(d);
      REQUIRE(limit >= 256);
      CHECK(static_cast<std::int64_t>(d) * limit * 128 < (std::int64_t{1} << 31));
      std::uniform_int_distribution<int> q_of(-limit, limit), k_of(-128, 127);
      for (const std::size_t n : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 8u, 17u}) {
        for (int form = 0; form < 3; ++form) {  // random; every product at its largest; alternating signs at the extremes
          std::vector<std::int16_t> q(d);
          std::vector<std::int8_t> rows(n * d);
          for (std::size_t j = 0; j < d; ++j) q[j] = static_cast<std::int16_t>(form == 0 ? q_of(gen) : form == 1 ? -limit : (j % 2 == 0 ? limit : -limit));
          for (std::size_t i = 0; i < n * d; ++i) rows[i] = static_cast<std::int8_t>(form == 0 ? k_of(gen) : form == 1 ? -128 : (i % 2 == 0 ? 127 : -128));
          std::vector<std::int32_t> out(n + 1, 12345);
          path.dots(q.data(), rows.data(), n, d, out.data());
          INFO(path.name << ", d = " << d << ", n = " << n << ", form " << form);
          for (std::size_t r = 0; r < n; ++r) {
            std::int64_t exact = 0;
            for (std::size_t j = 0; j < d; ++j) exact += static_cast<std::int64_t>(q[j]) * rows[r * d + j];
            REQUIRE(out[r] == exact);
          }
          CHECK(out[n] == 12345);  // nothing written past the rows
        }
      }
    }
  }
  CHECK(paths >= 1);
  // The limit: the largest |q| whose sums cannot overflow, capped at int16's range.
  CHECK(detail::int_query_limit(1) == 32767);
  CHECK(detail::int_query_limit(512) == 32767);
  CHECK(detail::int_query_limit(1000) == 16777);
  CHECK(detail::int_query_limit(std::size_t{1} << 17) == 127);
  CHECK(detail::int_query_limit(std::size_t{1} << 24) == 0);
}
