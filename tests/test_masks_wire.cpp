// Tags and masks over the wire: the version-2 codec fields at their extremes, version 1 unchanged
// (and refusing what it cannot carry), and a real server answering masked queries like the library.
#include <catch2/catch.hpp>

#include <algorithm>
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

constexpr std::uint64_t kMaxTag = std::numeric_limits<std::uint64_t>::max();

Frame frame_of(const std::vector<std::byte>& bytes) {
  const FrameScan s = scan_frame(bytes, kDefaultMaxFrame);
  REQUIRE(s.status == FrameScan::Status::complete);
  return s.frame;
}

// Every mask field at its extremes, one options value each.
std::vector<QueryOptions> extreme_masks() {
  std::vector<QueryOptions> out;
  QueryOptions o;
  o.tags_any = {0};
  out.push_back(o);
  o.tags_any.assign(QueryOptions::kMaxTagsAny, kMaxTag);
  o.tags_any.front() = 0;
  out.push_back(o);
  o = {};
  for (TagRange r : {TagRange{0, 0}, TagRange{kMaxTag, kMaxTag}, TagRange{0, kMaxTag}, TagRange{5, 4}}) {  // 5 > 4 travels; the collection refuses it
    o.tag_range = r;
    out.push_back(o);
  }
  o = {};
  o.exclude_ids = {kMaxTag};
  out.push_back(o);
  o.exclude_ids.assign(QueryOptions::kMaxExcludeIds, 0);
  o.exclude_ids.back() = kMaxTag - 1;
  out.push_back(o);
  o.tags_any = {1, 2};
  o.tag_range = TagRange{1, 1};
  out.push_back(o);
  return out;
}

using test::RunningServer;

}  // namespace

TEST_CASE("v2 codec: tags and every mask field at its extremes survive a round trip byte for byte", "[mask][wire]") {
  for (const QueryOptions& o : extreme_masks()) {
    const auto bytes = encode_request(Query{"c", QueryKind::soft, o, {1, 2}}, 7, 2);
    const auto back = std::get<Query>(decode_request(frame_of(bytes), 2));
    CHECK(back.options.tags_any == o.tags_any);
    CHECK(back.options.exclude_ids == o.exclude_ids);
    REQUIRE(back.options.tag_range.has_value() == o.tag_range.has_value());
    if (o.tag_range) CHECK((back.options.tag_range->lo == o.tag_range->lo && back.options.tag_range->hi == o.tag_range->hi));
    CHECK(back.queries == std::vector<float>{1, 2});
    CHECK(encode_request(back, 7, 2) == bytes);
  }
  const std::vector<std::uint64_t> tags{0, kMaxTag};
  const auto add = std::get<Add>(decode_request(frame_of(encode_request(Add{"c", {1, 2}, {3, 4}, tags}, 1, 2)), 2));
  CHECK(add.tags == tags);
  const auto up = std::get<Upsert>(decode_request(frame_of(encode_request(Upsert{"c", {5, 6}, {1, 2}, {3, 4}, tags}, 1, 2)), 2));
  CHECK(up.tags == tags);
  CHECK(std::get<Add>(decode_request(frame_of(encode_request(Add{"c", {1}, {3}}, 1, 2)), 2)).tags.empty());
  Entry e{9, {1}, {2}, kMaxTag};
  CHECK(std::get<GetReply>(decode_reply(Opcode::get, frame_of(encode_reply(Opcode::get, 1, GetReply{e}, 2)), QueryKind::soft, 2)).entry.tag == kMaxTag);
  SoftResult s;
  s.value = {1};
  s.mask_filtered_after_search = true;
  const auto soft = std::get<SoftReply>(decode_reply(Opcode::query, frame_of(encode_reply(Opcode::query, 1, SoftReply{{s}}, 2)), QueryKind::soft, 2));
  CHECK(soft.results.at(0).mask_filtered_after_search);
}

TEST_CASE("v1 codec: frames are unchanged, and tags or masks it cannot carry are refused, not dropped", "[mask][wire]") {
  // A v1 add is a v2 add without its trailing (empty) tag array: 4 bytes shorter, the same prefix.
  const auto v1 = encode_request(Add{"c", {1, 2}, {3}}, 1, 1), v2 = encode_request(Add{"c", {1, 2}, {3}}, 1, 2);
  REQUIRE(v2.size() == v1.size() + 4);
  CHECK(std::equal(v1.begin() + 4, v1.end(), v2.begin() + 4));  // past the length prefix
  const auto q1 = encode_request(Query{"c", QueryKind::hard, {}, {1}}, 1, 1);
  CHECK(std::get<Query>(decode_request(frame_of(q1), 1)).queries == std::vector<float>{1});
  CHECK(test::error_of([] { (void)encode_request(Add{"c", {1}, {2}, {3}}, 1, 1); }) == ErrorCode::unsupported);
  CHECK(test::error_of([] { (void)encode_request(Upsert{"c", {1}, {1}, {2}, {3}}, 1, 1); }) == ErrorCode::unsupported);
  for (const QueryOptions& o : extreme_masks())
    CHECK(test::error_of([&] { (void)encode_request(Query{"c", QueryKind::soft, o, {1}}, 1, 1); }) == ErrorCode::unsupported);
  // A get reply to a v1 client has no tag; a v2 decoder reading a v1 frame finds it missing.
  const auto g1 = encode_reply(Opcode::get, 1, GetReply{Entry{9, {1}, {2}, 5}}, 1);
  CHECK(std::get<GetReply>(decode_reply(Opcode::get, frame_of(g1), QueryKind::soft, 1)).entry.tag == 0);
  CHECK(test::error_of([&] { (void)decode_reply(Opcode::get, frame_of(g1), QueryKind::soft, 2); }) == ErrorCode::protocol_error);
}

TEST_CASE("v2 codec: a malformed mask is protocol_error", "[mask][wire]") {
  QueryOptions o;
  o.tag_range = TagRange{1, 2};
  auto bytes = encode_request(Query{"c", QueryKind::soft, o, {1}}, 1, 2);
  const auto with_flag = bytes;
  o.tag_range.reset();
  const auto without = encode_request(Query{"c", QueryKind::soft, o, {1}}, 1, 2);
  std::size_t at = 0;
  while (with_flag[at] == without[at]) ++at;  // the first byte that differs is the flag
  bytes[at] = std::byte{2};
  CHECK(test::error_of([&] { (void)decode_request(frame_of(bytes), 2); }) == ErrorCode::protocol_error);
  auto cut = encode_request(Query{"c", QueryKind::soft, QueryOptions{}, {}}, 1, 2);
  cut.resize(cut.size() - 2);  // an exclude_ids count cut short
  const std::uint32_t len = static_cast<std::uint32_t>(cut.size() - 4);
  std::memcpy(cut.data(), &len, 4);
  CHECK(test::error_of([&] { (void)decode_request(frame_of(cut), 2); }) == ErrorCode::protocol_error);
}

TEST_CASE("a v2 client stores tags and runs masked queries as the library does, and a v1 client is unaffected", "[mask][wire][server]") {
  RunningServer s;
  const std::size_t n = 400, d = 8, dv = 3;
  const std::vector<float> keys = test::normal_floats(n * d, 1), values = test::normal_floats(n * dv, 2), q = test::normal_floats(3 * d, 3);
  std::vector<std::uint64_t> tags(n);
  for (std::size_t i = 0; i < n; ++i) tags[i] = i < 200 ? i : kMaxTag - (i % 4);
  Client c2(s.client_at(2));
  REQUIRE(c2.protocol_version() == 2);
  c2.create_collection("m", CollectionConfig{d, dv});
  const auto ids = c2.add("m", keys, values, tags);
  c2.upsert("m", std::vector<std::uint64_t>{ids[0]}, std::span(keys).first(d), std::span(values).first(dv), std::vector<std::uint64_t>{77});
  CHECK(c2.get("m", ids[0]).tag == 77);
  CHECK(c2.get("m", ids[399]).tag == kMaxTag - 3);
  const auto local = s.db->collection("m");
  for (QueryOptions o : extreme_masks()) {
    if (o.tag_range && o.tag_range->lo > o.tag_range->hi) {
      CHECK(test::error_of([&] { (void)c2.query_soft("m", std::span(q).first(d), o); }) == ErrorCode::invalid_argument);
      continue;
    }
    o.top_m = 4;
    bool any = false;
    for (std::size_t i = 0; i < n && !any; ++i) {
      const std::uint64_t t = i == 0 ? 77 : tags[i];
      any = (o.tags_any.empty() || std::count(o.tags_any.begin(), o.tags_any.end(), t)) &&
            (!o.tag_range || (t >= o.tag_range->lo && t <= o.tag_range->hi)) && !std::count(o.exclude_ids.begin(), o.exclude_ids.end(), ids[i]);
    }
    if (!any) {
      CHECK(test::error_of([&] { (void)c2.query_soft("m", std::span(q).first(d), o); }) == ErrorCode::empty_collection);
      continue;
    }
    const SoftResult remote = c2.query_soft("m", std::span(q).first(d), o), mine = local->query_soft(std::span(q).first(d), o);
    CHECK(remote.value == mine.value);
    CHECK(remote.candidates == mine.candidates);
    REQUIRE(remote.top.size() == mine.top.size());
    for (std::size_t i = 0; i < mine.top.size(); ++i) CHECK(remote.top[i].id == mine.top[i].id);
    CHECK(c2.query_hard("m", std::span(q).first(d), o).id == local->query_hard(std::span(q).first(d), o).id);
    o.top_m = 0;
    const auto batch = c2.query_soft_batch("m", q, o);
    const auto mine_batch = local->query(q, Retrieval::soft, o);
    for (std::size_t b = 0; b < 3; ++b) CHECK(batch[b].value == mine_batch.soft[b].value);
  }
  QueryOptions too_many;
  too_many.tags_any.assign(QueryOptions::kMaxTagsAny + 1, 1);
  CHECK(test::error_of([&] { (void)c2.query_hard("m", std::span(q).first(d), too_many); }) == ErrorCode::invalid_argument);

  Client c1(s.client_at(1));
  REQUIRE(c1.protocol_version() == 1);
  const auto plain = c1.add("m", std::span(keys).first(d), std::span(values).first(dv));
  CHECK(c1.get("m", ids[0]).key == c2.get("m", ids[0]).key);  // v1 get: the same entry, no tag field
  CHECK(c2.get("m", plain[0]).tag == 0);
  CHECK(test::error_of([&] { (void)c1.add("m", std::span(keys).first(d), std::span(values).first(dv), std::vector<std::uint64_t>{1}); }) ==
        ErrorCode::unsupported);
  QueryOptions masked;
  masked.tags_any = {1};
  CHECK(test::error_of([&] { (void)c1.query_soft("m", std::span(q).first(d), masked); }) == ErrorCode::unsupported);
  CHECK(c1.describe("m").size == n + 1);  // the refused add stored nothing
  CHECK(c1.query_soft("m", std::span(q).first(d)).candidates == n + 1);
}
