// The field codecs shared by the request and reply halves of the wire codec (protocol.cpp,
// replies.cpp): internal to src/wire.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "codec/bytes.hpp"
#include "codec/config.hpp"
#include "overloaded.hpp"
#include "wire/protocol.hpp"

namespace softkv::wire {

using detail::ByteReader;
using detail::ByteWriter;
using detail::ConfigForm;
using detail::get_config;
using detail::Overloaded;
using detail::put_config;

inline ByteReader reader(const Frame& f) { return ByteReader(f.payload, ErrorCode::protocol_error); }

[[noreturn]] inline void malformed(const std::string& what) { throw Error(ErrorCode::protocol_error, what); }

// A field version 1 cannot carry is refused rather than dropped: the answer would silently differ.
inline void require_v2(std::uint16_t version, bool needed, std::string_view what) {
  if (needed && version < 2)
    throw Error(ErrorCode::unsupported, std::string(what) + " need protocol version 2; this connection speaks " + std::to_string(version));
}


// A top-m list: u32 count, then count x (u64 id, f32 weight, f32 score). No reserve: every read is
// bounded by the frame.
inline void put_contributors(ByteWriter& w, const std::vector<Contributor>& top) {
  w.put(static_cast<std::uint32_t>(top.size()));
  for (const Contributor& c : top) w.put(c.id), w.put(c.weight), w.put(c.score);
}

inline std::vector<Contributor> get_contributors(ByteReader& r, std::string_view count) {
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

inline void expect_end(const ByteReader& r) {
  if (r.remaining() != 0) malformed(std::to_string(r.remaining()) + " unexpected bytes after the payload");
}

inline std::vector<std::byte> frame_of(std::uint8_t opcode, std::uint64_t id, ByteWriter& w) { return encode_frame(opcode, id, w.bytes()); }

}  // namespace softkv::wire
