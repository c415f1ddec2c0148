// Mutations: what the database logs and applies, as values, with pure encode/decode of log-record payloads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "softkv/types.hpp"

namespace softkv::detail {

/// What a log record does (the type byte of its header; docs/RELIABILITY.md lists the payloads).
enum class RecordType : std::uint8_t {
  create = 1,  ///< name, config
  drop = 2,    ///< name
  upsert = 3,  ///< name, n, ids, keys as the client gave them, values (written before format 2; read only)
  remove = 4,  ///< name, n, ids
  put = 5,     ///< name, d, dv, n, ids, keys as stored (unit length for cosine), values
  tagged_put = 6,  ///< a put followed by n u64 tags (written only when some tag is not 0)
};
/// The largest record type a log may hold.
inline constexpr std::uint8_t kMaxRecordType = 6;

namespace mutation {
/// Creates a collection.
struct Create {
  std::string name;         ///< its name
  CollectionConfig config;  ///< its configuration (already checked)
};
/// Drops a collection.
struct Drop {
  std::string name;  ///< its name
};
/// Inserts or replaces rows.
struct Upsert {
  std::string name;          ///< the collection
  Rows rows;                 ///< ids, keys and values
  bool keys_as_given = false;  ///< true only for legacy upsert records: cosine keys still need normalising
};
/// Removes ids, every one present.
struct Remove {
  std::string name;                ///< the collection
  std::vector<std::uint64_t> ids;  ///< distinct ids
};
}  // namespace mutation

/// One change to a database, as logged and as applied (live and at replay alike).
using Mutation = std::variant<mutation::Create, mutation::Drop, mutation::Upsert, mutation::Remove>;

/// The name of the collection a mutation changes.
const std::string& collection_of(const Mutation& m);

/// A record's type and payload bytes (the log frames them with sequence number and checksums).
struct EncodedMutation {
  RecordType type = RecordType::create;  ///< header type byte
  std::vector<std::byte> payload;        ///< payload bytes
};

/// Encodes a mutation (upserts as RecordType::put, or tagged_put when their rows carry tags).
EncodedMutation encode_mutation(const Mutation& m);

/// Key and value dimensions of a collection by name, for legacy upsert records (which do not carry them).
using DimensionsOf = std::function<std::optional<std::pair<std::size_t, std::size_t>>(const std::string&)>;

/// Decodes a record payload; throws Error(corrupt_file) naming what is malformed (a truncated field,
/// trailing bytes, an unknown type, a legacy upsert for a collection `dims` does not know).
Mutation decode_mutation(RecordType type, std::span<const std::byte> payload, const DimensionsOf& dims);

}  // namespace softkv::detail
