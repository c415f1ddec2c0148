// The wire codec without sockets: round trips, a frame split at every byte offset, hostile frames.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "errors.hpp"
#include "softkv/error.hpp"
#include "codec/config.hpp"
#include "codec/options.hpp"
#include "wire/protocol.hpp"

using namespace softkv;
using namespace softkv::wire;

namespace {

Frame frame_of(const std::vector<std::byte>& bytes) {
  const FrameScan scan = scan_frame(bytes, kDefaultMaxFrame);
  REQUIRE(scan.status == FrameScan::Status::complete);
  REQUIRE(scan.size == bytes.size());
  return scan.frame;
}

std::vector<Request> sample_requests() {
  CollectionConfig config{3, 2, Metric::cosine, 0.5f, {}};
  config.index.kind = IndexKind::ivf;
  config.index.ivf_nlist = 7;
  QueryOptions options;
  options.temperature = 0.25f;
  options.top_m = 3;
  options.top_k = 9;
  options.nprobe = 4;
  options.exact = true;
  return {Hello{}, Auth{"secret"}, Ping{}, Create{"c", config}, Drop{"c"}, List{}, Describe{"c"},
          Add{"c", {1, 2, 3}, {4, 5}}, Upsert{"c", {7}, {1, 2, 3}, {4, 5}}, Remove{"c", {1, 2}}, Get{"c", 9},
          Query{"c", QueryKind::hard, options, {1, 2, 3, 4, 5, 6}}, Snapshot{}, Stats{}};
}

}  // namespace

TEST_CASE("every request survives an encode/decode round trip", "[wire]") {
  for (const Request& r : sample_requests()) {
    const auto bytes = encode_request(r, 42);
    const Frame f = frame_of(bytes);
    CHECK(f.request_id == 42);
    const Request back = decode_request(f);
    REQUIRE(back.index() == r.index());
    CHECK(encode_request(back, 42) == bytes);  // nothing lost: the same bytes again
  }
  const auto q = std::get<Query>(decode_request(frame_of(encode_request(sample_requests()[11], 1))));
  CHECK(q.options.temperature == 0.25f);
  CHECK_FALSE(q.options.scale.has_value());
  CHECK(q.options.top_k == std::optional<std::size_t>(9));
  CHECK(q.options.exact);
  CHECK(q.queries.size() == 6);
}

TEST_CASE("replies survive a round trip, errors included", "[wire]") {
  SoftResult s;
  s.value = {1.5f, -2.0f};
  s.lse = 3.25;
  s.max_score = 1.0f;
  s.candidates = 10;
  s.tail_bound = 1e-3;
  s.tail_bound_guaranteed = false;
  s.searched_with = IndexKind::hnsw;
  s.top = {{4, 0.75f, 1.0f}, {2, 0.25f, 0.5f}};
  const auto soft = std::get<SoftReply>(decode_reply(Opcode::query, frame_of(encode_reply(Opcode::query, 5, SoftReply{{s, s}}))));
  REQUIRE(soft.results.size() == 2);
  CHECK(soft.results[1].value == s.value);
  CHECK(soft.results[1].lse == s.lse);
  CHECK(soft.results[1].top[0].id == 4);
  CHECK(soft.results[1].searched_with == IndexKind::hnsw);
  const HardResult h{7, 0.5f, {1, 2}, IndexKind::ivf};
  const auto hard = std::get<HardReply>(decode_reply(Opcode::query, frame_of(encode_reply(Opcode::query, 5, HardReply{{h}})), QueryKind::hard));
  CHECK(hard.results.at(0).id == 7);
  CHECK(hard.results.at(0).value == h.value);
  const auto err = std::get<ErrorReply>(decode_reply(Opcode::add, frame_of(encode_reply(Opcode::add, 5, ErrorReply{ErrorCode::non_finite, "NaN"}))));
  CHECK(err.code == ErrorCode::non_finite);
  CHECK(err.message == "NaN");
  const auto names = std::get<NamesReply>(decode_reply(Opcode::list, frame_of(encode_reply(Opcode::list, 1, NamesReply{{"a", "bb"}}))));
  CHECK(names.names == std::vector<std::string>{"a", "bb"});
}

TEST_CASE("a frame split at every byte offset is 'need more' until it is whole", "[wire]") {
  // Two frames back to back, fed one growing prefix at a time.
  auto bytes = encode_request(sample_requests()[7], 1);
  const auto second = encode_request(sample_requests()[11], 2);
  const std::size_t first_size = bytes.size();
  bytes.insert(bytes.end(), second.begin(), second.end());
  for (std::size_t cut = 0; cut <= bytes.size(); ++cut) {
    const FrameScan scan = scan_frame(std::span(bytes).first(cut), kDefaultMaxFrame);
    if (cut < first_size) {
      CHECK(scan.status == FrameScan::Status::need_more);
    } else {
      REQUIRE(scan.status == FrameScan::Status::complete);
      CHECK(scan.size == first_size);
      CHECK(scan.frame.request_id == 1);
      // What follows the first frame is the second, found the same way.
      const FrameScan next = scan_frame(std::span(bytes).subspan(first_size, cut - first_size), kDefaultMaxFrame);
      CHECK(next.status == (cut == bytes.size() ? FrameScan::Status::complete : FrameScan::Status::need_more));
    }
  }
}

TEST_CASE("hostile frames are refused from their length alone", "[wire]") {
  std::vector<std::byte> huge(4);
  const std::uint32_t four_gib = 0xFFFFFFFFu;
  std::memcpy(huge.data(), &four_gib, 4);
  CHECK(scan_frame(huge, kDefaultMaxFrame).status == FrameScan::Status::too_large);
  CHECK(scan_frame(huge, kDefaultMaxFrame).claimed == four_gib);
  std::vector<std::byte> tiny(4);
  const std::uint32_t five = 5;
  std::memcpy(tiny.data(), &five, 4);
  CHECK(scan_frame(tiny, kDefaultMaxFrame).status == FrameScan::Status::malformed);
}

TEST_CASE("malformed payloads and unknown opcodes are typed protocol errors", "[wire]") {
  auto code_of = [](const Frame& f) {
    try {
      (void)decode_request(f);
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode{};
  };
  const auto unknown = encode_frame(0x55, 3, {});
  CHECK(code_of(frame_of(unknown)) == ErrorCode::protocol_error);
  // Every truncation of a query payload (re-framed so the frame itself is whole) is refused.
  const auto good = encode_request(sample_requests()[11], 4);
  const Frame f = frame_of(good);
  for (std::size_t n = 0; n < f.payload.size(); ++n) {
    const auto cut = encode_frame(f.opcode, 4, f.payload.first(n));
    CHECK(code_of(frame_of(cut)) == ErrorCode::protocol_error);
  }
  // A count claiming more floats than the frame holds is refused before allocating them.
  auto lying = encode_request(Add{"c", {1, 2}, {3}}, 5);
  const std::uint32_t billions = 0x7FFFFFFF;
  std::memcpy(lying.data() + 4 + 9 + 2 + 1, &billions, 4);  // the key count after the 1-byte name
  CHECK(code_of(frame_of(lying)) == ErrorCode::protocol_error);
  // Trailing bytes are not ignored.
  auto longer = f.payload.size();
  std::vector<std::byte> padded(f.payload.begin(), f.payload.end());
  padded.push_back(std::byte{0});
  CHECK(code_of(frame_of(encode_frame(f.opcode, 4, padded))) == ErrorCode::protocol_error);
  CHECK(longer > 0);
  // Option flag bits 5-7 are reserved: a frame setting any of them is refused, not half-read.
  for (int bit = 5; bit < 8; ++bit) {
    auto flagged = good;
    const std::size_t flags_at = 4 + 9 + (2 + 1) + 1;  // length, frame header, name "c", kind
    REQUIRE(flagged[flags_at] == std::byte{1 | 4 | 16});  // temperature, top_k, exact
    flagged[flags_at] |= std::byte(1u << bit);
    CHECK(code_of(frame_of(flagged)) == ErrorCode::protocol_error);
  }
}

TEST_CASE("fuzz regressions: inputs the fuzzers once broke", "[wire]") {
  // fuzz_frame: an upsert whose arrays are empty made the decoder memcpy into a null pointer (UB,
  // caught by UBSan). Now it decodes (empty ids) or is refused; either way without UB.
  const unsigned char empty_arrays[] = {0x0f, 0x00, 0x00, 0x00, 0x21, 0x6a, 0xef, 0x0b, 0x00, 0x00, 0x00, 0x00,
                                        0x0b, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf6, 0xff};
  const std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(empty_arrays),
                                     reinterpret_cast<const std::byte*>(empty_arrays) + sizeof empty_arrays);
  const FrameScan scan = scan_frame(bytes, kDefaultMaxFrame);
  REQUIRE(scan.status == FrameScan::Status::complete);
  try {
    const Request r = decode_request(scan.frame);
    CHECK(std::holds_alternative<Upsert>(r));
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::protocol_error);
  }
  // Zero-length arrays round-trip.
  const auto empty = std::get<Upsert>(decode_request(scan_frame(encode_request(Upsert{"c", {}, {}, {}}, 1), kDefaultMaxFrame).frame));
  CHECK(empty.ids.empty());
  CHECK(empty.keys.empty());
}

TEST_CASE("error messages go out as valid UTF-8: invalid bytes escaped, long ones cut at a character boundary", "[wire]") {
  using namespace std::string_literals;
  // Well-formed text passes unchanged, 1- to 4-byte characters and backslashes included.
  const std::string text = "a\\b \xC3\xA9 \xE2\x82\xAC \xF0\x9D\x84\x9E \xF4\x8F\xBF\xBF \xED\x9F\xBF";
  CHECK(wire_message(text) == text);
  // Each byte outside a well-formed sequence becomes \xNN.
  CHECK(wire_message("f\xE3"s) == "f\\xE3");                               // a name 66 E3 (truncated 3-byte start)
  CHECK(wire_message("\xC0\xAF"s) == "\\xC0\\xAF");                        // overlong '/'
  CHECK(wire_message("\xE0\x80\xAF"s) == "\\xE0\\x80\\xAF");               // overlong 3-byte
  CHECK(wire_message("\xED\xA0\x80"s) == "\\xED\\xA0\\x80");               // a UTF-16 surrogate
  CHECK(wire_message("\xF4\x90\x80\x80"s) == "\\xF4\\x90\\x80\\x80");      // above U+10FFFF
  CHECK(wire_message("\xF8\x88\x80\x80\x80"s) == "\\xF8\\x88\\x80\\x80\\x80");  // 5-byte form
  CHECK(wire_message("\x80x\xFF"s) == "\\x80x\\xFF");                      // lone continuation, 0xFF
  CHECK(wire_message("\xE2\x82"s) == "\\xE2\\x82");                         // cut-off character at the end
  CHECK(wire_message("\xE2\x82\xC3\xA9"s) == "\\xE2\\x82\xC3\xA9");         // resynchronises on the next character
  CHECK(wire_message("nul\0in"s) == "nul\0in"s);                            // U+0000 is valid UTF-8

  // Cutting: a message made of known pieces (each a character or an invalid byte, 1 to 4 bytes out),
  // shifted by 0-3 bytes so a piece boundary falls on every offset around the limit. The result is
  // the longest run of whole pieces that fits.
  struct Piece { std::string in, out; };
  const std::vector<Piece> kinds = {{"a", "a"}, {"\xC3\xA9", "\xC3\xA9"}, {"\xE2\x82\xAC", "\xE2\x82\xAC"},
                                    {"\xF0\x9D\x84\x9E", "\xF0\x9D\x84\x9E"}, {"\xE3", "\\xE3"}};
  for (std::size_t shift = 0; shift < 4; ++shift) {
    std::string in(shift, 'x');
    std::vector<std::string> outs(shift, "x");
    for (std::size_t i = 0; in.size() < 2 * kMaxErrorMessage; ++i) {
      const Piece& p = kinds[(i * 7 + i / 5) % kinds.size()];
      in += p.in;
      outs.push_back(p.out);
    }
    for (std::size_t limit = kMaxErrorMessage - 8; limit <= kMaxErrorMessage + 8; ++limit) {
      std::string expected;
      for (const auto& o : outs) {
        if (expected.size() + o.size() > limit) break;
        expected += o;
      }
      const std::string got = wire_message(in, limit);
      INFO("shift " << shift << ", limit " << limit);
      CHECK(got == expected);
      CHECK(got.size() + 4 > limit);  // nothing more than one piece is dropped at the cut
    }
  }
  // And encode_reply applies it: the message that arrives is at most 4000 bytes of valid UTF-8.
  const std::string long_bad = std::string(3999, 'y') + "\xE3\xE3";
  const auto reply = encode_reply(Opcode::create, 1, ErrorReply{ErrorCode::invalid_argument, long_bad});
  const auto back = std::get<ErrorReply>(decode_reply(Opcode::create, frame_of(reply)));
  CHECK(back.message == std::string(3999, 'y'));
}

TEST_CASE("every QueryOptions field on the wire survives a version-3 round trip, and versions 1-2 refuse what they cannot carry", "[wire]") {
  // A field added to QueryOptions changes its size: this fails until the field is given its form in
  // src/codec/options.cpp (the one codec of the wire and of MPI), here and in the full-form test
  // below, and in docs/PROTOCOL.md (or is documented as not on the wire, as threads: the server chooses it).
  CHECK(sizeof(QueryOptions) == 184);  // x86-64, libstdc++
  QueryOptions o;
  o.temperature = 0.5f;
  o.top_m = 0xFFFFFFFF;
  o.threads = 3;  // not on the wire
  o.top_k = 0xFFFFFFFF;
  o.epsilon = 0.125f;
  o.error_target = 0.0625f;
  o.ef_search = 1;
  o.nprobe = 0xFFFFFFFF;
  o.check_sample = 0;
  o.exact = true;
  o.tags_any = {0, ~std::uint64_t{0}};
  o.tag_range = TagRange{1, ~std::uint64_t{0}};
  o.exclude_ids = {~std::uint64_t{0}};
  o.iterations = 1000;
  o.tolerance = 1e-30f;
  const Query q{"c", QueryKind::soft, o, {1, 2}};
  const auto back = std::get<Query>(decode_request(frame_of(encode_request(q, 7, 3)), 3));
  CHECK(back.options.temperature == o.temperature);
  CHECK_FALSE(back.options.scale.has_value());
  CHECK(back.options.top_m == o.top_m);
  CHECK(back.options.threads == 0);
  CHECK(back.options.top_k == o.top_k);
  CHECK(back.options.epsilon == o.epsilon);
  CHECK(back.options.error_target == o.error_target);
  CHECK(back.options.ef_search == o.ef_search);
  CHECK(back.options.nprobe == o.nprobe);
  CHECK(back.options.check_sample == 0);
  CHECK(back.options.exact);
  CHECK(back.options.tags_any == o.tags_any);
  CHECK(back.options.tag_range->lo == 1);
  CHECK(back.options.tag_range->hi == ~std::uint64_t{0});
  CHECK(back.options.exclude_ids == o.exclude_ids);
  CHECK(back.options.iterations == 1000);
  CHECK(back.options.tolerance == 1e-30f);
  for (std::uint16_t version : {std::uint16_t{1}, std::uint16_t{2}}) {
    QueryOptions v3_only;
    v3_only.error_target = 0.1f;
    CHECK_THROWS_AS(encode_request(Query{"c", QueryKind::soft, v3_only, {1}}, 1, version), Error);
    QueryOptions sample;
    sample.check_sample = 8;
    CHECK_THROWS_AS(encode_request(Query{"c", QueryKind::soft, sample, {1}}, 1, version), Error);
    // A version-2 frame decoded as such leaves the v3 fields at their defaults.
    const auto old = std::get<Query>(decode_request(frame_of(encode_request(Query{"c", QueryKind::soft, {}, {1}}, 1, version)), version));
    CHECK_FALSE(old.options.error_target.has_value());
    CHECK(old.options.check_sample == QueryOptions{}.check_sample);
  }
  // The flag byte of error_target takes 0 or 1 only.
  auto bytes = encode_request(Query{"c", QueryKind::soft, {}, {1}}, 1, 3);
  const std::size_t flag_at = bytes.size() - 4 - 4 - 4 - 4 - 1;  // before f32 target, u32 check_sample, u32 count + 1 float
  REQUIRE(bytes[flag_at] == std::byte{0});
  bytes[flag_at] = std::byte{2};
  CHECK_THROWS_AS(decode_request(frame_of(bytes), 3), Error);

  SoftResult s;
  s.value = {1.0f};
  s.candidates = 5;
  s.rows_scored = 1u << 20;
  s.error_estimate = 0.0078125;
  const auto v3 = std::get<SoftReply>(decode_reply(Opcode::query, frame_of(encode_reply(Opcode::query, 5, SoftReply{{s}}, 3)), QueryKind::soft, 3));
  CHECK(v3.results.at(0).rows_scored == s.rows_scored);
  CHECK(v3.results.at(0).error_estimate == s.error_estimate);
  const auto v2 = std::get<SoftReply>(decode_reply(Opcode::query, frame_of(encode_reply(Opcode::query, 5, SoftReply{{s}}, 2)), QueryKind::soft, 2));
  CHECK(v2.results.at(0).rows_scored == 5);  // a version-2 reply says candidates
  CHECK(v2.results.at(0).error_estimate == 0.0);
}

TEST_CASE("the full form of QueryOptions (MPI) carries every field, threads included, and no form truncates a count", "[wire]") {
  QueryOptions o;
  o.scale = 3.5f;
  o.top_m = 0xFFFFFFFF;
  o.threads = ~std::size_t{0};
  o.epsilon = 0.5f;
  o.error_target = 0.25f;
  o.ef_search = 0xFFFFFFFF;
  o.nprobe = 1;
  o.check_sample = 12345;
  o.tags_any = {7};
  o.exclude_ids = {0, 1, 2};
  o.tag_range = TagRange{0, 0};
  o.iterations = 7;
  o.tolerance = 0.5f;
  detail::ByteWriter w;
  detail::put_query_options(w, o, detail::OptionsForm::full);
  detail::ByteReader r(w.bytes(), ErrorCode::internal);
  const QueryOptions back = detail::get_query_options(r, detail::OptionsForm::full);
  CHECK(r.remaining() == 0);
  CHECK(back.scale == o.scale);
  CHECK_FALSE(back.temperature.has_value());
  CHECK(back.top_m == o.top_m);
  CHECK(back.threads == o.threads);
  CHECK(back.epsilon == o.epsilon);
  CHECK_FALSE(back.top_k.has_value());
  CHECK(back.error_target == o.error_target);
  CHECK(back.ef_search == o.ef_search);
  CHECK(back.nprobe == o.nprobe);
  CHECK(back.check_sample == o.check_sample);
  CHECK_FALSE(back.exact);
  CHECK(back.tags_any == o.tags_any);
  CHECK(back.exclude_ids == o.exclude_ids);
  REQUIRE(back.tag_range.has_value());
  CHECK(back.tag_range->hi == 0);
  CHECK(back.iterations == o.iterations);
  CHECK(back.tolerance == o.tolerance);
  // Every prefix of the bytes is a truncation error with the reader's code.
  for (std::size_t cut = 0; cut < w.bytes().size(); ++cut) {
    detail::ByteReader part(std::span(w.bytes()).first(cut), ErrorCode::internal);
    try {
      (void)detail::get_query_options(part, detail::OptionsForm::full);
      FAIL("a prefix of " << cut << " bytes decoded");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::internal);
    }
  }
  // A count wider than its u32 field is refused in every form, never truncated (2^32 + 5 would read as 5).
  for (const auto form : {detail::OptionsForm::wire_v1, detail::OptionsForm::wire_v3, detail::OptionsForm::full}) {
    for (int field = 0; field < 4; ++field) {
      QueryOptions wide;
      const std::size_t big = (std::size_t{1} << 32) + 5;
      if (field == 0) wide.top_m = big;
      if (field == 1) wide.top_k = big;
      if (field == 2) wide.ef_search = big;
      if (field == 3) wide.nprobe = big;
      detail::ByteWriter ww;
      try {
        detail::put_query_options(ww, wide, form);
        FAIL("field " << field << " was encoded");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::invalid_argument);
      }
    }
  }
}

TEST_CASE("CollectionConfig: every form round-trips what it can carry, with the bytes older readers expect", "[wire][config]") {
  using detail::ConfigForm;
  constexpr std::size_t kFixed = 4 + 4 + 1 + 1 + 4 + 1 + 4 + 4 + 4 + 8 + 8 + 4;  // dim ... rebuild_fraction
  CollectionConfig plain{7, 3};
  plain.scale = 0.25f;
  plain.index.kind = IndexKind::hnsw;
  plain.index.hnsw_m = std::numeric_limits<std::uint32_t>::max();
  plain.index.ivf_train_size = std::numeric_limits<std::uint64_t>::max();
  CollectionConfig compact = plain;
  compact.key_precision = Precision::i8;
  compact.value_precision = Precision::bf16;
  CollectionConfig heads = plain;
  heads.heads = 7;
  CollectionConfig both = compact;
  both.heads = std::numeric_limits<std::uint32_t>::max();
  struct Expect {
    ConfigForm form;
    std::size_t plain, compact, heads, both;  // tail bytes written for each config
  };
  for (const Expect& e : {Expect{ConfigForm::wire_v1, 0, 0, 0, 0}, Expect{ConfigForm::snapshot_v2, 0, 0, 0, 0},
                          Expect{ConfigForm::wire, 6, 6, 6, 6}, Expect{ConfigForm::snapshot, 2, 2, 6, 6},
                          Expect{ConfigForm::log_record, 0, 2, 6, 6}}) {
    const bool has_tail = e.compact != 0;
    const std::pair<const CollectionConfig*, std::size_t> cases[] = {{&plain, e.plain}, {&compact, e.compact}, {&heads, e.heads}, {&both, e.both}};
    for (const auto& [config, tail] : cases) {
      INFO("form " << int(e.form) << ", heads " << config->heads << ", key precision " << int(config->key_precision));
      detail::ByteWriter w;
      detail::put_config(w, *config, e.form);
      CHECK(w.bytes().size() == kFixed + tail);
      detail::ByteReader r(w.bytes(), ErrorCode::protocol_error);
      const CollectionConfig back = detail::get_config(r, e.form);
      CHECK(r.remaining() == 0);
      CHECK(back.dim == config->dim);
      CHECK(back.scale == config->scale);
      CHECK(back.index.hnsw_m == config->index.hnsw_m);
      CHECK(back.index.ivf_train_size == config->index.ivf_train_size);
      CHECK(back.key_precision == (has_tail ? config->key_precision : Precision::f32));
      CHECK(back.value_precision == (has_tail ? config->value_precision : Precision::f32));
      CHECK(back.heads == (has_tail ? config->heads : 1u));
      // a group is read whole or refused: a config cut inside its tail is an error, never a default
      if (tail != 0) {
        detail::ByteReader cut(std::span(w.bytes()).first(kFixed + tail - 1), ErrorCode::protocol_error);
        CHECK(test::error_of([&] { (void)detail::get_config(cut, e.form); }) == ErrorCode::protocol_error);
      }
      // a form that requires its groups refuses a config without them
      if (e.form == ConfigForm::wire || e.form == ConfigForm::snapshot) {
        detail::ByteReader bare(std::span(w.bytes()).first(kFixed), ErrorCode::protocol_error);
        CHECK(test::error_of([&] { (void)detail::get_config(bare, e.form); }) == ErrorCode::protocol_error);
      }
    }
  }
  // Wider than the 32-bit fields: refused, never truncated.
  CollectionConfig wide = plain;
  wide.heads = std::size_t{1} << 32;
  detail::ByteWriter w;
  CHECK_THROWS_AS(detail::put_config(w, wide, ConfigForm::wire), Error);
}
