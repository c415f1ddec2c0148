// Tags and query masks: tags through writes, the log and snapshots; masked soft, hard, batched and
// pruned queries against a double-precision reference over the eligible entries only, on every kernel path.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "codec/checked_blob.hpp"
#include "codec/config.hpp"
#include "codec/records.hpp"
#include "errors.hpp"
#include "reference.hpp"
#include "storage/snapshot.hpp"
#include "kernel_paths.hpp"
#include "mask.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"

using namespace softkv;

namespace {

constexpr std::uint64_t kMaxTag = std::numeric_limits<std::uint64_t>::max();

using test::ForcedPath;
using test::any_path;

// n entries with tags; grouped: tag = row / (n / groups) (rows of a tag stored together, long runs);
// otherwise tag = row % groups (every run one row long, so the masked scans gather).
struct Tagged {
  std::size_t d, dv;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> tags, ids;
  Collection c;
  Tagged(std::size_t n, std::size_t d_, std::size_t dv_, bool grouped, std::size_t groups = 10,
         IndexConfig index = {}, std::uint64_t seed = 7)
      : d(d_), dv(dv_), keys(test::normal_floats(n * d_, seed)), values(test::normal_floats(n * dv_, seed + 1)),
        c(CollectionConfig{d_, dv_, Metric::dot, {}, index}) {
    for (std::size_t r = 0; r < n; ++r) tags.push_back(grouped ? r / std::max<std::size_t>(1, n / groups) : r % groups);
    ids = c.add_batch(keys, values, tags);
  }
  // Rows a mask keeps, by the definition (AND of the three tests).
  [[nodiscard]] std::vector<std::size_t> kept(const QueryOptions& o) const {
    std::vector<std::size_t> rows;
    for (std::size_t r = 0; r < ids.size(); ++r) {
      const std::uint64_t t = tags[r];
      if (!o.tags_any.empty() && std::find(o.tags_any.begin(), o.tags_any.end(), t) == o.tags_any.end()) continue;
      if (o.tag_range && (t < o.tag_range->lo || t > o.tag_range->hi)) continue;
      if (std::find(o.exclude_ids.begin(), o.exclude_ids.end(), ids[r]) != o.exclude_ids.end()) continue;
      rows.push_back(r);
    }
    return rows;
  }
  // The double reference over the kept rows only.
  [[nodiscard]] test::SoftReference reference(const float* q, const std::vector<std::size_t>& rows, double scale) const {
    std::vector<float> k, v;
    for (std::size_t r : rows) {
      k.insert(k.end(), keys.begin() + static_cast<std::ptrdiff_t>(r * d), keys.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
      v.insert(v.end(), values.begin() + static_cast<std::ptrdiff_t>(r * dv), values.begin() + static_cast<std::ptrdiff_t>((r + 1) * dv));
    }
    return test::soft_reference(q, k.data(), v.data(), rows.size(), d, dv, scale);
  }
  // The best kept row by double score (ties: smaller id).
  [[nodiscard]] std::size_t best(const float* q, const std::vector<std::size_t>& rows) const {
    std::size_t best_row = rows.front();
    double best_score = -std::numeric_limits<double>::infinity();
    for (std::size_t r : rows) {
      double s = 0;
      for (std::size_t j = 0; j < d; ++j) s += static_cast<double>(q[j]) * keys[r * d + j];
      if (s > best_score) best_score = s, best_row = r;
    }
    return best_row;
  }
};

// Masks of every kind over a Tagged collection of 10 tags.
std::vector<QueryOptions> masks_of_every_kind(const Tagged& t) {
  std::vector<QueryOptions> out(6);
  out[0].tags_any = {3};
  out[1].tags_any = {0, 9, 4, 12345};  // unsorted, with a tag nobody has
  out[2].tag_range = TagRange{2, 5};
  out[3].exclude_ids = {t.ids[0], t.ids[1], t.ids[t.ids.size() / 2], 999999999};  // one id nobody has
  out[4].tags_any = {1, 2, 3, 7};
  out[4].tag_range = TagRange{2, 8};
  out[4].exclude_ids = {t.ids[t.ids.size() - 1], t.ids[t.ids.size() - 2]};
  out[5].tag_range = TagRange{0, 0};
  return out;
}

// A pruned query (top_k 2, top_m 5) whose mask keeps the first five entries only.
QueryOptions first_five_only(const Tagged& t) {
  QueryOptions narrow;
  narrow.exclude_ids.assign(t.ids.begin() + 5, t.ids.end());
  narrow.top_k = 2;
  narrow.top_m = 5;
  return narrow;
}

void check_value(const std::vector<float>& got, const test::SoftReference& ref) {
  REQUIRE(got.size() == ref.value.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(ref.value[i]).margin(1e-5).epsilon(1e-4));
}

}  // namespace

TEST_CASE("tags are stored by add and upsert, single and batched, returned by get and moved with their rows", "[tag]") {
  Collection c(CollectionConfig{3, 2});
  const std::vector<float> k{1, 2, 3}, v{4, 5};
  const std::uint64_t a = c.add(k, v);  // default tag 0
  const std::uint64_t b = c.add(k, v, kMaxTag);
  const auto batch = c.add_batch(std::vector<float>(9, 1.0f), std::vector<float>(6, 2.0f), std::vector<std::uint64_t>{10, 11, 12});
  c.upsert(100, k, v, 7);
  CHECK(c.get(a).tag == 0);
  CHECK(c.get(b).tag == kMaxTag);
  CHECK(c.get(batch[0]).tag == 10);
  CHECK(c.get(batch[2]).tag == 12);
  CHECK(c.get(100).tag == 7);
  c.upsert(100, k, v);  // a replaced entry takes the new tag, 0 included
  CHECK(c.get(100).tag == 0);
  const std::vector<std::uint64_t> ids{batch[1], 200};
  c.upsert_batch(ids, std::vector<float>(6, 3.0f), std::vector<float>(4, 1.0f), std::vector<std::uint64_t>{21, 22});
  CHECK(c.get(batch[1]).tag == 21);
  CHECK(c.get(200).tag == 22);
  // Removing a row moves the last row into its place: the tag must move with it.
  c.remove(a);
  for (auto [id, tag] : std::vector<std::pair<std::uint64_t, std::uint64_t>>{{b, kMaxTag}, {batch[0], 10}, {batch[1], 21}, {batch[2], 12}, {100, 0}, {200, 22}})
    CHECK(c.get(id).tag == tag);
}

TEST_CASE("a tag count that does not match the rows is dimension_mismatch and stores nothing", "[tag]") {
  Collection c(CollectionConfig{2, 1});
  const std::vector<float> keys(4, 1.0f), values(2, 1.0f);
  CHECK(test::error_of([&] { (void)c.add_batch(keys, values, std::vector<std::uint64_t>{1}); }) == ErrorCode::dimension_mismatch);
  CHECK(test::error_of([&] { (void)c.add_batch(keys, values, std::vector<std::uint64_t>{1, 2, 3}); }) == ErrorCode::dimension_mismatch);
  CHECK(test::error_of([&] { c.upsert_batch(std::vector<std::uint64_t>{1, 2}, keys, values, std::vector<std::uint64_t>{5}); }) ==
        ErrorCode::dimension_mismatch);
  CHECK(c.size() == 0);
  test::TempDir dir;
  Database db(dir.path);
  db.create_collection("t", CollectionConfig{2, 1});
  CHECK(test::error_of([&] { db.add("t", keys, values, std::vector<std::uint64_t>{1}); }) == ErrorCode::dimension_mismatch);
  CHECK(test::error_of([&] { db.upsert("t", std::vector<std::uint64_t>{1, 2}, keys, values, std::vector<std::uint64_t>{1, 2, 3}); }) ==
        ErrorCode::dimension_mismatch);
  CHECK(db.collection("t")->size() == 0);
}

TEST_CASE("tags survive log replay and snapshots, and untagged entries come back with tag 0", "[tag]") {
  test::TempDir dir;
  const std::vector<float> keys = test::normal_floats(5 * 4, 3), values = test::normal_floats(5 * 2, 4);
  const std::vector<std::uint64_t> tags{0, 1, kMaxTag, 42, 0};
  std::vector<std::uint64_t> tagged, plain;
  {
    Database db(dir.path);
    db.create_collection("c", CollectionConfig{4, 2, Metric::cosine});
    tagged = db.add("c", keys, values, tags);
    plain = db.add("c", keys, values);  // an untagged write: a plain put record
    db.upsert("c", std::vector<std::uint64_t>{plain[0]}, std::span(keys).first(4), std::span(values).first(2),
              std::vector<std::uint64_t>{9});
  }
  auto check = [&](const Database& db) {
    const auto c = db.collection("c");
    for (std::size_t i = 0; i < tagged.size(); ++i) CHECK(c->get(tagged[i]).tag == tags[i]);
    CHECK(c->get(plain[0]).tag == 9);
    for (std::size_t i = 1; i < plain.size(); ++i) CHECK(c->get(plain[i]).tag == 0);
    QueryOptions o;
    o.tag_range = TagRange{1, 42};
    CHECK(c->query_soft(std::span(keys).first(4), o).candidates == 3);  // tags 1, 42 and 9
  };
  {
    Database db(dir.path);  // log replay
    check(db);
    db.snapshot();
  }
  {
    Database db(dir.path);  // snapshot (format 3, tags section)
    check(db);
    db.add("c", keys, values);  // a snapshot whose collection has only zero tags writes an empty section
    db.remove("c", tagged);
    db.remove("c", std::vector<std::uint64_t>{plain[0]});
    db.snapshot();
  }
  {
    Database db(dir.path);
    const auto c = db.collection("c");
    for (std::uint64_t id : c->ids()) CHECK(c->get(id).tag == 0);
    CHECK(c->size() == 9);
  }
}

TEST_CASE("tagged log records and the snapshot tags section: round trips, and every damage is corrupt_file", "[tag]") {
  using namespace softkv::detail;
  const DimensionsOf no_dims = [](const std::string&) { return std::nullopt; };
  const Rows rows{{3, 9}, {1, 2, 3, 4}, {5, 6}, {7, kMaxTag}};
  const EncodedMutation tagged = encode_mutation(mutation::Upsert{"c", rows});
  CHECK(tagged.type == RecordType::tagged_put);
  const auto back = std::get<mutation::Upsert>(decode_mutation(tagged.type, tagged.payload, no_dims));
  CHECK(back.rows.tags == rows.tags);
  CHECK(back.rows.ids == rows.ids);
  Rows untagged = rows;
  untagged.tags.clear();
  const EncodedMutation plain = encode_mutation(mutation::Upsert{"c", untagged});
  CHECK(plain.type == RecordType::put);  // what a release before tags reads
  CHECK(std::get<mutation::Upsert>(decode_mutation(plain.type, plain.payload, no_dims)).rows.tags.empty());
  auto cut = tagged.payload;
  cut.resize(cut.size() - 8);  // the last tag missing
  CHECK(test::error_of([&] { (void)decode_mutation(tagged.type, cut, no_dims); }) == ErrorCode::corrupt_file);
  CHECK(test::error_of([&] { (void)decode_mutation(RecordType::put, tagged.payload, no_dims); }) == ErrorCode::corrupt_file);

  // Snapshot: the tags section is the payload's last 4 + 8 + 16 bytes here (one collection, two rows).
  SnapshotImage image;
  image.sequence = 5;
  image.collections.push_back({"c", CollectionImage{CollectionConfig{2, 1}, 10, rows, {}}});
  const auto bytes = encode_snapshot(image);
  CHECK(decode_snapshot(bytes, "s").collections.at(0).image.rows.tags == rows.tags);
  const OpenedBlob blob = open_blob(bytes, "SKVSNAP1", "s");
  CHECK(blob.version == kSnapshotVersion);
  auto damaged = [&](const std::function<void(std::vector<std::byte>&)>& edit) {
    std::vector<std::byte> payload(blob.payload.begin(), blob.payload.end());
    edit(payload);
    return test::error_of([&] { (void)decode_snapshot(seal_blob("SKVSNAP1", kSnapshotVersion, payload), "s"); });
  };
  const std::size_t section = blob.payload.size() - 28;
  CHECK(damaged([&](auto& p) { p[section] = std::byte{2}; }) == ErrorCode::corrupt_file);        // unknown section version
  CHECK(damaged([&](auto& p) { p[section + 4] = std::byte{1}; }) == ErrorCode::corrupt_file);    // 1 tag for 2 rows
  CHECK(damaged([&](auto& p) { p[section + 4] = std::byte{3}; }) == ErrorCode::corrupt_file);    // 3 tags for 2 rows
  CHECK(damaged([&](auto& p) { p.resize(p.size() - 8); }) == ErrorCode::corrupt_file);          // tags cut short
  CHECK(damaged([&](auto& p) { p.resize(p.size() + 8); }) == ErrorCode::corrupt_file);          // bytes after them
  // Format 2 (f32 rows, a configuration without the precision bytes, no tags section) is still read,
  // with every tag 0: made from this payload by swapping the configuration and cutting the section.
  ByteWriter v2_config, v3_config;
  put_config(v2_config, image.collections[0].image.config, ConfigForm::snapshot_v2);
  put_config(v3_config, image.collections[0].image.config, ConfigForm::snapshot);
  auto sized = [](ByteWriter& w) {
    ByteWriter out;
    out.put(static_cast<std::uint16_t>(w.bytes().size()));
    out.put_array(std::span<const std::byte>(w.bytes()));
    return out.bytes();
  };
  const std::vector<std::byte> v2_sized = sized(v2_config), v3_sized = sized(v3_config);
  std::vector<std::byte> v2(blob.payload.begin(), blob.payload.begin() + static_cast<std::ptrdiff_t>(section));
  const auto at = std::search(v2.begin(), v2.end(), v3_sized.begin(), v3_sized.end());
  REQUIRE(at != v2.end());
  const auto after = v2.erase(at, at + static_cast<std::ptrdiff_t>(v3_sized.size()));
  v2.insert(after, v2_sized.begin(), v2_sized.end());
  const SnapshotImage old = decode_snapshot(seal_blob("SKVSNAP1", 2, v2), "s");
  CHECK(old.collections.at(0).image.rows.tags.empty());
  CHECK(old.collections.at(0).image.rows.ids == rows.ids);
}

TEST_CASE("masked soft queries equal the double reference over the eligible entries, on every path and layout", "[mask]") {
  const ForcedPath forced(any_path());
  const bool grouped = GENERATE(true, false);
  const std::size_t threads = GENERATE(1u, 3u);
  const Tagged t(1000, 17, 5, grouped);
  const std::vector<float> q = test::normal_floats(t.d, 99);
  const double scale = 1.0 / std::sqrt(17.0);
  for (QueryOptions o : masks_of_every_kind(t)) {
    o.threads = threads;
    o.top_m = 5;
    const auto rows = t.kept(o);
    REQUIRE(!rows.empty());
    const auto ref = t.reference(q.data(), rows, scale);
    const SoftResult r = t.c.query_soft(q, o);
    check_value(r.value, ref);
    CHECK(r.lse == Approx(ref.lse).epsilon(1e-5));
    CHECK(r.max_score == Approx(ref.max_score).epsilon(1e-5));
    CHECK(r.candidates == rows.size());
    CHECK(r.tail_bound == 0);
    CHECK_FALSE(r.mask_filtered_after_search);
    REQUIRE(r.top.size() == std::min<std::size_t>(5, rows.size()));
    std::set<std::uint64_t> eligible;
    for (std::size_t row : rows) eligible.insert(t.ids[row]);
    double weight = 1.0;
    for (const Contributor& c : r.top) {
      CHECK(eligible.count(c.id) == 1);  // never a masked entry
      CHECK(c.weight <= weight);
      weight = c.weight;
    }
    // The best contributor is the reference's best eligible row, with its weight.
    const auto top = std::max_element(ref.weights.begin(), ref.weights.end()) - ref.weights.begin();
    CHECK(r.top[0].id == t.ids[rows[static_cast<std::size_t>(top)]]);
    CHECK(r.top[0].weight == Approx(ref.weights[static_cast<std::size_t>(top)]).epsilon(1e-4));
  }
}

TEST_CASE("masked hard and batched queries answer from the eligible entries only", "[mask]") {
  const ForcedPath forced(any_path());
  const bool grouped = GENERATE(true, false);
  const Tagged t(700, 9, 3, grouped);
  const std::size_t nq = 70;  // more than one batch chunk
  const std::vector<float> qs = test::normal_floats(nq * t.d, 5);
  const double scale = 1.0 / 3.0;
  for (const QueryOptions& o : masks_of_every_kind(t)) {
    const auto rows = t.kept(o);
    const QueryResults soft = t.c.query(qs, Retrieval::soft, o);  // fused batch kernel
    const QueryResults hard = t.c.query(qs, Retrieval::hard, o);
    const SoftBatchResult soft_b = t.c.query_soft_batch(qs, o);
    const HardBatchResult hard_b = t.c.query_hard_batch(qs, o);
    for (std::size_t b = 0; b < nq; ++b) {
      const float* q = qs.data() + b * t.d;
      const auto ref = t.reference(q, rows, scale);
      check_value(soft.soft[b].value, ref);
      CHECK(soft.soft[b].candidates == rows.size());
      CHECK(soft_b.lse[b] == Approx(ref.lse).epsilon(1e-5));
      const std::size_t best = t.best(q, rows);
      CHECK(hard.hard[b].id == t.ids[best]);
      CHECK(hard_b.ids[b] == t.ids[best]);
      CHECK(hard_b.values[b * t.dv] == t.values[best * t.dv]);
      const HardResult one = t.c.query_hard(std::span(q, t.d), o);
      CHECK(one.id == t.ids[best]);
      CHECK(one.value == std::vector<float>(t.values.begin() + static_cast<std::ptrdiff_t>(best * t.dv),
                                            t.values.begin() + static_cast<std::ptrdiff_t>((best + 1) * t.dv)));
    }
  }
}

TEST_CASE("a mask that keeps nothing is empty_collection, one entry answers with it, all entries equal no mask", "[mask]") {
  const Tagged t(300, 8, 4, true, 3);
  const std::vector<float> q = test::normal_floats(8, 1), qs = test::normal_floats(8 * 4, 2);
  SECTION("none") {
    std::vector<QueryOptions> none(4);
    none[0].tags_any = {77};
    none[1].tag_range = TagRange{3, kMaxTag};
    none[2].exclude_ids = t.ids;
    none[3].tags_any = {0};
    none[3].tag_range = TagRange{1, 2};  // each keeps rows, together none (AND)
    for (const QueryOptions& o : none) {
      CHECK(test::error_of([&] { (void)t.c.query_soft(q, o); }) == ErrorCode::empty_collection);
      CHECK(test::error_of([&] { (void)t.c.query_hard(q, o); }) == ErrorCode::empty_collection);
      CHECK(test::error_of([&] { (void)t.c.query_soft_batch(qs, o); }) == ErrorCode::empty_collection);
      CHECK(test::error_of([&] { (void)t.c.query_hard_batch(qs, o); }) == ErrorCode::empty_collection);
      CHECK(test::error_of([&] { (void)t.c.query(qs, Retrieval::soft, o); }) == ErrorCode::empty_collection);
    }
  }
  SECTION("one") {
    QueryOptions o;
    o.exclude_ids = t.ids;
    o.exclude_ids.erase(o.exclude_ids.begin() + 123);
    o.top_m = 3;
    const SoftResult r = t.c.query_soft(q, o);
    CHECK(r.candidates == 1);
    CHECK(r.value == std::vector<float>(t.values.begin() + 123 * 4, t.values.begin() + 124 * 4));
    REQUIRE(r.top.size() == 1);
    CHECK(r.top[0].id == t.ids[123]);
    CHECK(r.top[0].weight == 1.0f);
    CHECK(t.c.query_hard(q, o).id == t.ids[123]);
    CHECK(t.c.query_hard_batch(qs, o).ids == std::vector<std::uint64_t>(4, t.ids[123]));
  }
  SECTION("all") {
    QueryOptions o, plain;
    o.tag_range = TagRange{0, kMaxTag};
    o.tags_any = {0, 1, 2};
    o.exclude_ids = {kMaxTag - 1};
    o.threads = plain.threads = 1;
    const SoftResult masked = t.c.query_soft(q, o), unmasked = t.c.query_soft(q, plain);
    CHECK(masked.value == unmasked.value);  // one run in place: the very same kernel call
    CHECK(masked.lse == unmasked.lse);
    CHECK(masked.candidates == 300);
    CHECK(t.c.query_hard(q, o).id == t.c.query_hard(q, plain).id);
  }
}

TEST_CASE("mask fields at their limits: sizes, ranges and extreme tags", "[mask]") {
  Collection c(CollectionConfig{2, 1});
  const std::vector<float> k{1, 0}, v{1};
  const std::uint64_t low = c.add(k, v, 0), high = c.add(std::vector<float>{0, 1}, std::vector<float>{2}, kMaxTag);
  const std::vector<float> q{0, 5};
  QueryOptions o;
  o.tags_any.assign(QueryOptions::kMaxTagsAny, 5);
  o.tags_any.back() = kMaxTag;
  CHECK(c.query_hard(q, o).id == high);  // 1024 tags: accepted
  o.tags_any.push_back(0);
  CHECK(test::error_of([&] { (void)c.query_soft(q, o); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { (void)c.query_hard_batch(q, o); }) == ErrorCode::invalid_argument);
  o = {};
  o.exclude_ids.assign(QueryOptions::kMaxExcludeIds, 12345);
  o.exclude_ids.back() = high;
  CHECK(c.query_hard(q, o).id == low);  // 65536 ids: accepted
  o.exclude_ids.push_back(1);
  CHECK(test::error_of([&] { (void)c.query_hard(q, o); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { (void)c.query(q, Retrieval::soft, o); }) == ErrorCode::invalid_argument);
  o = {};
  o.tag_range = TagRange{kMaxTag, kMaxTag};
  CHECK(c.query_soft(q, o).candidates == 1);
  o.tag_range = TagRange{0, 0};
  CHECK(c.query_hard(q, o).id == low);
  o.tag_range = TagRange{2, 1};
  CHECK(test::error_of([&] { (void)c.query_soft(q, o); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { (void)c.query_soft_batch(q, o); }) == ErrorCode::invalid_argument);
  // A mask on an empty collection is still the plain empty_collection.
  Collection empty(CollectionConfig{2, 1});
  o.tag_range = TagRange{0, 1};
  CHECK(test::error_of([&] { (void)empty.query_soft(q, o); }) == ErrorCode::empty_collection);
}

TEST_CASE("masked queries never coalesce, and answer with their own mask", "[mask][coalescing]") {
  const Tagged t(500, 8, 2, false, 5);
  QueryOptions o;
  o.tags_any = {4};
  const std::vector<float> q = test::normal_floats(8, 3);
  const auto before = t.c.coalescing_stats();
  const HardResult h = t.c.query_hard(q, o);
  const SoftResult s = t.c.query_soft(q, o);
  CHECK(t.c.coalescing_stats().queries == before.queries);
  CHECK(t.c.get(h.id).tag == 4);
  CHECK(s.candidates == 100);
}

TEST_CASE("masked pruned queries: flat top_k is the exact top k of the eligible entries with N = eligible", "[mask][pruning]") {
  const ForcedPath forced(any_path());
  IndexConfig flat;
  flat.kind = IndexKind::flat;
  const bool grouped = GENERATE(true, false);
  const Tagged t(2000, 16, 4, grouped, 10, flat);
  const std::vector<float> q = test::normal_floats(16, 8);
  const double scale = 0.25;
  for (QueryOptions o : masks_of_every_kind(t)) {
    const auto rows = t.kept(o);
    o.top_k = 20;
    o.top_m = 20;
    const SoftResult r = t.c.query_soft(q, o);
    const auto ref = t.reference(q.data(), rows, scale);
    // The reference's 20 best eligible rows are exactly the candidates.
    std::vector<std::size_t> order(rows.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ref.scores[a] > ref.scores[b]; });
    std::set<std::uint64_t> expected, got;
    for (std::size_t i = 0; i < 20; ++i) expected.insert(t.ids[rows[order[i]]]);
    for (const Contributor& c : r.top) got.insert(c.id);
    CHECK(got == expected);
    CHECK(r.candidates == 20);
    CHECK(r.searched_with == IndexKind::flat);
    CHECK_FALSE(r.mask_filtered_after_search);  // flat's top-k pass itself visits eligible rows only
    CHECK(r.tail_bound_guaranteed);
    // The tail bound counts eligible rows only, and holds: the true mass outside is below it.
    double outside = 0;
    for (std::size_t i = 20; i < order.size(); ++i) outside += ref.weights[order[i]];
    CHECK(outside <= r.tail_bound + 1e-12);
    const double kth = ref.scores[order[19]];
    const double n = static_cast<double>(rows.size());
    CHECK(r.tail_bound < (n - 20) * std::exp(kth - r.lse) * 1.01 + 1e-12);  // N - k, not the collection's N - k
    // epsilon: the answer is within the bound of the exact eligible answer.
    QueryOptions e = o;
    e.top_k.reset();
    e.epsilon = 1e-3f;
    const SoftResult a = t.c.query_soft(q, e);
    CHECK(a.tail_bound <= 1e-3);
    for (std::size_t i = 0; i < t.dv; ++i) CHECK(std::abs(a.value[i] - ref.value[i]) <= 2 * 1e-3 * 5 + 1e-5);
    std::set<std::uint64_t> eligible;
    for (std::size_t row : rows) eligible.insert(t.ids[row]);
    for (const Contributor& c : a.top) CHECK(eligible.count(c.id) == 1);
  }
}

TEST_CASE("masked pruned queries walk the certified lists over the eligible rows: their exact top-k and a guaranteed bound", "[mask][pruning]") {
  IndexConfig index;
  index.kind = GENERATE(IndexKind::hnsw, IndexKind::ivf);
  const Tagged t(3000, 16, 4, false, 10, index);
  t.c.wait_until_indexed();
  const std::vector<float> qs = test::normal_floats(16 * 8, 21);
  QueryOptions o;
  o.tags_any = {0, 2, 3, 6, 8, 9};  // 60% of the rows: a mask keeping half or more walks the lists
  o.top_k = 10;
  o.top_m = 10;
  o.check_sample = 64;
  const auto rows = t.kept(o);
  const double scale = t.c.resolve_scale(o);
  for (std::size_t b = 0; b < 8; ++b) {
    const auto q = std::span(qs).subspan(b * 16, 16);
    const SoftResult r = t.c.query_soft(q, o);
    CHECK(r.searched_with == IndexKind::ivf);
    CHECK_FALSE(r.mask_filtered_after_search);
    CHECK(r.tail_bound_guaranteed);
    REQUIRE(r.candidates == 10);
    CHECK(r.rows_scored >= r.candidates);
    // The candidates are the 10 best eligible rows by double score, and the omitted eligible mass is within the bound.
    std::vector<std::pair<double, std::size_t>> by_score;
    for (std::size_t row : rows) {
      double s = 0;
      for (std::size_t j = 0; j < 16; ++j) s += static_cast<double>(q[j]) * t.keys[row * 16 + j];
      by_score.emplace_back(scale * s, row);
    }
    std::sort(by_score.begin(), by_score.end(), std::greater<>());
    std::set<std::uint64_t> want, got;
    for (std::size_t i = 0; i < 10; ++i) want.insert(t.ids[by_score[i].second]);
    for (const Contributor& c : r.top) got.insert(c.id);
    CHECK(got == want);
    double all = 0, omitted = 0;
    for (std::size_t i = 0; i < by_score.size(); ++i) {
      const double w = std::exp(by_score[i].first - by_score[0].first);
      all += w;
      if (i >= 10) omitted += w;
    }
    CHECK(omitted / all <= r.tail_bound * (1 + 1e-6) + 1e-12);
    // epsilon: every eligible row the walk visited is a candidate, the rest within the bound it met.
    QueryOptions e = o;
    e.top_k.reset();
    e.epsilon = 1e-3f;
    e.top_m = rows.size();
    const SoftResult adaptive = t.c.query_soft(q, e);
    CHECK(adaptive.tail_bound_guaranteed);
    CHECK(adaptive.tail_bound <= 1e-3);
    std::set<std::uint64_t> kept;
    for (const Contributor& c : adaptive.top) kept.insert(c.id);
    REQUIRE(kept.size() == adaptive.candidates);
    double out = 0;
    for (const auto& [score, row] : by_score)
      if (!kept.count(t.ids[row])) out += std::exp(score - by_score[0].first);
    CHECK(out / all <= adaptive.tail_bound * (1 + 1e-6) + 1e-12);
    const HardResult h = t.c.query_hard(q, o);
    CHECK(h.id == t.ids[by_score[0].second]);
    const QueryResults batch = t.c.query(qs, Retrieval::hard, o);
    CHECK(batch.hard[b].id == h.id);
  }
  // The boundary: a mask keeping exactly half the rows walks the lists, one row fewer takes flat's pass.
  QueryOptions half = o;
  half.tags_any = {0, 1, 2, 3, 4};
  REQUIRE(2 * t.kept(half).size() == t.ids.size());
  QueryOptions under_half = half;
  under_half.exclude_ids = {t.ids[t.kept(half).front()]};
  for (std::size_t b = 0; b < 2; ++b) {
    const auto q = std::span(qs).subspan(b * 16, 16);
    const SoftResult at = t.c.query_soft(q, half), under = t.c.query_soft(q, under_half);
    CHECK((at.searched_with == IndexKind::ivf || at.candidates == t.kept(half).size()));
    CHECK(under.searched_with == IndexKind::flat);
    CHECK(at.tail_bound_guaranteed);
    CHECK(under.tail_bound_guaranteed);
  }
  // Narrower masks: flat's fused top-k pass over the eligible rows (the walk's fixed cost would outweigh
  // the masked scan); exact and guaranteed too. A mask keeping 10%, then one keeping five rows.
  QueryOptions tenth = o;
  tenth.tags_any = {6};
  std::set<std::uint64_t> tenth_ids;
  for (std::size_t row : t.kept(tenth)) tenth_ids.insert(t.ids[row]);
  for (std::size_t b = 0; b < 4; ++b) {
    const auto q = std::span(qs).subspan(b * 16, 16);
    const SoftResult r = t.c.query_soft(q, tenth);
    CHECK(r.searched_with == IndexKind::flat);
    CHECK(r.tail_bound_guaranteed);
    CHECK_FALSE(r.mask_filtered_after_search);
    REQUIRE(r.candidates == 10);
    for (const Contributor& c : r.top) CHECK(tenth_ids.count(c.id) == 1);
  }
  const QueryOptions narrow = first_five_only(t);
  const std::vector<std::size_t> five{0, 1, 2, 3, 4};
  const auto q = std::span(qs).first(16);
  const SoftResult r = t.c.query_soft(q, narrow);
  CHECK_FALSE(r.mask_filtered_after_search);
  CHECK(r.searched_with == IndexKind::flat);
  CHECK(r.candidates == 2);
  CHECK(r.tail_bound_guaranteed);
  CHECK(std::any_of(r.top.begin(), r.top.end(), [&](const Contributor& c) { return c.id == t.ids[t.best(q.data(), five)]; }));
  CHECK(t.c.query_hard(q, narrow).id == t.ids[t.best(q.data(), five)]);
}

TEST_CASE("masked pruned queries through the HNSW graph alone over-fetch and filter: no masked entry ever answers", "[mask][pruning]") {
  // 600 rows: the graph is built from the first row on, the certified lists only from 624 (their training
  // size). Half the rows eligible: the over-fetch (k N / eligible, then 4x) stays within a quarter of the rows.
  const Tagged t(600, 16, 4, false, 2, {.kind = IndexKind::hnsw});
  t.c.wait_until_indexed();
  const std::vector<float> qs = test::normal_floats(16 * 8, 21);
  QueryOptions o;
  o.tags_any = {1};
  o.top_k = 10;
  o.top_m = 10;
  o.check_sample = 64;
  const auto rows = t.kept(o);
  std::set<std::uint64_t> eligible;
  for (std::size_t row : rows) eligible.insert(t.ids[row]);
  for (std::size_t b = 0; b < 8; ++b) {
    const auto q = std::span(qs).subspan(b * 16, 16);
    const SoftResult r = t.c.query_soft(q, o);
    CHECK(r.searched_with == IndexKind::hnsw);
    CHECK(r.mask_filtered_after_search);  // over-fetched and filtered: an estimated bound
    CHECK(r.candidates == 10);
    CHECK_FALSE(r.tail_bound_guaranteed);
    for (const Contributor& c : r.top) CHECK(eligible.count(c.id) == 1);
    const HardResult h = t.c.query_hard(q, o);
    CHECK(eligible.count(h.id) == 1);
    QueryOptions exact = o;
    exact.exact = true;  // the exact masked scan: the best eligible entry itself
    CHECK(t.c.query_hard(q, exact).id == t.ids[t.best(q.data(), rows)]);
    CHECK(h.score <= t.c.query_hard(q, exact).score);  // the index may miss the best, never beat it
    const QueryResults batch = t.c.query(qs, Retrieval::hard, o);
    CHECK(eligible.count(batch.hard[b].id) == 1);
  }
  // A mask so narrow that over-fetching would search past a quarter of the rows: the exact masked scan answers.
  const QueryOptions narrow = first_five_only(t);
  const std::vector<std::size_t> five{0, 1, 2, 3, 4};
  const auto q = std::span(qs).first(16);
  const SoftResult r = t.c.query_soft(q, narrow);
  CHECK_FALSE(r.mask_filtered_after_search);
  CHECK(r.searched_with == IndexKind::exact);
  CHECK(r.candidates == 5);
  check_value(r.value, t.reference(q.data(), five, 0.25));
  const HardResult h = t.c.query_hard(q, narrow);
  CHECK(h.searched_with == IndexKind::exact);
  CHECK(h.id == t.ids[t.best(q.data(), five)]);
}

TEST_CASE("eligible_count counts the entries a mask keeps, 0 when it keeps none, size() without one", "[mask]") {
  Collection c({.dim = 2, .value_dim = 1});
  CHECK(c.eligible_count({}) == 0);
  const std::vector<float> keys = {1, 0, 0, 1, 1, 1, 2, 0}, values = {1, 2, 3, 4};
  const std::vector<std::uint64_t> tags = {5, 6, 7, 5};
  const auto ids = c.add_batch(keys, values, tags);
  CHECK(c.eligible_count({}) == 4);
  QueryOptions o;
  o.tags_any = {5};
  CHECK(c.eligible_count(o) == 2);
  o.exclude_ids = {ids[0], 999};
  CHECK(c.eligible_count(o) == 1);
  o.tag_range = TagRange{6, 7};
  CHECK(c.eligible_count(o) == 0);  // no throw: a shard the mask empties counts 0
  CHECK(test::error_of([&] { (void)c.query_soft(std::vector<float>{1, 0}, o); }) == ErrorCode::empty_collection);
  o = {};
  o.tag_range = TagRange{6, 7};
  CHECK(c.eligible_count(o) == 2);
  o.tag_range = TagRange{7, 6};
  CHECK(test::error_of([&] { (void)c.eligible_count(o); }) == ErrorCode::invalid_argument);
}

TEST_CASE("the tag zone map stays a cover of every zone's tags through appends, overwrites and removals", "[mask]") {
  // Random writes on a plain tag array mirrored into TagZones, checked against the invariant after each.
  std::mt19937_64 rng(42);
  std::vector<std::uint64_t> tags;
  detail::TagZones zones;
  auto check_cover = [&] {
    REQUIRE(zones.size() == (tags.size() + detail::TagZones::kRows - 1) / detail::TagZones::kRows);
    for (std::size_t r = 0; r < tags.size(); ++r) {
      const std::size_t z = r / detail::TagZones::kRows;
      REQUIRE(zones.lo(z) <= tags[r]);
      REQUIRE(tags[r] <= zones.hi(z));
    }
  };
  for (int step = 0; step < 6000; ++step) {
    const auto op = rng() % 10;
    if (op < 6 || tags.empty()) {  // append (grouped-ish tags, with extremes now and then)
      const std::uint64_t t = rng() % 50 == 0 ? (rng() % 2 ? 0 : kMaxTag) : tags.size() / 700;
      tags.push_back(t);
      zones.set(tags.size() - 1, t);
    } else if (op < 8) {  // overwrite a row's tag
      const std::size_t r = rng() % tags.size();
      tags[r] = rng() % 100;
      zones.set(r, tags[r]);
    } else {  // remove a row: the last row moves into its place
      const std::size_t r = rng() % tags.size();
      tags[r] = tags.back();
      zones.set(r, tags[r]);
      tags.pop_back();
      zones.shrink(tags.size());
    }
    if (step % 500 == 0) check_cover();
  }
  check_cover();
  zones.rebuild(tags);
  check_cover();
  for (std::size_t z = 0; z < zones.size(); ++z) {  // exact after a rebuild
    const auto first = tags.begin() + static_cast<std::ptrdiff_t>(z * detail::TagZones::kRows);
    const auto last = tags.begin() + static_cast<std::ptrdiff_t>(std::min(tags.size(), (z + 1) * detail::TagZones::kRows));
    CHECK(zones.lo(z) == *std::min_element(first, last));
    CHECK(zones.hi(z) == *std::max_element(first, last));
  }
}

TEST_CASE("masks over many zones answer from the live tags after upserts move tags and removals move rows", "[mask]") {
  // 9,000 rows in 9 zones, tag = row / 1000 (each tag in one or two zones); then tags are rewritten
  // into other zones, rows removed (the last row moves into each hole) and rows appended, and every
  // mask must still find exactly the rows the definition keeps (the zone map may not hide one).
  const std::size_t n = 9000, d = 8, dv = 3;
  Collection c({.dim = d, .value_dim = dv});
  std::vector<float> keys = test::normal_floats(n * d, 3), values = test::normal_floats(n * dv, 4);
  std::vector<std::uint64_t> tags(n);
  for (std::size_t r = 0; r < n; ++r) tags[r] = r / 1000;
  std::vector<std::uint64_t> ids = c.add_batch(keys, values, tags);
  std::map<std::uint64_t, std::uint64_t> tag_of;  // the live entries
  for (std::size_t r = 0; r < n; ++r) tag_of[ids[r]] = tags[r];
  std::mt19937_64 rng(9);
  for (int i = 0; i < 300; ++i) {  // upserts that move a tag far from its zone's range
    const std::uint64_t id = ids[rng() % n];
    if (!tag_of.contains(id)) continue;
    const std::uint64_t t = rng() % 3 == 0 ? kMaxTag : rng() % 12;
    const std::vector<std::uint64_t> one_id{id}, one_tag{t};
    c.upsert_batch(one_id, test::normal_floats(d, 100 + i), test::normal_floats(dv, 200 + i), one_tag);
    tag_of[id] = t;
  }
  std::vector<std::uint64_t> gone;
  for (int i = 0; i < 1500; ++i) {
    const std::uint64_t id = ids[rng() % n];
    if (tag_of.erase(id) != 0) gone.push_back(id);
  }
  c.remove_batch(gone);
  const std::vector<std::uint64_t> more_tags(700, 4);
  for (std::uint64_t id : c.add_batch(test::normal_floats(700 * d, 5), test::normal_floats(700 * dv, 6), more_tags)) tag_of[id] = 4;
  REQUIRE(c.size() == tag_of.size());
  std::vector<QueryOptions> masks(6);
  masks[0].tags_any = {4};
  masks[1].tags_any = {kMaxTag};
  masks[2].tag_range = TagRange{2, 3};
  masks[3].tags_any = {0, 8, 11, kMaxTag};
  masks[4].tag_range = TagRange{10, kMaxTag};
  masks[5].tags_any = {1, 2, 3, 5, 6, 7, 9, 10, 11};  // more than 8 tags: the searched set
  for (const QueryOptions& o : masks) {
    std::size_t expected = 0;
    for (const auto& [id, t] : tag_of) {
      const bool in_set = o.tags_any.empty() || std::find(o.tags_any.begin(), o.tags_any.end(), t) != o.tags_any.end();
      const bool in_range = !o.tag_range || (t >= o.tag_range->lo && t <= o.tag_range->hi);
      expected += in_set && in_range;
    }
    INFO("mask " << (&o - masks.data()));
    CHECK(c.eligible_count(o) == expected);
    if (expected == 0) continue;
    // The soft answer equals the double reference over exactly the live entries the mask keeps.
    std::vector<float> k, v;
    for (const auto& [id, t] : tag_of) {
      const bool in_set = o.tags_any.empty() || std::find(o.tags_any.begin(), o.tags_any.end(), t) != o.tags_any.end();
      if (!in_set || (o.tag_range && (t < o.tag_range->lo || t > o.tag_range->hi))) continue;
      const Entry e = c.get(id);
      k.insert(k.end(), e.key.begin(), e.key.end());
      v.insert(v.end(), e.value.begin(), e.value.end());
    }
    const std::vector<float> q = test::normal_floats(d, 77);
    const test::SoftReference ref = test::soft_reference(q.data(), k.data(), v.data(), expected, d, dv, 1.0 / std::sqrt(double(d)));
    const SoftResult r = c.query_soft(q, o);
    CHECK(r.lse == Approx(ref.lse).margin(1e-5));
    check_value(r.value, ref);
  }
}

TEST_CASE("a tag set of more than 8 tags holding 0, 2^64-1 and runs of small tags keeps exactly its tags", "[mask]") {
  // More than 8 tags take the hash-set test, whose empty slot is the smallest tag not in the set:
  // sets that hold 0, 1, 2, ... and the extremes must still keep exactly their own rows.
  Collection c({.dim = 2, .value_dim = 1});
  const std::vector<std::uint64_t> row_tags = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1ull << 31, 1ull << 32, kMaxTag - 1, kMaxTag};
  std::vector<float> keys, values;
  for (std::size_t i = 0; i < row_tags.size(); ++i) {
    keys.insert(keys.end(), {1.0f, float(i)});
    values.push_back(float(i));
  }
  c.add_batch(keys, values, row_tags);
  const std::vector<std::vector<std::uint64_t>> sets = {
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9},                    // 0.. : the empty marker becomes 10
      {0, 2, 4, 6, 8, 10, kMaxTag, kMaxTag - 1, 1ull << 31},
      {kMaxTag, 1ull << 32, 11, 9, 7, 5, 3, 1, 12345},    // one tag no row has
      {100, 101, 102, 103, 104, 105, 106, 107, 108},      // none of the rows
  };
  for (const auto& set : sets) {
    QueryOptions o;
    o.tags_any = set;
    std::size_t expected = 0;
    for (std::uint64_t t : row_tags) expected += std::find(set.begin(), set.end(), t) != set.end();
    CHECK(c.eligible_count(o) == expected);
    if (expected == 0) continue;
    QueryOptions all = o;
    all.top_m = row_tags.size();
    for (const Contributor& t : c.query_soft(std::vector<float>{1, 0}, all).top)
      CHECK(std::find(set.begin(), set.end(), c.get(t.id).tag) != set.end());
  }
}
