// The wire codec: frames and requests (replies: replies.cpp). Every field little-endian, strings as u16
// length + bytes, arrays counted before use.
#include "wire/protocol.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "codec/options.hpp"
#include "wire/fields.hpp"

namespace softkv::wire {
namespace {

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
                   require_v2(version, m.config.key_precision != Precision::f32 || m.config.value_precision != Precision::f32,
                              "compact collections (key_precision or value_precision other than f32)");
                   w.put_string(m.name), put_config(w, m.config, version >= 2 ? ConfigForm::wire : ConfigForm::wire_v1);
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
      m.config = get_config(r, version >= 2 ? ConfigForm::wire : ConfigForm::wire_v1);
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

}  // namespace softkv::wire
