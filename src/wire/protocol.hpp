// The softkv wire protocol (docs/PROTOCOL.md): frames, requests and replies, as a pure codec.
//
// Frame: [u32 length][u8 opcode][u64 request id][payload], little-endian; length counts the bytes
// after itself (9 + payload). Nothing here touches a socket: bytes in, messages or typed errors out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "softkv/types.hpp"
#include "softkv/database.hpp"
#include "softkv/error.hpp"

namespace softkv::wire {

inline constexpr std::uint16_t kProtocolVersion = 3;     ///< the highest version this codec speaks (sent in hello)
inline constexpr std::uint16_t kMinProtocolVersion = 1;  ///< the lowest; a connection starts at it until hello

/// The version a connection uses after a hello that named requested: min(requested, kProtocolVersion),
/// and 1 for 0 (a client that names no version speaks the first one).
constexpr std::uint16_t negotiate_version(std::uint16_t requested) {
  return requested < kMinProtocolVersion ? kMinProtocolVersion : requested > kProtocolVersion ? kProtocolVersion : requested;
}
inline constexpr std::size_t kLengthPrefix = 4;       ///< the u32 length
inline constexpr std::uint32_t kFrameOverhead = 9;    ///< opcode + request id, counted in the length
inline constexpr std::uint32_t kDefaultMaxFrame = 64u << 20;  ///< default limit on the length field

/// Request opcodes; a reply carries the request's opcode | 0x80, an error reply 0xFF.
enum class Opcode : std::uint8_t {
  hello = 0x01, auth = 0x02, ping = 0x03,
  create = 0x10, drop = 0x11, list = 0x12, describe = 0x13, query_stats = 0x14,
  add = 0x20, upsert = 0x21, remove = 0x22, get = 0x23,
  query = 0x30,
  snapshot = 0x40, stats = 0x41,
};
inline constexpr std::uint8_t kReplyBit = 0x80;   ///< set on every successful reply's opcode
inline constexpr std::uint8_t kErrorOpcode = 0xFF;  ///< opcode of an error reply

/// One frame located in a buffer (payload points into that buffer).
struct Frame {
  std::uint8_t opcode = 0;
  std::uint64_t request_id = 0;
  std::span<const std::byte> payload;
};

/// What the front of a receive buffer holds.
struct FrameScan {
  enum class Status { complete, need_more, too_large, malformed };
  Status status = Status::need_more;
  std::size_t size = 0;            ///< bytes the frame occupies (complete only)
  std::uint32_t claimed = 0;       ///< the length field, once 4 bytes are there
  Frame frame;                     ///< complete only
};

/// Inspects buffer: a complete frame, "need more", a length over max_frame (decided from the 4-byte
/// prefix alone, before anything is allocated) or a length too short to hold a frame.
FrameScan scan_frame(std::span<const std::byte> buffer, std::uint32_t max_frame);

/// [length][opcode][id][payload].
std::vector<std::byte> encode_frame(std::uint8_t opcode, std::uint64_t request_id, std::span<const std::byte> payload);

// ---- requests ----
struct Hello { std::uint16_t version = kProtocolVersion; };                 ///< version handshake
struct Auth { std::string token; };                                         ///< present the auth token
struct Ping {};                                                             ///< liveness
struct Create { std::string name; CollectionConfig config; };               ///< create a collection
struct Drop { std::string name; };                                          ///< drop a collection
struct List {};                                                             ///< collection names
struct Describe { std::string name; };                                      ///< a collection's stats
struct Add {  ///< add rows (row-major n x d, n x dv)
  std::string name;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> tags;  ///< (v2) empty or n tags
};
struct Upsert {  ///< insert or replace rows by id
  std::string name;
  std::vector<std::uint64_t> ids;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> tags;  ///< (v2) empty or n tags
};
struct Remove { std::string name; std::vector<std::uint64_t> ids; };       ///< remove rows by id
struct Get { std::string name; std::uint64_t id = 0; };                      ///< one entry
enum class QueryKind : std::uint8_t { soft = 0, hard = 1 };                  ///< which retrieval
struct Query {  ///< one query (d floats) or a batch (B x d, row-major); the server splits by the collection's d
  std::string name;
  QueryKind kind = QueryKind::soft;
  QueryOptions options;
  std::vector<float> queries;
  /// Not on the wire: the protocol version the request was decoded at. A version-1 query cannot
  /// receive per-head answers, so the server refuses it on a multi-head collection (unsupported).
  std::uint16_t decoded_version = kProtocolVersion;
};
struct QueryStats { std::string name; };  ///< a collection's coalescing counters (opcode 0x14, added in 0.2)
struct Snapshot {};  ///< write a snapshot now
struct Stats {};     ///< server statistics

/// Any request.
using Request = std::variant<Hello, Auth, Ping, Create, Drop, List, Describe, Add, Upsert, Remove, Get, Query, Snapshot, Stats, QueryStats>;

/// The opcode of a request.
Opcode opcode_of(const Request& request);
// Every encoder and decoder below takes the connection's protocol version (negotiated by hello; 1
// until then). Fields added in version 2 are appended to the structures they extend and exist on
// the wire only at version >= 2 (docs/PROTOCOL.md, "(v2)"); hello's own layout is the same in
// every version.

/// A whole request frame.
std::vector<std::byte> encode_request(const Request& request, std::uint64_t request_id, std::uint16_t version = kMinProtocolVersion);
/// Parses a request frame; throws Error(protocol_error) for an unknown opcode or a malformed payload.
Request decode_request(const Frame& frame, std::uint16_t version = kMinProtocolVersion);

// ---- replies ----
struct HelloReply { std::uint16_t version = kProtocolVersion; std::string server_version; bool auth_required = false; };  ///< hello
struct Ack {};                                             ///< auth, ping, create, drop, upsert, remove, snapshot
struct NamesReply { std::vector<std::string> names; };      ///< list
struct DescribeReply { CollectionStats stats; };            ///< describe
struct IdsReply { std::vector<std::uint64_t> ids; };        ///< add
struct GetReply { Entry entry; };                           ///< get
struct SoftReply { std::vector<SoftResult> results; };      ///< soft query, one result per query
struct HardReply { std::vector<HardResult> results; };      ///< hard query, one result per query
struct StatsReply {                                         ///< stats
  std::string server_version, simd_path;
  std::uint64_t collections = 0, connections = 0, requests = 0, last_sequence = 0;
};
struct QueryStatsReply { CoalescingStats stats; };           ///< query_stats
struct ErrorReply { ErrorCode code = ErrorCode::protocol_error; std::string message; };  ///< any failed request

/// Longest error message on the wire, in bytes.
inline constexpr std::size_t kMaxErrorMessage = 4000;

/// message as valid UTF-8 of at most max_bytes: every byte that is not part of a well-formed UTF-8
/// sequence becomes the four characters \xNN (hex), and the text is cut at a character boundary.
/// encode_reply applies it to every error message.
std::string wire_message(std::string_view message, std::size_t max_bytes = kMaxErrorMessage);

/// Any reply.
using Reply = std::variant<HelloReply, Ack, NamesReply, DescribeReply, IdsReply, GetReply, SoftReply, HardReply, StatsReply, QueryStatsReply,
                           ErrorReply>;

/// A whole reply frame to a request with this opcode and id.
std::vector<std::byte> encode_reply(Opcode request, std::uint64_t request_id, const Reply& reply,
                                    std::uint16_t version = kMinProtocolVersion);
/// Parses a reply frame to a request with this opcode (and, for queries, kind); throws
/// Error(protocol_error) if malformed. An error frame decodes to ErrorReply for any request.
Reply decode_reply(Opcode request, const Frame& frame, QueryKind kind = QueryKind::soft, std::uint16_t version = kMinProtocolVersion);

}  // namespace softkv::wire
