// The wire codec: every field little-endian, strings as u16 length + bytes, arrays counted before use.
#include "wire/protocol.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "overloaded.hpp"
#include "codec/bytes.hpp"
#include "codec/config.hpp"
#include "codec/options.hpp"

namespace softkv::wire {

using detail::ByteReader;
using detail::ByteWriter;
using detail::get_config;
using detail::Overloaded;
using detail::put_config;

namespace {

ByteReader reader(const Frame& f) { return ByteReader(f.payload, ErrorCode::protocol_error); }

[[noreturn]] void malformed(const std::string& what) { throw Error(ErrorCode::protocol_error, what); }

// A field version 1 cannot carry is refused rather than dropped: the answer would silently differ.
void require_v2(std::uint16_t version, bool needed, std::string_view what) {
  if (needed && version < 2)
    throw Error(ErrorCode::unsupported, std::string(what) + " need protocol version 2; this connection speaks " + std::to_string(version));
}


// A top-m list: u32 count, then count x (u64 id, f32 weight, f32 score). No reserve: every read is
// bounded by the frame.
void put_contributors(ByteWriter& w, const std::vector<Contributor>& top) {
  w.put(static_cast<std::uint32_t>(top.size()));
  for (const Contributor& c : top) w.put(c.id), w.put(c.weight), w.put(c.score);
}

std::vector<Contributor> get_contributors(ByteReader& r, std::string_view count) {
  const auto n = r.get<std::uint32_t>(count);
  std::vector<Contributor> top;
  for (std::uint32_t j = 0; j < n; ++j) {
    Contributor c;
    c.id = r.get<std::uint64_t>("contributor id");
    c.weight = r.get<float>("contributor weight");
    c.score = r.get<float>("contributor score");
    top.push_back(c);
  }
  return top;
}

// Arrays: u32 element count, then the elements.
template <class T>
void put_array(ByteWriter& w, const std::vector<T>& v) {
  w.put(static_cast<std::uint32_t>(v.size()));
  w.put_array(std::span<const T>(v));
}

template <class T>
std::vector<T> get_array(ByteReader& r, std::string_view what) {
  const auto n = r.get<std::uint32_t>(what);
  return detail::to_vector<T>(r.take_array<T>(n, what));
}

void expect_end(const ByteReader& r) {
  if (r.remaining() != 0) malformed(std::to_string(r.remaining()) + " unexpected bytes after the payload");
}

std::vector<std::byte> frame_of(std::uint8_t opcode, std::uint64_t id, ByteWriter& w) { return encode_frame(opcode, id, w.bytes()); }

// Length of the well-formed UTF-8 sequence at the front of s (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or 0 if it does not start with one.
std::size_t utf8_sequence(std::string_view s) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = byte(0);
  if (b0 < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) n = 2;
  else if (b0 == 0xE0) n = 3, lo = 0xA0;
  else if (b0 == 0xED) n = 3, hi = 0x9F;
  else if (b0 >= 0xE1 && b0 <= 0xEF) n = 3;
  else if (b0 == 0xF0) n = 4, lo = 0x90;
  else if (b0 == 0xF4) n = 4, hi = 0x8F;
  else if (b0 >= 0xF1 && b0 <= 0xF3) n = 4;
  else return 0;
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  return n;
}

}  // namespace

std::string wire_message(std::string_view message, std::size_t max_bytes) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(std::min(message.size(), max_bytes));
  while (!message.empty()) {
    const std::size_t n = utf8_sequence(message);
    if (n > 0) {
      if (out.size() + n > max_bytes) break;
      out.append(message.substr(0, n));
      message.remove_prefix(n);
    } else {
      if (out.size() + 4 > max_bytes) break;
      const auto b = static_cast<unsigned char>(message.front());
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
      message.remove_prefix(1);
    }
  }
  return out;
}

FrameScan scan_frame(std::span<const std::byte> buffer, std::uint32_t max_frame) {
  FrameScan scan;
  if (buffer.size() < kLengthPrefix) return scan;
  std::memcpy(&scan.claimed, buffer.data(), 4);
  if (scan.claimed > max_frame) {
    scan.status = FrameScan::Status::too_large;
    return scan;
  }
  if (scan.claimed < kFrameOverhead) {
    scan.status = FrameScan::Status::malformed;
    return scan;
  }
  if (buffer.size() - kLengthPrefix < scan.claimed) return scan;
  scan.status = FrameScan::Status::complete;
  scan.size = kLengthPrefix + scan.claimed;
  scan.frame.opcode = static_cast<std::uint8_t>(buffer[4]);
  std::memcpy(&scan.frame.request_id, buffer.data() + 5, 8);
  scan.frame.payload = buffer.subspan(kLengthPrefix + kFrameOverhead, scan.claimed - kFrameOverhead);
  return scan;
}

std::vector<std::byte> encode_frame(std::uint8_t opcode, std::uint64_t request_id, std::span<const std::byte> payload) {
  std::vector<std::byte> out(kLengthPrefix + kFrameOverhead + payload.size());  // the size is known: fill in place
  const auto length = static_cast<std::uint32_t>(kFrameOverhead + payload.size());
  std::memcpy(out.data(), &length, 4);
  out[4] = std::byte{opcode};
  std::memcpy(out.data() + 5, &request_id, 8);
  if (!payload.empty()) std::memcpy(out.data() + kLengthPrefix + kFrameOverhead, payload.data(), payload.size());
  return out;
}

Opcode opcode_of(const Request& request) {
  return std::visit(Overloaded{
                        [](const Hello&) { return Opcode::hello; }, [](const Auth&) { return Opcode::auth; },
                        [](const Ping&) { return Opcode::ping; }, [](const Create&) { return Opcode::create; },
                        [](const Drop&) { return Opcode::drop; }, [](const List&) { return Opcode::list; },
                        [](const Describe&) { return Opcode::describe; }, [](const Add&) { return Opcode::add; },
                        [](const Upsert&) { return Opcode::upsert; }, [](const Remove&) { return Opcode::remove; },
                        [](const Get&) { return Opcode::get; }, [](const Query&) { return Opcode::query; },
                        [](const Snapshot&) { return Opcode::snapshot; }, [](const Stats&) { return Opcode::stats; },
                        [](const QueryStats&) { return Opcode::query_stats; },
                    },
                    request);
}

std::vector<std::byte> encode_request(const Request& request, std::uint64_t request_id, std::uint16_t version) {
  ByteWriter w;
  std::visit(Overloaded{
                 [&](const Hello& m) { w.put(m.version); },
                 [&](const Auth& m) { w.put_string(m.token); },
                 [&](const Ping&) {},
                 [&](const Create& m) {
                   require_v2(version, m.config.heads != 1, "multi-head collections (heads > 1)");
                   w.put_string(m.name), put_config(w, m.config);
                   if (version >= 2) detail::put_config_precision(w, m.config);  // (v2) compact storage
                   if (version >= 2) detail::put_config_heads(w, m.config);      // (v2) heads
                 },
                 [&](const Drop& m) { w.put_string(m.name); },
                 [&](const List&) {},
                 [&](const Describe& m) { w.put_string(m.name); },
                 [&](const Add& m) {
                   require_v2(version, !m.tags.empty(), "tags");
                   w.put_string(m.name), put_array(w, m.keys), put_array(w, m.values);
                   if (version >= 2) put_array(w, m.tags);
                 },
                 [&](const Upsert& m) {
                   require_v2(version, !m.tags.empty(), "tags");
                   w.put_string(m.name), put_array(w, m.ids), put_array(w, m.keys), put_array(w, m.values);
                   if (version >= 2) put_array(w, m.tags);
                 },
                 [&](const Remove& m) { w.put_string(m.name), put_array(w, m.ids); },
                 [&](const Get& m) { w.put_string(m.name), w.put(m.id); },
                 [&](const Query& m) {
                   w.put_string(m.name);
                   w.put(static_cast<std::uint8_t>(m.kind));
                   detail::put_query_options(w, m.options, detail::options_form(version));
                   put_array(w, m.queries);
                 },
                 [&](const Snapshot&) {},
                 [&](const Stats&) {},
                 [&](const QueryStats& m) { w.put_string(m.name); },
             },
             request);
  return frame_of(static_cast<std::uint8_t>(opcode_of(request)), request_id, w);
}

Request decode_request(const Frame& frame, std::uint16_t version) {
  ByteReader r = reader(frame);
  Request out;
  switch (static_cast<Opcode>(frame.opcode)) {
    case Opcode::hello: out = Hello{r.get<std::uint16_t>("version")}; break;
    case Opcode::auth: out = Auth{r.get_string("token")}; break;
    case Opcode::ping: out = Ping{}; break;
    case Opcode::create: {
      Create m;
      m.name = r.get_string("name");
      m.config = get_config(r);
      if (version >= 2) detail::get_config_precision(r, m.config);  // (v2) compact storage
      if (version >= 2) detail::get_config_heads(r, m.config);      // (v2) heads
      out = std::move(m);
      break;
    }
    case Opcode::drop: out = Drop{r.get_string("name")}; break;
    case Opcode::list: out = List{}; break;
    case Opcode::describe: out = Describe{r.get_string("name")}; break;
    case Opcode::add: {
      Add m;
      m.name = r.get_string("name");
      m.keys = get_array<float>(r, "keys");
      m.values = get_array<float>(r, "values");
      if (version >= 2) m.tags = get_array<std::uint64_t>(r, "tags");
      out = std::move(m);
      break;
    }
    case Opcode::upsert: {
      Upsert m;
      m.name = r.get_string("name");
      m.ids = get_array<std::uint64_t>(r, "ids");
      m.keys = get_array<float>(r, "keys");
      m.values = get_array<float>(r, "values");
      if (version >= 2) m.tags = get_array<std::uint64_t>(r, "tags");
      out = std::move(m);
      break;
    }
    case Opcode::remove: {
      Remove m;
      m.name = r.get_string("name");
      m.ids = get_array<std::uint64_t>(r, "ids");
      out = std::move(m);
      break;
    }
    case Opcode::get: {
      Get m;
      m.name = r.get_string("name");
      m.id = r.get<std::uint64_t>("id");
      out = std::move(m);
      break;
    }
    case Opcode::query: {
      Query m;
      m.name = r.get_string("name");
      const auto kind = r.get<std::uint8_t>("query kind");
      if (kind > 1) malformed("unknown query kind " + std::to_string(kind));
      m.kind = static_cast<QueryKind>(kind);
      m.options = detail::get_query_options(r, detail::options_form(version));
      m.decoded_version = version;
      m.queries = get_array<float>(r, "queries");
      out = std::move(m);
      break;
    }
    case Opcode::snapshot: out = Snapshot{}; break;
    case Opcode::stats: out = Stats{}; break;
    case Opcode::query_stats: out = QueryStats{r.get_string("name")}; break;
    default: malformed("unknown opcode " + std::to_string(frame.opcode));
  }
  expect_end(r);
  return out;
}

std::vector<std::byte> encode_reply(Opcode request, std::uint64_t request_id, const Reply& reply, std::uint16_t version) {
  ByteWriter w;
  std::uint8_t opcode = static_cast<std::uint8_t>(request) | kReplyBit;
  std::visit(Overloaded{
                 [&](const HelloReply& m) {
                   w.put(m.version);
                   w.put_string(m.server_version);
                   w.put(static_cast<std::uint8_t>(m.auth_required));
                 },
                 [&](const Ack&) {},
                 [&](const NamesReply& m) {
                   w.put(static_cast<std::uint32_t>(m.names.size()));
                   for (const auto& n : m.names) w.put_string(n);
                 },
                 [&](const DescribeReply& m) {
                   w.put_string(m.stats.name);
                   w.put(std::uint64_t{m.stats.size});
                   w.put(static_cast<std::uint32_t>(m.stats.dim));
                   w.put(static_cast<std::uint32_t>(m.stats.value_dim));
                   w.put(static_cast<std::uint8_t>(m.stats.metric));
                   w.put(static_cast<std::uint8_t>(m.stats.index));
                   w.put(m.stats.bytes_in_memory);
                   w.put(m.stats.bytes_on_disk);
                   if (version >= 2) {  // (v2) compact storage
                     w.put(static_cast<std::uint8_t>(m.stats.key_precision));
                     w.put(static_cast<std::uint8_t>(m.stats.value_precision));
                     w.put(static_cast<std::uint32_t>(m.stats.heads));  // (v2) heads
                   }
                 },
                 [&](const IdsReply& m) { put_array(w, m.ids); },
                 [&](const QueryStatsReply& m) { w.put(m.stats.queries), w.put(m.stats.passes), w.put(m.stats.max_batch); },
                 [&](const GetReply& m) {
                   w.put(m.entry.id), put_array(w, m.entry.key), put_array(w, m.entry.value);
                   if (version >= 2) w.put(m.entry.tag);
                 },
                 [&](const SoftReply& m) {
                   w.put(static_cast<std::uint32_t>(m.results.size()));
                   for (const SoftResult& s : m.results) {
                     w.put(s.lse);
                     w.put(s.max_score);
                     w.put(std::uint64_t{s.candidates});
                     w.put(s.tail_bound);
                     w.put(static_cast<std::uint8_t>(s.tail_bound_guaranteed));
                     w.put(static_cast<std::uint8_t>(s.searched_with));
                     put_contributors(w, s.top);
                     put_array(w, s.value);
                     if (version < 2) continue;
                     w.put(static_cast<std::uint8_t>(s.mask_filtered_after_search));
                     // (v2) iterations and per-head answers (head count 0 for a single-head collection)
                     w.put(static_cast<std::uint32_t>(s.iterations_run));
                     w.put(s.last_change);
                     w.put(static_cast<std::uint32_t>(s.heads.size()));
                     for (const HeadResult& head : s.heads) {
                       w.put(head.lse);
                       w.put(head.max_score);
                       put_contributors(w, head.top);
                     }
                     if (version < 3) continue;
                     w.put(std::uint64_t{s.rows_scored});  // (v3) rows scored and the estimate's error
                     w.put(s.error_estimate);
                   }
                 },
                 [&](const HardReply& m) {
                   w.put(static_cast<std::uint32_t>(m.results.size()));
                   for (const HardResult& h : m.results) {
                     w.put(h.id);
                     w.put(h.score);
                     w.put(static_cast<std::uint8_t>(h.searched_with));
                     put_array(w, h.value);
                     if (version < 2) continue;
                     // (v2) per-head winners (count 0 for a single-head collection)
                     w.put(static_cast<std::uint32_t>(h.head_ids.size()));
                     for (std::size_t j = 0; j < h.head_ids.size(); ++j) w.put(h.head_ids[j]), w.put(h.head_scores[j]);
                   }
                 },
                 [&](const StatsReply& m) {
                   w.put_string(m.server_version);
                   w.put_string(m.simd_path);
                   w.put(m.collections), w.put(m.connections), w.put(m.requests), w.put(m.last_sequence);
                 },
                 [&](const ErrorReply& m) {
                   opcode = kErrorOpcode;
                   w.put(static_cast<std::uint16_t>(m.code));
                   w.put_string(wire_message(m.message));
                 },
             },
             reply);
  return frame_of(opcode, request_id, w);
}

Reply decode_reply(Opcode request, const Frame& frame, QueryKind kind, std::uint16_t version) {
  ByteReader r = reader(frame);
  Reply out;
  if (frame.opcode == kErrorOpcode) {
    ErrorReply e;
    e.code = static_cast<ErrorCode>(r.get<std::uint16_t>("error code"));
    e.message = r.get_string("error message");
    out = std::move(e);
  } else {
    if (frame.opcode != (static_cast<std::uint8_t>(request) | kReplyBit))
      malformed("reply opcode " + std::to_string(frame.opcode) + " does not answer request " + std::to_string(int(request)));
    switch (request) {
      case Opcode::hello: {
        HelloReply m;
        m.version = r.get<std::uint16_t>("version");
        m.server_version = r.get_string("server version");
        m.auth_required = r.get<std::uint8_t>("auth flag") != 0;
        out = std::move(m);
        break;
      }
      case Opcode::list: {
        NamesReply m;
        const auto n = r.get<std::uint32_t>("name count");
        if (n > r.remaining() / 2) malformed("name count larger than the frame");
        for (std::uint32_t i = 0; i < n; ++i) m.names.push_back(r.get_string("name"));
        out = std::move(m);
        break;
      }
      case Opcode::describe: {
        DescribeReply m;
        m.stats.name = r.get_string("name");
        m.stats.size = r.get<std::uint64_t>("size");
        m.stats.dim = r.get<std::uint32_t>("dim");
        m.stats.value_dim = r.get<std::uint32_t>("value_dim");
        m.stats.metric = static_cast<Metric>(r.get<std::uint8_t>("metric"));
        m.stats.index = static_cast<IndexKind>(r.get<std::uint8_t>("index"));
        m.stats.bytes_in_memory = r.get<std::uint64_t>("bytes in memory");
        m.stats.bytes_on_disk = r.get<std::uint64_t>("bytes on disk");
        if (version >= 2) {  // (v2) compact storage
          m.stats.key_precision = static_cast<Precision>(r.get<std::uint8_t>("key_precision"));
          m.stats.value_precision = static_cast<Precision>(r.get<std::uint8_t>("value_precision"));
          m.stats.heads = r.get<std::uint32_t>("heads");
        }
        out = std::move(m);
        break;
      }
      case Opcode::add: out = IdsReply{get_array<std::uint64_t>(r, "ids")}; break;
      case Opcode::query_stats: {
        QueryStatsReply m;
        m.stats.queries = r.get<std::uint64_t>("queries");
        m.stats.passes = r.get<std::uint64_t>("passes");
        m.stats.max_batch = r.get<std::uint64_t>("max batch");
        out = m;
        break;
      }
      case Opcode::get: {
        GetReply m;
        m.entry.id = r.get<std::uint64_t>("id");
        m.entry.key = get_array<float>(r, "key");
        m.entry.value = get_array<float>(r, "value");
        if (version >= 2) m.entry.tag = r.get<std::uint64_t>("tag");
        out = std::move(m);
        break;
      }
      case Opcode::query: {
        const auto n = r.get<std::uint32_t>("result count");
        if (kind == QueryKind::soft) {
          SoftReply m;
          for (std::uint32_t i = 0; i < n; ++i) {  // no reserve: every read is bounded by the frame
            SoftResult s;
            s.lse = r.get<double>("lse");
            s.max_score = r.get<float>("max score");
            s.candidates = r.get<std::uint64_t>("candidates");
            s.tail_bound = r.get<double>("tail bound");
            s.tail_bound_guaranteed = r.get<std::uint8_t>("guarantee flag") != 0;
            s.searched_with = static_cast<IndexKind>(r.get<std::uint8_t>("searched with"));
            s.top = get_contributors(r, "contributor count");
            s.value = get_array<float>(r, "value");
            if (version >= 2) {
              const auto filtered = r.get<std::uint8_t>("mask filter flag");
              if (filtered > 1) malformed("mask filter flag " + std::to_string(int(filtered)) + " is neither 0 nor 1");
              s.mask_filtered_after_search = filtered == 1;
              s.iterations_run = r.get<std::uint32_t>("iterations run");
              s.last_change = r.get<double>("last change");
              const auto heads = r.get<std::uint32_t>("head count");
              for (std::uint32_t j = 0; j < heads; ++j) {  // bounded by the frame: each head reads 16 bytes at least
                HeadResult head;
                head.lse = r.get<double>("head lse");
                head.max_score = r.get<float>("head max score");
                head.top = get_contributors(r, "head contributor count");
                s.heads.push_back(std::move(head));
              }
            }
            if (version >= 3) {
              s.rows_scored = r.get<std::uint64_t>("rows scored");
              s.error_estimate = r.get<double>("error estimate");
            } else {
              s.rows_scored = s.candidates;  // what a version-1/2 reply can say
            }
            m.results.push_back(std::move(s));
          }
          out = std::move(m);
        } else {
          HardReply m;
          for (std::uint32_t i = 0; i < n; ++i) {
            HardResult h;
            h.id = r.get<std::uint64_t>("id");
            h.score = r.get<float>("score");
            h.searched_with = static_cast<IndexKind>(r.get<std::uint8_t>("searched with"));
            h.value = get_array<float>(r, "value");
            if (version >= 2) {
              const auto heads = r.get<std::uint32_t>("head count");
              for (std::uint32_t j = 0; j < heads; ++j) {
                h.head_ids.push_back(r.get<std::uint64_t>("head id"));
                h.head_scores.push_back(r.get<float>("head score"));
              }
            }
            m.results.push_back(std::move(h));
          }
          out = std::move(m);
        }
        break;
      }
      case Opcode::stats: {
        StatsReply m;
        m.server_version = r.get_string("server version");
        m.simd_path = r.get_string("simd path");
        m.collections = r.get<std::uint64_t>("collections");
        m.connections = r.get<std::uint64_t>("connections");
        m.requests = r.get<std::uint64_t>("requests");
        m.last_sequence = r.get<std::uint64_t>("last sequence");
        out = std::move(m);
        break;
      }
      default: out = Ack{};
    }
  }
  expect_end(r);
  return out;
}

}  // namespace softkv::wire
