// Every public error path throws softkv::Error with the right code and leaves the collection unchanged.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "assert.hpp"
#include "ids.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"

using namespace softkv;

namespace {

template <class F>
void expect_error(ErrorCode code, F&& f) {
  try {
    f();
    FAIL("expected softkv::Error(" << to_string(code) << ")");
  } catch (const Error& e) {
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(to_string(code)) == 0);  // the message starts with the code's name
  }
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("wrong dimensions are rejected", "[errors]") {
  Collection c({4, 2, Metric::dot, {}});
  const std::vector<float> k = {1, 2, 3, 4}, v = {1, 2};
  expect_error(ErrorCode::dimension_mismatch, [&] { c.add(std::vector<float>{1, 2, 3}, v); });
  expect_error(ErrorCode::dimension_mismatch, [&] { c.add(k, std::vector<float>{1, 2, 3}); });
  expect_error(ErrorCode::dimension_mismatch, [&] { c.add_batch(std::vector<float>(8), std::vector<float>(6)); });
  expect_error(ErrorCode::dimension_mismatch, [&] { c.add_batch(std::vector<float>(7), std::vector<float>(4)); });
  expect_error(ErrorCode::dimension_mismatch,
               [&] { c.upsert_batch(std::vector<std::uint64_t>{1}, std::vector<float>(8), std::vector<float>(4)); });
  CHECK(c.size() == 0);
  c.add(k, v);
  expect_error(ErrorCode::dimension_mismatch, [&] { (void)c.query_soft(std::vector<float>{1, 2}); });
  expect_error(ErrorCode::dimension_mismatch, [&] { (void)c.query_hard(std::vector<float>(5)); });
  expect_error(ErrorCode::dimension_mismatch, [&] { (void)c.query_soft_batch(std::vector<float>(6)); });
  expect_error(ErrorCode::dimension_mismatch, [&] { (void)c.query_hard_batch(std::vector<float>{}); });
}

TEST_CASE("queries on an empty collection are rejected", "[errors]") {
  Collection c({2, 1, Metric::dot, {}});
  const std::vector<float> q = {1, 0};
  expect_error(ErrorCode::empty_collection, [&] { (void)c.query_soft(q); });
  expect_error(ErrorCode::empty_collection, [&] { (void)c.query_hard(q); });
  expect_error(ErrorCode::empty_collection, [&] { (void)c.query_soft_batch(q); });
  expect_error(ErrorCode::empty_collection, [&] { (void)c.query_hard_batch(q); });
  const auto id = c.add(q, std::vector<float>{1});
  c.remove(id);
  expect_error(ErrorCode::empty_collection, [&] { (void)c.query_soft(q); });
}

TEST_CASE("NaN and infinity in any input vector are rejected and nothing is stored", "[errors]") {
  Collection c({3, 2, Metric::dot, {}});
  const std::vector<float> k = {1, 2, 3}, v = {4, 5};
  for (const float bad : {kNaN, kInf, -kInf}) {
    expect_error(ErrorCode::non_finite, [&] { c.add(std::vector<float>{1, bad, 3}, v); });
    expect_error(ErrorCode::non_finite, [&] { c.add(k, std::vector<float>{bad, 5}); });
    expect_error(ErrorCode::non_finite, [&] { c.upsert(3, k, std::vector<float>{4, bad}); });
    // A bad row at the end of a batch rejects the whole batch.
    expect_error(ErrorCode::non_finite, [&] { c.add_batch(std::vector<float>{1, 2, 3, 1, 2, bad}, std::vector<float>(4, 1)); });
  }
  CHECK(c.size() == 0);
  c.add(k, v);
  for (const float bad : {kNaN, kInf}) {
    expect_error(ErrorCode::non_finite, [&] { (void)c.query_soft(std::vector<float>{bad, 0, 0}); });
    expect_error(ErrorCode::non_finite, [&] { (void)c.query_hard(std::vector<float>{0, 0, bad}); });
    expect_error(ErrorCode::non_finite, [&] { (void)c.query_soft_batch(std::vector<float>{0, 0, 0, 0, bad, 0}); });
    expect_error(ErrorCode::non_finite, [&] { (void)c.query_hard_batch(std::vector<float>{bad, 0, 0}); });
  }
  CHECK(c.size() == 1);
  CHECK(c.get(0).value == v);
}

TEST_CASE("unknown ids are rejected", "[errors]") {
  Collection c({2, 1, Metric::dot, {}});
  const auto id = c.add(std::vector<float>{1, 0}, std::vector<float>{1});
  expect_error(ErrorCode::unknown_id, [&] { (void)c.get(id + 1); });
  expect_error(ErrorCode::unknown_id, [&] { c.remove(id + 1); });
  c.remove(id);
  expect_error(ErrorCode::unknown_id, [&] { c.remove(id); });
  expect_error(ErrorCode::unknown_id, [&] { (void)c.get(id); });
}

TEST_CASE("bad temperatures and scales are rejected", "[errors]") {
  Collection c({2, 1, Metric::dot, {}});
  c.add(std::vector<float>{1, 0}, std::vector<float>{1});
  const std::vector<float> q = {1, 0};
  for (const float t : {0.0f, -1.0f, kNaN, kInf, 1e-40f})
    expect_error(ErrorCode::invalid_argument, [&] { (void)c.query_soft(q, {.temperature = t}); });
  for (const float s : {0.0f, -2.0f, kNaN, kInf})
    expect_error(ErrorCode::invalid_argument, [&] { (void)c.query_soft(q, {.scale = s}); });
  expect_error(ErrorCode::invalid_argument, [&] { (void)c.query_soft(q, {.temperature = 1.0f, .scale = 1.0f}); });
  expect_error(ErrorCode::invalid_argument, [&] { (void)c.query_soft_batch(q, {.top_m = 3}); });
  expect_error(ErrorCode::invalid_argument, [&] { Collection bad({0, 1, Metric::dot, {}}); });
  expect_error(ErrorCode::invalid_argument, [&] { Collection bad({1, 1, Metric::dot, -1.0f}); });
  expect_error(ErrorCode::invalid_argument, [&] { c.upsert(std::numeric_limits<std::uint64_t>::max(), q, std::vector<float>{1}); });
}

TEST_CASE("scores beyond the float range are reported, not returned as NaN", "[errors]") {
  Collection c({1, 1, Metric::dot, {}});
  c.add(std::vector<float>{1e30f}, std::vector<float>{1});
  c.add(std::vector<float>{-1e30f}, std::vector<float>{2});
  expect_error(ErrorCode::numeric_overflow, [&] { (void)c.query_soft(std::vector<float>{1e30f}, {.scale = 1e30f}); });
}

TEST_CASE("a zero key or query has no direction under cosine", "[errors]") {
  Collection c({2, 1, Metric::cosine, {}});
  expect_error(ErrorCode::invalid_argument, [&] { c.add(std::vector<float>{0, 0}, std::vector<float>{1}); });
  c.add(std::vector<float>{1, 0}, std::vector<float>{1});
  expect_error(ErrorCode::invalid_argument, [&] { (void)c.query_soft(std::vector<float>{0, 0}); });
}

TEST_CASE("a multi-head cosine key or query with one zero head slice is refused, naming its row, head and elements", "[errors]") {
  CollectionConfig config{6, 3, Metric::cosine, {}};
  config.heads = 3;
  Collection c(config);
  // Two rows, the second with head 1's slice (elements 2 .. 3) zero: the message names row 1, not slice 4.
  const std::vector<float> keys = {1, 0, 0, 1, 1, 1, /**/ 1, 2, 0, 0, 3, 4};
  try {
    (void)c.add_batch(keys, std::vector<float>(6, 1.0f));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string m = e.what();
    CHECK(m.find("key row 1: head 1's slice (elements 2 .. 3) is all zero") != std::string::npos);
    CHECK(m.find("zero vector") == std::string::npos);  // the row itself is not zero
  }
  CHECK(c.size() == 0);  // nothing of the batch was added
  c.add(std::vector<float>{1, 0, 0, 1, 1, 1}, std::vector<float>{1, 2, 3});
  try {
    (void)c.query_soft(std::vector<float>{0, 0, 1, 0, 1, 1});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("query row 0: head 0's slice (elements 0 .. 1) is all zero") != std::string::npos);
  }
}

TEST_CASE("an error message keeps what follows a NUL byte in a name, written as an escape", "[errors]") {
  test::TempDir dir;
  Database db(dir.path);
  const std::string name("a\0b", 3);
  try {
    (void)db.collection(name);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::unknown_collection);
    CHECK(std::string(e.what()).find("a\\x00b") != std::string::npos);
  }
}

TEST_CASE("an error passed on with its own message keeps one code-name prefix", "[errors]") {
  const Error first(ErrorCode::unsupported, "sharded query: masks");
  CHECK(std::string(first.what()) == "unsupported: sharded query: masks");
  const Error again(ErrorCode::unsupported, first.what());  // as a rank or a server passes it on
  CHECK(std::string(again.what()) == "unsupported: sharded query: masks");
  const Error other(ErrorCode::io_error, first.what());  // another code's prefix is part of the message
  CHECK(std::string(other.what()) == "io_error: unsupported: sharded query: masks");
}

TEST_CASE("forcing an unknown kernel path is rejected", "[errors]") {
  expect_error(ErrorCode::unsupported, [] { force_simd_path("mmx"); });
}

TEST_CASE("check_options refuses exactly what a query would refuse for its options", "[errors]") {
  Collection plain({2, 1, Metric::dot, {}});  // empty, no index: the options are checked all the same
  CollectionConfig flat_config{2, 1, Metric::dot, {}};
  flat_config.index.kind = IndexKind::flat;
  Collection flat(flat_config);
  const std::vector<QueryOptions> bad_for_both = {
      {.temperature = 0.0f}, {.temperature = kNaN}, {.scale = -1.0f}, {.temperature = 1.0f, .scale = 1.0f}};
  for (const QueryOptions& o : bad_for_both) {
    for (const Retrieval kind : {Retrieval::soft, Retrieval::hard}) {
      expect_error(ErrorCode::invalid_argument, [&] { plain.check_options(o, kind); });
      expect_error(ErrorCode::invalid_argument, [&] { flat.check_options(o, kind); });
    }
  }
  const std::vector<QueryOptions> bad_pruning = {
      {.top_k = 0}, {.epsilon = 0.0f}, {.epsilon = 1.0f}, {.epsilon = kNaN}, {.top_k = 4, .epsilon = 0.1f}, {.top_k = 4, .ef_search = 0}};
  for (const QueryOptions& o : bad_pruning) {
    expect_error(ErrorCode::invalid_argument, [&] { flat.check_options(o, Retrieval::soft); });
    flat.check_options(o, Retrieval::hard);  // hard ignores the pruning fields, as query_hard does
  }
  expect_error(ErrorCode::invalid_argument, [&] { plain.check_options({.top_k = 4}, Retrieval::soft); });  // no index
  flat.check_options({.top_k = 4}, Retrieval::soft);
  flat.check_options({.temperature = 0.5f, .epsilon = 0.25f}, Retrieval::soft);
  plain.check_options({}, Retrieval::hard);
}

TEST_CASE("a broken internal invariant is Error(internal) naming the invariant, file and line, never a wrong answer", "[errors]") {
  const int line = __LINE__ + 2;
  try {
    SOFTKV_ASSERT(1 + 1 == 3, "arithmetic holds");
    FAIL("the assertion did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::internal);
    const std::string what = e.what();
    CHECK(what.find("arithmetic holds [1 + 1 == 3]") != std::string::npos);
    CHECK(what.find("at tests/test_errors.cpp:" + std::to_string(line)) != std::string::npos);
    CHECK(what.find("please report") != std::string::npos);
  }
  SOFTKV_ASSERT(2 + 2 == 4, "arithmetic holds");  // a kept invariant costs nothing and throws nothing
}

TEST_CASE("the id rules every write path shares: ids up to 2^64-2, and a remove naming an id twice", "[errors]") {
  const std::uint64_t top = kReservedId;
  CHECK(detail::next_ids(top - 3, 3) == std::vector<std::uint64_t>{top - 3, top - 2, top - 1});
  CHECK(detail::next_ids(top, 0).empty());
  CHECK(detail::next_ids(0, 2) == std::vector<std::uint64_t>{0, 1});
  for (const auto& [first, n] : {std::pair<std::uint64_t, std::size_t>{top - 3, 4}, {top, 1}, {1, ~std::size_t{0}}}) {
    try {
      (void)detail::next_ids(first, n);
      FAIL("ids from " << first << " x " << n << " were given");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      CHECK(std::string(e.what()).find("the id space is exhausted") != std::string::npos);
    }
  }
  detail::check_distinct(std::vector<std::uint64_t>{});
  detail::check_distinct(std::vector<std::uint64_t>{top, 0, 1});
  try {
    detail::check_distinct(std::vector<std::uint64_t>{9, top, 4, 9, top});
    FAIL("a repeated id passed");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("id 9 is given twice") != std::string::npos);  // the smallest repeated id
  }
  // Every door says the same: one collection, and a database.
  Collection c({2, 1, Metric::dot, {}, {}});
  c.upsert(5, std::vector<float>{1, 0}, std::vector<float>{1});
  try {
    c.remove_batch(std::vector<std::uint64_t>{5, 5});
    FAIL("a repeated id was removed");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("id 5 is given twice") != std::string::npos);
  }
  CHECK(c.contains(5));
}
