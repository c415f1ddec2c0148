// Multi-head collections and iterative retrieval over the wire: the version-2 codec fields at their
// extremes, version 1 unchanged and refusing what it cannot carry, and a real server answering like
// the library, with every hostile value refused by a typed error.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "errors.hpp"
#include "reference.hpp"
#include "running_server.hpp"
#include "server.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"
#include "wire/protocol.hpp"

using namespace softkv;
using namespace softkv::wire;

namespace {

Frame frame_of(const std::vector<std::byte>& bytes) {
  const FrameScan s = scan_frame(bytes, kDefaultMaxFrame);
  REQUIRE(s.status == FrameScan::Status::complete);
  return s.frame;
}

CollectionConfig heads_config(std::size_t d, std::size_t dv, std::size_t h) {
  CollectionConfig c{d, dv};
  c.heads = h;
  return c;
}

using test::RunningServer;

}  // namespace

TEST_CASE("wire: create carries heads and a query its iterations in version 2 only, at their extremes", "[heads][wire]") {
  for (std::size_t h : {std::size_t{1}, std::size_t{2}, std::size_t{1024}, std::size_t{0xFFFFFFFF}}) {
    const auto bytes = encode_request(Create{"c", heads_config(4, 4, h)}, 1, 2);
    CHECK(std::get<Create>(decode_request(frame_of(bytes), 2)).config.heads == h);  // the range is the collection's
  }
  const auto v1 = encode_request(Create{"c", heads_config(4, 4, 1)}, 1, 1);
  CHECK(std::get<Create>(decode_request(frame_of(v1), 1)).config.heads == 1);
  CHECK(test::error_of([] { (void)encode_request(Create{"c", heads_config(4, 4, 2)}, 1, 1); }) == ErrorCode::unsupported);
  // A compact collection cannot be created over version 1 either (it would be created as f32 in silence).
  for (const auto& [k, v] : {std::pair{Precision::f16, Precision::f32}, std::pair{Precision::f32, Precision::bf16}, std::pair{Precision::i8, Precision::f16}}) {
    CollectionConfig compact = heads_config(4, 4, 1);
    compact.key_precision = k;
    compact.value_precision = v;
    CHECK(test::error_of([&] { (void)encode_request(Create{"c", compact}, 1, 1); }) == ErrorCode::unsupported);
    CHECK(std::get<Create>(decode_request(frame_of(encode_request(Create{"c", compact}, 1, 2)), 2)).config.key_precision == k);
  }
  // A version-2 create cut before its heads field is malformed.
  auto cut = encode_request(Create{"c", heads_config(4, 4, 2)}, 1, 2);
  cut.resize(cut.size() - 4);
  const auto len = static_cast<std::uint32_t>(cut.size() - 4);
  std::memcpy(cut.data(), &len, 4);
  CHECK(test::error_of([&] { (void)decode_request(frame_of(cut), 2); }) == ErrorCode::protocol_error);

  for (const auto& [it, tol] : std::vector<std::pair<std::size_t, float>>{
           {1, 0.0f}, {0, 0.0f}, {1000, 1e-4f}, {1001, std::numeric_limits<float>::quiet_NaN()}, {0xFFFFFFFF, -1.0f},
           {5, std::numeric_limits<float>::infinity()}}) {
    QueryOptions o;
    o.iterations = it;
    o.tolerance = tol;
    const auto bytes = encode_request(Query{"c", QueryKind::soft, o, {1, 2}}, 3, 2);
    const Query back = std::get<Query>(decode_request(frame_of(bytes), 2));
    CHECK(back.options.iterations == it);
    CHECK(std::memcmp(&back.options.tolerance, &tol, 4) == 0);  // bit for bit, NaN included
    CHECK(back.decoded_version == 2);
    if (it != 1 || tol != 0.0f)  // NaN != 0 too
      CHECK(test::error_of([&] { (void)encode_request(Query{"c", QueryKind::soft, o, {1, 2}}, 3, 1); }) == ErrorCode::unsupported);
  }
  CHECK(std::get<Query>(decode_request(frame_of(encode_request(Query{"c", QueryKind::soft, {}, {1}}, 3, 1)), 1)).decoded_version == 1);
}

TEST_CASE("wire: per-head soft and hard replies round trip in version 2 and are absent in version 1", "[heads][wire]") {
  SoftResult s;
  s.value = {1, 2, 3, 4};
  s.lse = 1.5;
  s.iterations_run = 7;
  s.last_change = 1e-9;
  s.heads = {HeadResult{1.5, 0.25f, {{3, 0.5f, 0.25f}}}, HeadResult{-2.0, -1.0f, {}}};
  const auto soft2 = encode_reply(Opcode::query, 9, SoftReply{{s}}, 2);
  const SoftResult back = std::get<SoftReply>(decode_reply(Opcode::query, frame_of(soft2), QueryKind::soft, 2)).results.at(0);
  CHECK(back.iterations_run == 7);
  CHECK(back.last_change == 1e-9);
  REQUIRE(back.heads.size() == 2);
  CHECK(back.heads[0].top.at(0).id == 3);
  CHECK(back.heads[1].lse == -2.0);
  CHECK(back.heads[1].max_score == -1.0f);
  const auto soft1 = encode_reply(Opcode::query, 9, SoftReply{{s}}, 1);
  CHECK(std::get<SoftReply>(decode_reply(Opcode::query, frame_of(soft1), QueryKind::soft, 1)).results.at(0).heads.empty());
  CHECK(soft2.size() > soft1.size());

  HardResult h;
  h.id = 4;
  h.value = {1, 2};
  h.head_ids = {4, ~std::uint64_t{0} - 1};
  h.head_scores = {1.0f, -3.0f};
  const auto hard2 = encode_reply(Opcode::query, 9, HardReply{{h}}, 2);
  const HardResult hb = std::get<HardReply>(decode_reply(Opcode::query, frame_of(hard2), QueryKind::hard, 2)).results.at(0);
  CHECK(hb.head_ids == h.head_ids);
  CHECK(hb.head_scores == h.head_scores);
  // A reply claiming more heads than its bytes hold is malformed, not a huge allocation.
  auto lying = hard2;
  const std::size_t count_at = lying.size() - 4 - 2 * 12;
  const std::uint32_t huge = 0xFFFFFFFF;
  std::memcpy(lying.data() + count_at, &huge, 4);
  CHECK(test::error_of([&] { (void)decode_reply(Opcode::query, frame_of(lying), QueryKind::hard, 2); }) == ErrorCode::protocol_error);
}

TEST_CASE("server: multi-head and iterative queries answer as the library, v1 is refused, hostile values are typed errors", "[heads][iterate][wire][server]") {
  RunningServer s;
  const std::size_t n = 300, d = 16, h = 4;
  const std::vector<float> keys = test::normal_floats(n * d, 1), values = test::normal_floats(n * d, 2), q = test::normal_floats(3 * d, 3);
  Client c2(s.client_at(2));
  REQUIRE(c2.protocol_version() == 2);
  c2.create_collection("mh", heads_config(d, d, h));
  c2.add("mh", keys, values);
  CHECK(c2.describe("mh").heads == h);
  const auto local = s.db->collection("mh");
  CHECK(local->config().heads == h);

  QueryOptions o;
  o.top_m = 3;
  const SoftResult remote = c2.query_soft("mh", std::span(q).first(d), o), mine = local->query_soft(std::span(q).first(d), o);
  CHECK(remote.value == mine.value);
  REQUIRE(remote.heads.size() == h);
  for (std::size_t j = 0; j < h; ++j) {
    CHECK(remote.heads[j].lse == mine.heads[j].lse);
    CHECK(remote.heads[j].max_score == mine.heads[j].max_score);
    REQUIRE(remote.heads[j].top.size() == 3);
    CHECK(remote.heads[j].top[0].id == mine.heads[j].top[0].id);
  }
  const HardResult hard = c2.query_hard("mh", std::span(q).first(d));
  CHECK(hard.head_ids == local->query_hard(std::span(q).first(d)).head_ids);
  CHECK(hard.head_scores.size() == h);
  const auto batch = c2.query_soft_batch("mh", q);
  REQUIRE(batch.size() == 3);
  for (std::size_t b = 0; b < 3; ++b) CHECK(batch[b].value == local->query_soft(std::span(q).subspan(b * d, d)).value);

  QueryOptions it;
  it.iterations = 4;
  it.tolerance = 1e-6f;
  const SoftResult iter = c2.query_soft("mh", std::span(q).first(d), it);
  CHECK(iter.value == local->query_soft(std::span(q).first(d), it).value);
  CHECK(iter.iterations_run >= 1);
  CHECK(iter.iterations_run <= 4);

  // Hostile values: each a typed error that leaves the connection usable.
  for (std::size_t bad : {std::size_t{0}, std::size_t{1025}, std::size_t{3}, std::size_t{0xFFFFFFFF}})
    CHECK(test::error_of([&] { c2.create_collection("bad", heads_config(12, 12, bad == 3 ? 5 : bad)); }) == ErrorCode::invalid_argument);
  CHECK_FALSE(s.db->has_collection("bad"));
  for (const auto& [iterations, tolerance] : std::vector<std::pair<std::size_t, float>>{
           {0, 0.0f}, {1001, 0.0f}, {0xFFFFFFFF, 0.0f}, {2, std::numeric_limits<float>::quiet_NaN()}, {2, -1.0f},
           {2, -std::numeric_limits<float>::infinity()}}) {
    QueryOptions bad;
    bad.iterations = iterations;
    bad.tolerance = tolerance;
    CHECK(test::error_of([&] { (void)c2.query_soft("mh", std::span(q).first(d), bad); }) == ErrorCode::invalid_argument);
  }
  QueryOptions pruned;
  pruned.top_k = 5;
  CHECK(test::error_of([&] { (void)c2.query_soft("mh", std::span(q).first(d), pruned); }) == ErrorCode::unsupported);
  c2.create_collection("wide", CollectionConfig{d, 2});
  c2.add("wide", std::span(keys).first(d), std::vector<float>{1, 2});
  CHECK(test::error_of([&] { (void)c2.query_soft("wide", std::span(q).first(d), it); }) == ErrorCode::invalid_argument);
  CHECK(c2.query_soft("mh", std::span(q).first(d)).heads.size() == h);  // still serving

  // Version 1: cannot create or query multi-head collections, cannot ask for iterations; single-head works.
  Client c1(s.client_at(1));
  REQUIRE(c1.protocol_version() == 1);
  CHECK(test::error_of([&] { c1.create_collection("v1", heads_config(4, 4, 2)); }) == ErrorCode::unsupported);
  try {
    (void)c1.query_soft("mh", std::span(q).first(d));
    FAIL("a v1 query on a multi-head collection was answered");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::unsupported);
    CHECK(std::string(e.what()).find("protocol version 2") != std::string::npos);
  }
  CHECK(test::error_of([&] { (void)c1.query_hard("mh", std::span(q).first(d)); }) == ErrorCode::unsupported);
  CHECK(test::error_of([&] { (void)c1.query_soft("wide", std::span(q).first(d), it); }) == ErrorCode::unsupported);
  CHECK(c1.describe("mh").dim == d);  // describe and get are true in v1 (full rows, no heads field)
  CHECK(c1.query_soft("wide", std::span(q).first(d)).value == std::vector<float>{1, 2});
}
