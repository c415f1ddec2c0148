// The parts of a sharded write: split by owner, sealed as checked blobs of log-record payloads, scattered.
#include "mpi/parts.hpp"

#include <string_view>

#include "assert.hpp"
#include "codec/bytes.hpp"
#include "codec/checked_blob.hpp"
#include "mpi/sharded_impl.hpp"
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
                            if (shard_owner(id, ranks) == rank) part.ids.push_back(id);
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

EncodedParts encode_parts(const Mutation& whole, std::size_t ranks) {
  EncodedParts out;
  out.counts.assign(ranks, 0);
  out.displs.assign(ranks, 0);
  for (std::size_t r = 0; r < ranks; ++r) {
    out.displs[r] = mpi_count(out.bytes.size(), "one write's parts");
    const std::optional<Mutation> part = part_of(whole, r, ranks);
    if (!part) continue;
    const std::vector<std::byte> sealed = encode_part(*part, PartTag{"", static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(ranks), 0});
    out.counts[r] = mpi_count(sealed.size(), "one rank's part of a write");
    out.bytes.insert(out.bytes.end(), sealed.begin(), sealed.end());
  }
  (void)mpi_count(out.bytes.size(), "one write's parts");
  return out;
}

std::optional<Mutation> scatter_parts(const EncodedParts& at_root, int root, MPI_Comm comm) {
  int mine = 0;
  MPI_Scatter(at_root.counts.data(), 1, MPI_INT, &mine, 1, MPI_INT, root, comm);
  std::vector<std::byte> received(static_cast<std::size_t>(mine));
  MPI_Scatterv(at_root.bytes.data(), at_root.counts.data(), at_root.displs.data(), MPI_BYTE, received.data(), mine, MPI_BYTE,
               root, comm);
  if (mine == 0) return std::nullopt;
  Part part = decode_part(received, "the part of a write sent by rank " + std::to_string(root));
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  SOFTKV_ASSERT(part.tag.rank == static_cast<std::uint32_t>(rank) && part.tag.ranks == static_cast<std::uint32_t>(size),
                "a scattered part reaches the rank it was cut for");
  return std::move(part.mutation);
}

}  // namespace softkv::detail
