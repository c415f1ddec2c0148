// Multi-head collections and iterative (Hopfield) retrieval: against h independent single-head
// collections on the slices and a double-precision reference, on every kernel path and precision,
// with masks, batches, persistence and every refused input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <atomic>
#include <string>
#include <thread>

#include "codec/records.hpp"
#include "heads_scan.hpp"
#include "kernel_paths.hpp"
#include "simd/kernel_table.hpp"
#include "errors.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"

using namespace softkv;

namespace {

using test::any_path;
using test::ForcedPath;

CollectionConfig config(std::size_t d, std::size_t dv, std::size_t h, Metric metric = Metric::dot,
                        Precision kp = Precision::f32, Precision vp = Precision::f32) {
  CollectionConfig c;
  c.dim = d;
  c.value_dim = dv;
  c.metric = metric;
  c.heads = h;
  c.key_precision = kp;
  c.value_precision = vp;
  return c;
}

// Columns [j * w, (j + 1) * w) of n rows of width `width`.
std::vector<float> slice(const std::vector<float>& rows, std::size_t width, std::size_t j, std::size_t w) {
  std::vector<float> out;
  for (std::size_t r = 0; r * width < rows.size(); ++r)
    out.insert(out.end(), rows.begin() + static_cast<std::ptrdiff_t>(r * width + j * w),
               rows.begin() + static_cast<std::ptrdiff_t>(r * width + (j + 1) * w));
  return out;
}

// The stored keys and values of a collection in id order (rounded to their precisions), as the reference reads them.
struct Stored {
  std::vector<std::uint64_t> ids;
  std::vector<float> keys, values;
};
Stored stored(const Collection& c) {
  Stored s;
  s.ids = c.ids();
  std::sort(s.ids.begin(), s.ids.end());
  for (std::uint64_t id : s.ids) {
    const Entry e = c.get(id);
    s.keys.insert(s.keys.end(), e.key.begin(), e.key.end());
    s.values.insert(s.values.end(), e.value.begin(), e.value.end());
  }
  return s;
}

// The multi-head answer in double: head j is the single-head reference on slice j with scale.
struct HeadsReference {
  std::vector<double> value;
  std::vector<test::SoftReference> heads;
};
HeadsReference heads_reference(const std::vector<float>& q, const Stored& s, std::size_t d, std::size_t dv, std::size_t h,
                               double scale) {
  HeadsReference ref;
  const std::size_t dh = d / h, dvh = dv / h, n = s.ids.size();
  for (std::size_t j = 0; j < h; ++j) {
    const auto qj = slice(q, d, j, dh), kj = slice(s.keys, d, j, dh), vj = slice(s.values, dv, j, dvh);
    ref.heads.push_back(test::soft_reference(qj.data(), kj.data(), vj.data(), n, dh, dvh, scale));
    ref.value.insert(ref.value.end(), ref.heads.back().value.begin(), ref.heads.back().value.end());
  }
  return ref;
}

bool has_mask_options(const QueryOptions& o) { return !o.tags_any.empty() || o.tag_range || !o.exclude_ids.empty(); }

// Relative error of a float vector against a double one, on the scale of the reference's largest element.
double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-30;
  for (double x : want) scale = std::max(scale, std::fabs(x));
  return test::max_abs_diff(got, want) / scale;
}

}  // namespace

TEST_CASE("heads: configuration limits are refused at creation with invalid_argument", "[heads]") {
  CHECK(CollectionConfig{}.heads == 1);
  CHECK(test::error_of([] { Collection c(config(8, 8, 0)); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([] { Collection c(config(2048, 2048, 1025)); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([] { Collection c(config(8, 6, 4)); }) == ErrorCode::invalid_argument);   // dv not divisible
  CHECK(test::error_of([] { Collection c(config(6, 8, 4)); }) == ErrorCode::invalid_argument);   // d not divisible
  CHECK(test::error_of([] { Collection c(config(1024, 1024, 1024)); }) == ErrorCode{});         // the largest h, dh = 1
  CollectionConfig hnsw = config(8, 8, 2);
  hnsw.index.kind = IndexKind::hnsw;
  CHECK(test::error_of([&] { Collection c(hnsw); }) == ErrorCode::invalid_argument);
  Collection one(config(3, 5, 1));
  CHECK(one.config().heads == 1);
}

TEST_CASE("heads: soft answers equal h single-head collections on the slices and a double reference", "[heads]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  const auto [d, dv, h, n] = GENERATE(table<std::size_t, std::size_t, std::size_t, std::size_t>(
      {{2, 2, 2, 1}, {8, 4, 2, 300}, {12, 6, 3, 257}, {64, 64, 8, 600}, {16, 32, 16, 70}, {33, 11, 11, 513},
       // slices of 16, 32, 64 and 128 floats in groups of 8 heads: the scans sum 8 heads' dot products together
       {128, 64, 8, 260}, {256, 128, 8, 300}, {512, 512, 8, 270}, {1024, 64, 8, 70}, {512, 256, 16, 90}, {256, 32, 16, 40}}));
  const bool cosine = GENERATE(false, true);
  CAPTURE(path, d, dv, h, n, cosine);
  const Metric metric = cosine ? Metric::cosine : Metric::dot;
  const std::vector<float> keys = test::normal_floats(n * d, 11), values = test::normal_floats(n * dv, 12);
  Collection multi(config(d, dv, h, metric));
  multi.add_batch(keys, values);
  const std::size_t dh = d / h, dvh = dv / h;
  std::vector<Collection> singles;
  for (std::size_t j = 0; j < h; ++j) {
    singles.emplace_back(config(dh, dvh, 1, metric));
    singles.back().add_batch(slice(keys, d, j, dh), slice(values, dv, j, dvh));
  }
  const Stored s = stored(multi);
  for (std::uint64_t seed = 0; seed < 3; ++seed) {
    std::vector<float> q = test::normal_floats(d, 100 + seed, 2.0f);
    QueryOptions o;
    o.top_m = 3;
    o.threads = 1;
    const SoftResult r = multi.query_soft(q, o);
    const HardResult hard = multi.query_hard(q, o);
    REQUIRE(r.value.size() == dv);
    REQUIRE(r.heads.size() == (h > 1 ? h : 0));
    CHECK(r.candidates == n);
    // The reference scores the query as the collection prepares it: normalised per slice for cosine.
    std::vector<float> qn = q;
    if (cosine)
      for (std::size_t j = 0; j < h; ++j) {
        double norm = 0;
        for (std::size_t i = 0; i < dh; ++i) norm += double(qn[j * dh + i]) * qn[j * dh + i];
        for (std::size_t i = 0; i < dh; ++i) qn[j * dh + i] = float(qn[j * dh + i] / std::sqrt(norm));
      }
    const double scale = 1.0 / std::sqrt(double(dh));
    const HeadsReference ref = heads_reference(qn, s, d, dv, h, scale);
    CHECK(rel_err(r.value, ref.value) < 1e-5);
    for (std::size_t j = 0; j < h; ++j) {
      const SoftResult one = singles[j].query_soft(slice(q, d, j, dh), o);
      const HeadResult head = h > 1 ? r.heads[j] : HeadResult{r.lse, r.max_score, r.top};
      // Each head scores and blends exactly as a collection of its slices alone.
      CHECK(head.lse == one.lse);
      CHECK(head.max_score == one.max_score);
      for (std::size_t i = 0; i < dvh; ++i) CHECK(r.value[j * dvh + i] == one.value[i]);
      REQUIRE(head.top.size() == one.top.size());
      for (std::size_t t = 0; t < head.top.size(); ++t) {
        CHECK(head.top[t].id == one.top[t].id);
        CHECK(head.top[t].weight == one.top[t].weight);
      }
      if (h > 1) {  // hard: head j's winner and score are those of its slices alone
        const HardResult hard_one = singles[j].query_hard(slice(q, d, j, dh), o);
        CHECK(hard.head_ids[j] == hard_one.id);
        CHECK(hard.head_scores[j] == hard_one.score);
      }
      CHECK(std::fabs(head.lse - ref.heads[j].lse) < 1e-5 * std::max(1.0, std::fabs(ref.heads[j].lse)));
      CHECK(std::fabs(head.max_score - ref.heads[j].max_score) < 1e-5 * std::max(1.0, std::fabs(ref.heads[j].max_score)));
      // The top contributor is the reference's largest weight.
      const auto best = std::max_element(ref.heads[j].weights.begin(), ref.heads[j].weights.end());
      REQUIRE(!head.top.empty());
      CHECK(std::fabs(head.top[0].weight - *best) < 1e-5);
    }
    if (h > 1) {
      CHECK(r.lse == r.heads[0].lse);
      CHECK(r.max_score == r.heads[0].max_score);
    }
    // Split over threads: the same answer to float rounding.
    o.threads = 2;
    const SoftResult split = multi.query_soft(q, o);
    CHECK(rel_err(split.value, ref.value) < 1e-5);
  }
}

TEST_CASE("heads: every precision against a double reference over the stored rows", "[heads]") {
  const std::string path = any_path();
  ForcedPath forced(path);
  const auto [kp, vp] = GENERATE(table<Precision, Precision>({{Precision::f16, Precision::f16},
                                                              {Precision::bf16, Precision::bf16},
                                                              {Precision::i8, Precision::f32},
                                                              {Precision::i8, Precision::bf16}}));
  CAPTURE(path, int(kp), int(vp));
  const std::size_t d = 32, dv = 16, h = 4, n = 700;
  // Head slices of very different magnitudes: the i8 row scale (one per row) multiplies every slice.
  std::vector<float> keys = test::normal_floats(n * d, 21);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t i = 0; i < 8; ++i) keys[r * d + i] *= 30.0f;
  const std::vector<float> values = test::normal_floats(n * dv, 22);
  Collection c(config(d, dv, h, Metric::dot, kp, vp));
  c.add_batch(keys, values);
  const Stored s = stored(c);
  const std::vector<float> q = test::normal_floats(d, 23);
  QueryOptions o;
  o.temperature = 2.0f;  // the temperature applies per head: scale 1 / (sqrt(d / h) * T)
  const SoftResult r = c.query_soft(q, o);
  const HeadsReference ref = heads_reference(q, s, d, dv, h, 1.0 / (std::sqrt(double(d / h)) * 2.0));
  CHECK(rel_err(r.value, ref.value) < 1e-5);
  for (std::size_t j = 0; j < h; ++j) CHECK(std::fabs(r.heads[j].lse - ref.heads[j].lse) < 1e-4);
  // Hard: head j's winner by the reference's scores (ties to the smallest id), value slice j from it.
  const HardResult hard = c.query_hard(q, o);
  REQUIRE(hard.head_ids.size() == h);
  for (std::size_t j = 0; j < h; ++j) {
    const auto& sc = ref.heads[j].scores;
    const std::size_t best = std::size_t(std::max_element(sc.begin(), sc.end()) - sc.begin());
    CHECK(hard.head_ids[j] == s.ids[best]);
    CHECK(std::fabs(hard.head_scores[j] - sc[best]) < 1e-4 * std::max(1.0, std::fabs(sc[best])));
    for (std::size_t i = 0; i < dv / h; ++i) CHECK(hard.value[j * (dv / h) + i] == s.values[best * dv + j * (dv / h) + i]);
  }
  CHECK(hard.id == hard.head_ids[0]);
}

TEST_CASE("heads: compact keys score as single-head float32 collections of their stored slices, bit for bit", "[heads]") {
  // A compact row scores exactly what its float32 widening scores, on the joint multi-head path too
  // (slices of 16, 32 and 64 floats in groups of 8 heads: the joint path on avx2 and avx512).
  const std::string path = any_path();
  ForcedPath forced(path);
  const Precision kp = GENERATE(Precision::f16, Precision::bf16, Precision::i8);
  const auto [d, h] = GENERATE(table<std::size_t, std::size_t>({{128, 8}, {256, 8}, {512, 8}, {48, 3}}));
  CAPTURE(path, int(kp), d, h);
  const std::size_t dv = 2 * h, n = 300, dh = d / h;
  const std::vector<float> keys = test::normal_floats(n * d, 31), values = test::normal_floats(n * dv, 32);
  Collection multi(config(d, dv, h, Metric::dot, kp));
  multi.add_batch(keys, values);
  const Stored s = stored(multi);  // the keys as stored: f16/bf16 rounded, i8 quantised with the row's scale
  std::vector<Collection> singles;
  for (std::size_t j = 0; j < h; ++j) {
    singles.emplace_back(config(dh, 2, 1));
    singles.back().add_batch(slice(s.keys, d, j, dh), slice(values, dv, j, 2));
  }
  for (std::uint64_t seed = 0; seed < 3; ++seed) {
    const std::vector<float> q = test::normal_floats(d, 200 + seed, 2.0f);
    QueryOptions o;
    o.top_m = 2;
    o.threads = 1;
    const SoftResult r = multi.query_soft(q, o);
    const HardResult hard = multi.query_hard(q, o);
    for (std::size_t j = 0; j < h; ++j) {
      const SoftResult one = singles[j].query_soft(slice(q, d, j, dh), o);
      CHECK(r.heads[j].lse == one.lse);
      CHECK(r.heads[j].max_score == one.max_score);
      CHECK(r.value[2 * j] == one.value[0]);
      CHECK(r.value[2 * j + 1] == one.value[1]);
      REQUIRE(r.heads[j].top.size() == one.top.size());
      for (std::size_t t = 0; t < one.top.size(); ++t) CHECK(r.heads[j].top[t].id == one.top[t].id);
      const HardResult hard_one = singles[j].query_hard(slice(q, d, j, dh), o);
      CHECK(hard.head_ids[j] == hard_one.id);
      CHECK(hard.head_scores[j] == hard_one.score);
    }
  }
}

TEST_CASE("heads: a batch over compact keys answers as the float32 collection of the stored rows, bit for bit", "[heads]") {
  // The multi-head batch scans its rows in pieces sized for L2; sized by the stored bytes, compact rows
  // were cut at other rows than their float32 widening and the online softmax rescaled elsewhere (a few
  // ulp apart, found by an independent probe at d = 300, dv = 12, h = 3). Pieces are sized at float32 now.
  const std::string path = any_path();
  ForcedPath forced(path);
  const Precision kp = GENERATE(Precision::f16, Precision::bf16, Precision::i8);
  const auto [d, h] = GENERATE(table<std::size_t, std::size_t>({{300, 3}, {128, 8}}));
  CAPTURE(path, int(kp), d, h);
  const std::size_t dv = 4 * h, n = 700, nq = 4;
  Collection compact(config(d, dv, h, Metric::dot, kp));
  compact.add_batch(test::normal_floats(n * d, 41), test::normal_floats(n * dv, 42));
  const Stored s = stored(compact);
  Collection wide(config(d, dv, h));
  for (std::size_t r = 0; r < s.ids.size(); ++r)
    wide.upsert(s.ids[r], std::span<const float>(s.keys).subspan(r * d, d), std::span<const float>(s.values).subspan(r * dv, dv));
  const std::vector<float> q = test::normal_floats(nq * d, 43);
  QueryOptions o;
  o.threads = 1;
  const SoftBatchResult a = compact.query_soft_batch(q, o), b = wide.query_soft_batch(q, o);
  CHECK(a.values == b.values);
  CHECK(a.lse == b.lse);
  CHECK(a.head_lse == b.head_lse);
  CHECK(a.head_max_score == b.head_max_score);
  const HardBatchResult ha = compact.query_hard_batch(q, o), hb = wide.query_hard_batch(q, o);
  CHECK(ha.head_ids == hb.head_ids);
  CHECK(ha.head_scores == hb.head_scores);
}

TEST_CASE("heads: hard retrieval answers one id per head, ties to the smallest id", "[heads]") {
  Collection c(config(4, 4, 2));
  // Head 0 prefers entry 1, head 1 entry 2; entries 2 and 3 tie on head 1.
  c.upsert(0, std::vector<float>{0, 0, 0, 0}, std::vector<float>{0, 0, 0, 0});
  c.upsert(1, std::vector<float>{5, 0, 0, 0}, std::vector<float>{1, 1, 1, 1});
  c.upsert(3, std::vector<float>{0, 0, 0, 7}, std::vector<float>{3, 3, 3, 3});
  c.upsert(2, std::vector<float>{0, 0, 0, 7}, std::vector<float>{2, 2, 2, 2});
  const HardResult r = c.query_hard(std::vector<float>{1, 0, 0, 1});
  CHECK(r.head_ids == std::vector<std::uint64_t>{1, 2});
  CHECK(r.value == std::vector<float>{1, 1, 2, 2});
  CHECK(r.id == 1);
  CHECK(r.head_scores[1] == Approx(7.0 / std::sqrt(2.0)));
  // Batched: the same per query.
  const std::vector<float> two{1, 0, 0, 1, 0, 1, 1, 0};
  const HardBatchResult b = c.query_hard_batch(two);
  CHECK(b.head_ids.size() == 4);
  CHECK(b.head_ids[0] == 1);
  CHECK(b.head_ids[1] == 2);
  const QueryResults qr = c.query(two, Retrieval::hard);
  REQUIRE(qr.hard.size() == 2);
  CHECK(qr.hard[0].head_ids == r.head_ids);
  CHECK(qr.hard[1].head_ids == c.query_hard(std::span(two).subspan(4)).head_ids);
}

TEST_CASE("heads: masks hide rows from every head, batches and coalescing agree with single queries", "[heads]") {
  const std::size_t d = 16, dv = 8, h = 4, n = 400;
  const std::vector<float> keys = test::normal_floats(n * d, 31), values = test::normal_floats(n * dv, 32);
  std::vector<std::uint64_t> tags(n);
  for (std::size_t r = 0; r < n; ++r) tags[r] = r % 7;  // runs of one row: the masked scan gathers
  Collection c(config(d, dv, h));
  const std::vector<std::uint64_t> ids = c.add_batch(keys, values, tags);
  const std::vector<float> q = test::normal_floats(d, 33);
  QueryOptions o;
  o.tags_any = {2, 5};
  o.exclude_ids = {ids[2], ids[5]};
  o.top_m = 4;
  const SoftResult r = c.query_soft(q, o);
  // Reference over the eligible rows only.
  Stored kept;
  for (std::size_t i = 0; i < n; ++i) {
    if ((tags[i] != 2 && tags[i] != 5) || i == 2 || i == 5) continue;
    kept.ids.push_back(ids[i]);
    kept.keys.insert(kept.keys.end(), keys.begin() + i * d, keys.begin() + (i + 1) * d);
    kept.values.insert(kept.values.end(), values.begin() + i * dv, values.begin() + (i + 1) * dv);
  }
  CHECK(r.candidates == kept.ids.size());
  const HeadsReference ref = heads_reference(q, kept, d, dv, h, 1.0 / std::sqrt(double(d / h)));
  CHECK(rel_err(r.value, ref.value) < 1e-5);
  for (std::size_t j = 0; j < h; ++j) {
    CHECK(std::fabs(r.heads[j].lse - ref.heads[j].lse) < 1e-5);
    for (const Contributor& t : r.heads[j].top) CHECK(std::find(kept.ids.begin(), kept.ids.end(), t.id) != kept.ids.end());
  }
  const HardResult hard = c.query_hard(q, o);
  for (std::uint64_t id : hard.head_ids) CHECK(std::find(kept.ids.begin(), kept.ids.end(), id) != kept.ids.end());
  // A mask that keeps one entry: every head answers it.
  QueryOptions only;
  only.exclude_ids.assign(ids.begin() + 1, ids.end());
  const SoftResult single = c.query_soft(q, only);
  CHECK(single.candidates == 1);
  for (std::size_t i = 0; i < dv; ++i) CHECK(single.value[i] == values[i]);
  CHECK(c.query_hard(q, only).head_ids == std::vector<std::uint64_t>(h, ids[0]));
  // A mask that keeps nothing.
  QueryOptions none;
  none.tags_any = {99};
  CHECK(test::error_of([&] { (void)c.query_soft(q, none); }) == ErrorCode::empty_collection);
  // Batches through query() and query_soft_batch (one pass for every query) equal single queries to
  // float rounding and the double reference; hard batches give the single queries' ids exactly.
  const std::vector<float> qs = test::normal_floats(5 * d, 34);
  for (const QueryOptions& opts : {QueryOptions{}, o}) {
    QueryOptions plain = opts;
    plain.top_m = 0;
    const QueryResults all = c.query(qs, Retrieval::soft, plain);
    const SoftBatchResult batch = c.query_soft_batch(qs, plain);
    const QueryResults hard_all = c.query(qs, Retrieval::hard, plain);
    const HardBatchResult hard_batch = c.query_hard_batch(qs, plain);
    REQUIRE(batch.head_lse.size() == 5 * h);
    REQUIRE(hard_batch.head_ids.size() == 5 * h);
    const Stored& scope = has_mask_options(plain) ? kept : stored(c);
    for (std::size_t b = 0; b < 5; ++b) {
      const std::vector<float> qb(qs.begin() + b * d, qs.begin() + (b + 1) * d);
      const SoftResult one = c.query_soft(qb, plain);
      const HeadsReference want = heads_reference(qb, scope, d, dv, h, 1.0 / std::sqrt(double(d / h)));
      CHECK(rel_err(all.soft[b].value, want.value) < 1e-5);
      CHECK(rel_err(std::vector<float>(batch.values.begin() + b * dv, batch.values.begin() + (b + 1) * dv), want.value) < 1e-5);
      REQUIRE(all.soft[b].heads.size() == h);
      for (std::size_t j = 0; j < h; ++j) {
        CHECK(batch.head_lse[b * h + j] == Approx(one.heads[j].lse).epsilon(1e-6).margin(1e-6));
        CHECK(all.soft[b].heads[j].lse == Approx(want.heads[j].lse).epsilon(1e-6).margin(1e-5));
      }
      const HardResult hard_one = c.query_hard(qb, plain);
      CHECK(hard_all.hard[b].head_ids == hard_one.head_ids);
      CHECK(hard_all.hard[b].value == hard_one.value);
      CHECK(std::vector<std::uint64_t>(hard_batch.head_ids.begin() + b * h, hard_batch.head_ids.begin() + (b + 1) * h) == hard_one.head_ids);
    }
  }
}

TEST_CASE("heads: concurrent multi-head queries share passes, each equal to its double reference", "[heads][coalescing]") {
  const std::size_t n = 30000, d = 32, dv = 16, h = 4;  // 5.8 MB a pass: over the size at which queries coalesce
  Collection c(config(d, dv, h));
  const std::vector<float> keys = test::normal_floats(n * d, 41), values = test::normal_floats(n * dv, 42);
  c.add_batch(keys, values);
  const Stored all = stored(c);
  constexpr int kThreads = 8, kQueries = 10;
  std::atomic<int> failures{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < kThreads; ++t) {
    readers.emplace_back([&, t] {
      for (int i = 0; i < kQueries; ++i) {
        const std::vector<float> q = test::normal_floats(d, 500 + t * 50 + i);
        const float temperature = 0.5f + 0.25f * float((t + i) % 3);
        const HeadsReference want = heads_reference(q, all, d, dv, h, 1.0 / (std::sqrt(double(d / h)) * temperature));
        if ((t + i) % 3 == 0) {  // hard: head j's winner is the reference's best row of slice j
          const HardResult r = c.query_hard(q, {.temperature = temperature});
          for (std::size_t j = 0; j < h; ++j) {
            const auto& sc = want.heads[j].scores;
            if (r.head_ids[j] != all.ids[std::size_t(std::max_element(sc.begin(), sc.end()) - sc.begin())]) ++failures;
          }
        } else {
          const SoftResult r = c.query_soft(q, {.temperature = temperature});
          if (rel_err(r.value, want.value) > 1e-5) ++failures;
          for (std::size_t j = 0; j < h; ++j)
            if (std::fabs(r.heads[j].lse - want.heads[j].lse) > 1e-5 * std::max(1.0, std::fabs(want.heads[j].lse))) ++failures;
        }
      }
    });
  }
  for (auto& r : readers) r.join();
  CHECK(failures.load() == 0);
  const CoalescingStats s = c.coalescing_stats();
  CHECK(s.queries == std::uint64_t(kThreads * kQueries));
  CHECK(s.passes < s.queries);  // some queries shared a pass
  CHECK(s.max_batch > 1);
}

TEST_CASE("heads: pruned queries are unsupported, sizes are checked", "[heads]") {
  Collection c(config(8, 8, 2));
  c.add(test::normal_floats(8, 1), test::normal_floats(8, 2));
  QueryOptions o;
  o.top_k = 4;
  CHECK(test::error_of([&] { (void)c.query_soft(test::normal_floats(8, 3), o); }) == ErrorCode::unsupported);
  o.top_k.reset();
  o.epsilon = 0.1f;
  CHECK(test::error_of([&] { (void)c.query_soft(test::normal_floats(8, 3), o); }) == ErrorCode::unsupported);
  CHECK(test::error_of([&] { (void)c.query_soft(test::normal_floats(7, 3)); }) == ErrorCode::dimension_mismatch);
  Collection empty(config(8, 8, 2));
  CHECK(test::error_of([&] { (void)empty.query_soft(test::normal_floats(8, 3)); }) == ErrorCode::empty_collection);
  CHECK(test::error_of([&] { (void)empty.query_hard(test::normal_floats(8, 3)); }) == ErrorCode::empty_collection);
  // Extreme scores: overflow is a typed error on every head as on one.
  QueryOptions huge;
  huge.scale = 3e38f;
  c.add(std::vector<float>(8, 1e30f), std::vector<float>(8, 1.0f));
  CHECK(test::error_of([&] { (void)c.query_soft(std::vector<float>(8, 1e30f), huge); }) == ErrorCode::numeric_overflow);
}

TEST_CASE("heads: persisted in the log and snapshots, single-head records unchanged", "[heads]") {
  test::TempDir dir;
  const std::vector<float> keys = test::normal_floats(10 * 12, 41), values = test::normal_floats(10 * 6, 42);
  {
    Database db(dir.path);
    db.create_collection("m", config(12, 6, 3, Metric::cosine));
    db.create_collection("s", config(12, 6, 1));
    db.add("m", keys, values);
    db.add("s", keys, values);
  }
  const std::vector<float> q = test::normal_floats(12, 43);
  SoftResult before;
  {
    Database db(dir.path);  // log replay
    CHECK(db.collection("m")->config().heads == 3);
    CHECK(db.collection("s")->config().heads == 1);
    before = db.collection("m")->query_soft(q);
    CHECK(before.heads.size() == 3);
    db.snapshot();
  }
  {
    Database db(dir.path);  // snapshot
    CHECK(db.collection("m")->config().heads == 3);
    CHECK(db.collection("s")->config().heads == 1);
    CHECK(db.collection("m")->query_soft(q).value == before.value);
  }
  // A single-head create record is byte-identical to the layout before heads; a multi-head one
  // carries 2 precision bytes and a u32 more, which an older reader refuses as trailing bytes.
  const auto one = detail::encode_mutation(detail::mutation::Create{"c", config(12, 6, 1)});
  const auto three = detail::encode_mutation(detail::mutation::Create{"c", config(12, 6, 3)});
  CHECK(three.payload.size() == one.payload.size() + 6);
  const detail::DimensionsOf dims = [](const std::string&) { return std::optional<std::pair<std::size_t, std::size_t>>{}; };
  const auto back = detail::decode_mutation(three.type, three.payload, dims);
  CHECK(std::get<detail::mutation::Create>(back).config.heads == 3);
}

namespace {

// A kernel table whose multi-head kernel counts the rows it is handed before running the real one.
const detail::KernelTable* g_real = nullptr;
std::size_t g_rows = 0, g_calls = 0;
void counting_heads(const float* q, const float* scales, std::size_t heads, const detail::RowSpan& span, float* max,
                    float* sum, float* acc, detail::ScoreSink* const* sinks) {
  g_rows += span.rows;
  ++g_calls;
  g_real->soft_scan_heads(q, scales, heads, span, max, sum, acc, sinks);
}

}  // namespace

TEST_CASE("heads: one pass over the rows serves every head, masked or not", "[heads]") {
  const std::size_t n = 1000, d = 32, dv = 16, h = 8;
  const std::vector<float> keys = test::normal_floats(n * d, 71), values = test::normal_floats(n * dv, 72);
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = i;
  const detail::RowSpan span{keys.data(), values.data(), ids.data(), n, d, dv};
  g_real = &detail::kernels();
  detail::KernelTable counting = detail::kernels();
  counting.soft_scan_heads = &counting_heads;
  const std::vector<float> q = test::normal_floats(d, 73), scales(h, 0.5f);
  detail::EligibleRows half;
  for (std::size_t r = 0; r < n; r += 100) half.runs.push_back({r, 50});  // runs of 50: gathered into blocks
  half.count = n / 2;
  for (const detail::EligibleRows& rows : {detail::all_rows(n), half}) {
    for (std::size_t parts : {std::size_t{1}, std::size_t{3}}) {
      g_rows = g_calls = 0;
      const auto counted = detail::heads_soft_scan(counting, q.data(), scales.data(), h, span, rows, parts, 2);
      CHECK(g_rows == rows.count);  // each eligible row handed to the kernel once, for all 8 heads
      CHECK(g_calls >= parts);
      const auto plain = detail::heads_soft_scan(detail::kernels(), q.data(), scales.data(), h, span, rows, parts, 2);
      for (std::size_t j = 0; j < h; ++j) {
        CHECK(counted.states[j].max == plain.states[j].max);
        CHECK(counted.states[j].sum == plain.states[j].sum);
        CHECK(counted.top[j].size() == 2);
      }
    }
  }
}

// ---- iterative retrieval ----

namespace {

// The iteration in double: x <- softmax(scale K x)^T V (x normalised for cosine before scoring), per head.
struct IterReference {
  std::vector<double> value;
  std::size_t runs = 0;
  double change = 0;
};
IterReference iterate_reference(std::vector<float> x, const Stored& s, std::size_t d, std::size_t h, double scale,
                                std::size_t iterations, double tolerance, bool cosine) {
  IterReference out;
  const std::size_t dh = d / h;
  for (std::size_t t = 1; t <= iterations; ++t) {
    std::vector<float> qn = x;
    if (cosine)
      for (std::size_t j = 0; j < h; ++j) {
        double norm = 0;
        for (std::size_t i = 0; i < dh; ++i) norm += double(qn[j * dh + i]) * qn[j * dh + i];
        for (std::size_t i = 0; i < dh; ++i) qn[j * dh + i] = float(qn[j * dh + i] / std::sqrt(norm));
      }
    out.value = heads_reference(qn, s, d, d, h, scale).value;
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < d; ++i) {
      diff += (out.value[i] - x[i]) * (out.value[i] - x[i]);
      norm += double(x[i]) * x[i];
    }
    out.change = std::sqrt(diff / norm);
    out.runs = t;
    if (out.change <= tolerance) break;
    for (std::size_t i = 0; i < d; ++i) x[i] = float(out.value[i]);
  }
  return out;
}

}  // namespace

TEST_CASE("iterate: 1 to 5 iterations against a double reference, dot and cosine, one and several heads", "[iterate]") {
  const std::size_t d = 24, n = 200;
  const std::size_t h = GENERATE(1, 3);
  const bool cosine = GENERATE(false, true);
  CAPTURE(h, cosine);
  const std::vector<float> keys = test::normal_floats(n * d, 51), values = test::normal_floats(n * d, 52);
  Collection c(config(d, d, h, cosine ? Metric::cosine : Metric::dot));
  c.add_batch(keys, values);
  const Stored s = stored(c);
  const std::vector<float> q = test::normal_floats(d, 53);
  for (std::size_t it = 1; it <= 5; ++it) {
    QueryOptions o;
    o.iterations = it;
    o.scale = 0.8f;
    const SoftResult r = c.query_soft(q, o);
    const IterReference ref = iterate_reference(q, s, d, h, 0.8, it, 0.0, cosine);
    CAPTURE(it);
    CHECK(r.iterations_run == it);
    CHECK(rel_err(r.value, ref.value) < 1e-4);
    if (it > 1) CHECK(std::fabs(r.last_change - ref.change) < 1e-4 * std::max(1.0, ref.change));
  }
  // A batch iterates each query on its own.
  const std::vector<float> qs = test::normal_floats(3 * d, 54);
  QueryOptions o;
  o.iterations = 3;
  const QueryResults all = c.query(qs, Retrieval::soft, o);
  const SoftBatchResult batch = c.query_soft_batch(qs, o);
  for (std::size_t b = 0; b < 3; ++b) {
    const SoftResult one = c.query_soft(std::span(qs).subspan(b * d, d), o);
    CHECK(all.soft[b].value == one.value);
    CHECK(all.soft[b].iterations_run == 3);
    CHECK(std::equal(one.value.begin(), one.value.end(), batch.values.begin() + b * d));
  }
}

TEST_CASE("iterate: a half-blanked planted pattern converges to the stored one and stops at the tolerance", "[iterate]") {
  const std::size_t d = 64, n = 50;
  std::vector<float> patterns(n * d);
  {
    const std::vector<float> signs = test::normal_floats(n * d, 61);
    for (std::size_t i = 0; i < n * d; ++i) patterns[i] = signs[i] >= 0 ? 1.0f : -1.0f;  // +-1 patterns
  }
  Collection c(config(d, d, 1));
  const std::vector<std::uint64_t> ids = c.add_batch(patterns, patterns);  // keys = values: a Hopfield memory
  const std::size_t planted = 17;
  std::vector<float> q(patterns.begin() + planted * d, patterns.begin() + (planted + 1) * d);
  std::fill(q.begin() + d / 2, q.end(), 0.0f);  // the second half blanked
  QueryOptions o;
  o.scale = 0.5f;  // beta
  o.iterations = 50;
  o.tolerance = 1e-6f;
  o.top_m = 1;
  const SoftResult r = c.query_soft(q, o);
  CHECK(r.iterations_run < 50);  // converged before running out
  CHECK(r.last_change <= 1e-6);
  CHECK(r.top.at(0).id == ids[planted]);
  for (std::size_t i = 0; i < d; ++i) CHECK(r.value[i] == Approx(patterns[planted * d + i]).margin(1e-4));
  // One iteration alone already leans towards it but is not the pattern at a small beta.
  QueryOptions first = o;
  first.iterations = 1;
  first.scale = 0.05f;
  const SoftResult once = c.query_soft(q, first);
  CHECK(once.iterations_run == 1);
  CHECK(std::fabs(once.value[d - 1] - patterns[planted * d + d - 1]) > 0.1);
  // A tolerance met at once stops after the first pass and reports its change.
  QueryOptions loose = o;
  loose.tolerance = 1e30f;
  const SoftResult stop = c.query_soft(q, loose);
  CHECK(stop.iterations_run == 1);
  CHECK(stop.last_change > 0);
  // A zero query that moves: change is infinite, and the next pass continues from the value.
  QueryOptions two;
  two.iterations = 2;
  const SoftResult zero = c.query_soft(std::vector<float>(d, 0.0f), two);
  CHECK(zero.iterations_run == 2);
}

TEST_CASE("iterate: options outside their ranges and dv != d are invalid_argument", "[iterate]") {
  Collection c(config(4, 4, 1));
  c.add(std::vector<float>{1, 2, 3, 4}, std::vector<float>{1, 0, 0, 0});
  const std::vector<float> q{1, 0, 0, 0};
  auto code = [&](std::size_t it, float tol, Retrieval kind = Retrieval::soft) {
    QueryOptions o;
    o.iterations = it;
    o.tolerance = tol;
    return test::error_of([&] { (void)c.query(q, kind, o); });
  };
  CHECK(code(0, 0) == ErrorCode::invalid_argument);
  CHECK(code(1001, 0) == ErrorCode::invalid_argument);
  CHECK(code(1000, 0) == ErrorCode{});
  CHECK(code(2, std::nanf("")) == ErrorCode::invalid_argument);
  CHECK(code(2, -1e-9f) == ErrorCode::invalid_argument);
  CHECK(code(2, std::numeric_limits<float>::infinity()) == ErrorCode::invalid_argument);
  CHECK(code(2, 0, Retrieval::hard) == ErrorCode::invalid_argument);
  CHECK(code(1, 0, Retrieval::hard) == ErrorCode{});
  Collection wide(config(4, 2, 1));
  wide.add(std::vector<float>{1, 2, 3, 4}, std::vector<float>{1, 0});
  QueryOptions o;
  o.iterations = 2;
  try {
    (void)wide.query_soft(q, o);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("value_dim") != std::string::npos);
  }
  o.iterations = 1;
  CHECK(test::error_of([&] { (void)wide.query_soft(q, o); }) == ErrorCode{});
}
