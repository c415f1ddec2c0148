// The parts of a sharded write: split by owner, sealed as checked blobs of log-record payloads.
#include "codec/parts.hpp"

#include <string_view>

#include "codec/bytes.hpp"
#include "codec/checked_blob.hpp"
#include "overloaded.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

constexpr std::string_view kPartMagic = "skvpart1";
constexpr std::uint32_t kPartVersion = 1;

// The rows of `rows` at positions `at`, in that order (tags only when rows has them).
Rows select_rows(const Rows& rows, const std::vector<std::size_t>& at) {
  const std::size_t n = rows.ids.size();
  const std::size_t d = n == 0 ? 0 : rows.keys.size() / n, dv = n == 0 ? 0 : rows.values.size() / n;
  Rows out;
  out.ids.reserve(at.size());
  out.keys.reserve(at.size() * d);
  out.values.reserve(at.size() * dv);
  for (std::size_t i : at) {
    out.ids.push_back(rows.ids[i]);
    if (!rows.tags.empty()) out.tags.push_back(rows.tags[i]);
    out.keys.insert(out.keys.end(), rows.keys.begin() + static_cast<std::ptrdiff_t>(i * d),
                    rows.keys.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
    out.values.insert(out.values.end(), rows.values.begin() + static_cast<std::ptrdiff_t>(i * dv),
                      rows.values.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::size_t>> split_by_owner(std::span<const std::uint64_t> ids, std::size_t ranks) {
  std::vector<std::vector<std::size_t>> by_owner(ranks);
  for (std::size_t i = 0; i < ids.size(); ++i) by_owner[owner_of(ids[i], ranks)].push_back(i);
  return by_owner;
}

std::optional<Mutation> part_of(const Mutation& m, std::size_t rank, std::size_t ranks) {
  return std::visit(Overloaded{
                        [&](const mutation::Upsert& u) -> std::optional<Mutation> {
                          const auto by_owner = split_by_owner(u.rows.ids, ranks);
                          if (by_owner[rank].empty()) return std::nullopt;
                          return mutation::Upsert{u.name, select_rows(u.rows, by_owner[rank]), u.keys_as_given};
                        },
                        [&](const mutation::Remove& x) -> std::optional<Mutation> {
                          mutation::Remove part{x.name, {}};
                          for (std::uint64_t id : x.ids)
                            if (owner_of(id, ranks) == rank) part.ids.push_back(id);
                          if (part.ids.empty()) return std::nullopt;
                          return part;
                        },
                        [&](const auto& whole) -> std::optional<Mutation> { return whole; },
                    },
                    m);
}

std::size_t owners_of(const Mutation& m, std::size_t ranks) {
  const auto count = [&](std::span<const std::uint64_t> ids) {
    std::size_t owners = 0;
    for (const auto& rows : split_by_owner(ids, ranks)) owners += rows.empty() ? 0 : 1;
    return owners;
  };
  return std::visit(Overloaded{
                        [&](const mutation::Upsert& u) { return count(u.rows.ids); },
                        [&](const mutation::Remove& x) { return count(x.ids); },
                        [&](const auto&) { return ranks; },
                    },
                    m);
}

std::vector<std::byte> encode_part(const Mutation& part, const PartTag& tag) {
  const EncodedMutation e = encode_mutation(part);
  ByteWriter w;
  w.put_string(tag.job);
  w.put(tag.rank);
  w.put(tag.ranks);
  w.put(tag.txn);
  w.put(static_cast<std::uint8_t>(e.type));
  w.put_array(std::span<const std::byte>(e.payload));
  return seal_blob(kPartMagic, kPartVersion, w.bytes());
}

Part decode_part(std::span<const std::byte> bytes, const std::string& file) {
  const OpenedBlob blob = open_blob(bytes, kPartMagic, file);
  if (blob.version != kPartVersion)
    throw Error(ErrorCode::corrupt_file, file + ": part format version " + std::to_string(blob.version) + " is not 1");
  try {
    ByteReader r(blob.payload, ErrorCode::corrupt_file);
    Part part;
    part.tag.job = r.get_string("job id");
    part.tag.rank = r.get<std::uint32_t>("rank");
    part.tag.ranks = r.get<std::uint32_t>("rank count");
    part.tag.txn = r.get<std::uint64_t>("write number");
    const auto byte = r.get<std::uint8_t>("record type");
    const auto type = static_cast<RecordType>(byte);
    if (type == RecordType::upsert || byte > kMaxRecordType || byte == 0)
      throw Error(ErrorCode::corrupt_file, "record type " + std::to_string(int(byte)) + " is not a part's");
    const std::span<const std::byte> rest = blob.payload.subspan(blob.payload.size() - r.remaining());
    part.mutation = decode_mutation(type, rest, [](const std::string&) { return std::nullopt; });
    return part;
  } catch (const Error& e) {
    throw Error(ErrorCode::corrupt_file, file + ": " + e.what());
  }
}

}  // namespace softkv::detail
