// Record payloads: little-endian fields in the order RecordType documents, every count checked before use.
#include "codec/records.hpp"

#include "codec/bytes.hpp"
#include "codec/config.hpp"
#include "overloaded.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

[[noreturn]] void malformed(const std::string& what) { throw Error(ErrorCode::corrupt_file, "malformed record: " + what); }

// n ids, n*d keys and n*dv values, the counts checked against what the payload holds before copying.
Rows read_rows(ByteReader& r, std::uint64_t n, std::uint64_t d, std::uint64_t dv) {
  Rows rows;
  rows.ids = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"));
  if (d != 0 && n > r.remaining() / 4 / d) malformed("keys run past the end");
  rows.keys = to_vector<float>(r.take_array<float>(n * d, "keys"));
  if (dv != 0 && n > r.remaining() / 4 / dv) malformed("values run past the end");
  rows.values = to_vector<float>(r.take_array<float>(n * dv, "values"));
  return rows;
}

}  // namespace

const std::string& collection_of(const Mutation& m) {
  return std::visit([](const auto& v) -> const std::string& { return v.name; }, m);
}

EncodedMutation encode_mutation(const Mutation& m) {
  ByteWriter w;
  w.put_string(collection_of(m));
  const RecordType type = std::visit(
      Overloaded{
          [&](const mutation::Create& c) {
            put_config(w, c.config, ConfigForm::log_record);  // an f32 single-head config: the first format's bytes
            return RecordType::create;
          },
          [](const mutation::Drop&) { return RecordType::drop; },
          [&](const mutation::Upsert& u) {
            const std::uint64_t n = u.rows.ids.size();
            const std::uint64_t d = n == 0 ? 0 : u.rows.keys.size() / n, dv = n == 0 ? 0 : u.rows.values.size() / n;
            w.put(static_cast<std::uint32_t>(d));
            w.put(static_cast<std::uint32_t>(dv));
            w.put(n);
            w.put_array(std::span<const std::uint64_t>(u.rows.ids));
            w.put_array(std::span<const float>(u.rows.keys));
            w.put_array(std::span<const float>(u.rows.values));
            if (u.rows.tags.empty()) return RecordType::put;  // untagged rows stay readable by older releases
            w.put_array(std::span<const std::uint64_t>(u.rows.tags));
            return RecordType::tagged_put;
          },
          [&](const mutation::Remove& r) {
            w.put(std::uint64_t{r.ids.size()});
            w.put_array(std::span<const std::uint64_t>(r.ids));
            return RecordType::remove;
          },
      },
      m);
  return {type, std::move(w.bytes())};
}

Mutation decode_mutation(RecordType type, std::span<const std::byte> payload, const DimensionsOf& dims) {
  ByteReader r(payload, ErrorCode::corrupt_file);
  std::string name = r.get_string("collection name");
  Mutation m;
  switch (type) {
    case RecordType::create: {
      m = mutation::Create{std::move(name), get_config(r, ConfigForm::log_record)};
      break;
    }
    case RecordType::drop:
      m = mutation::Drop{std::move(name)};
      break;
    case RecordType::upsert: {
      const auto shape = dims(name);
      if (!shape) throw Error(ErrorCode::unknown_collection, "no collection is named '" + name + "'");
      const std::uint64_t n = r.get<std::uint64_t>("entry count");
      Rows rows = read_rows(r, n, shape->first, shape->second);
      m = mutation::Upsert{std::move(name), std::move(rows), true};
      break;
    }
    case RecordType::put:
    case RecordType::tagged_put: {
      const std::uint64_t d = r.get<std::uint32_t>("key dimension");
      const std::uint64_t dv = r.get<std::uint32_t>("value dimension");
      const std::uint64_t n = r.get<std::uint64_t>("entry count");
      if (n > 0 && (d == 0 || dv == 0)) malformed("rows with a zero dimension");
      Rows rows = read_rows(r, n, d, dv);
      if (type == RecordType::tagged_put) rows.tags = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "tags"));
      m = mutation::Upsert{std::move(name), std::move(rows), false};
      break;
    }
    case RecordType::remove: {
      const std::uint64_t n = r.get<std::uint64_t>("id count");
      m = mutation::Remove{std::move(name), to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"))};
      break;
    }
    default:
      malformed("unknown record type " + std::to_string(int(type)));
  }
  if (r.remaining() != 0) malformed(std::to_string(r.remaining()) + " bytes after the last field");
  return m;
}

}  // namespace softkv::detail
