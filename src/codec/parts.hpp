// The parts of a sharded write, as values and bytes (pure: no MPI): the one rule of which rank owns an
// id, the one split of a Mutation by owner, and the one byte form of a part — what the library's
// ShardedCollection scatters (mpi/parts.hpp) and the sharded server keeps in its part files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "codec/records.hpp"

namespace softkv::detail {

/// The rank that owns id among ranks (softkv::shard_owner): id mod ranks.
[[nodiscard]] inline std::size_t owner_of(std::uint64_t id, std::size_t ranks) noexcept { return static_cast<std::size_t>(id % ranks); }

/// The positions of ids grouped by the rank that owns each, in order.
[[nodiscard]] std::vector<std::vector<std::size_t>> split_by_owner(std::span<const std::uint64_t> ids, std::size_t ranks);

/// The part of m that rank `rank` of `ranks` applies: a create or drop whole (every rank holds a shard
/// of every collection); an upsert's rows and a remove's ids that the rank owns (shard_owner: id mod
/// ranks), in m's order. nullopt when the rank owns none of them.
[[nodiscard]] std::optional<Mutation> part_of(const Mutation& m, std::size_t rank, std::size_t ranks);

/// The number of ranks whose part_of(m) is not empty: one means the write is atomic on that rank alone.
[[nodiscard]] std::size_t owners_of(const Mutation& m, std::size_t ranks);

/// Whose a part is: a part names the job, the rank it belongs to, the rank count and the cross-shard
/// write, so a part file copied to another rank, job or write number is refused, never applied.
struct PartTag {
  std::string job;          ///< the job id (the sharded server's manifest; empty for the library's parts)
  std::uint32_t rank = 0;   ///< the rank that applies it
  std::uint32_t ranks = 1;  ///< P
  std::uint64_t txn = 0;    ///< the cross-shard write (0 for the library's parts, which are never stored)
  bool operator==(const PartTag&) const = default;
};

/// A decoded part.
struct Part {
  PartTag tag;        ///< whose it is
  Mutation mutation;  ///< what it changes
};

/// A part as bytes: a checked blob (magic "skvpart1", version 1) holding the tag (u16-prefixed job,
/// u32 rank, u32 ranks, u64 txn), the record type byte and the encode_mutation payload, so a part file is
/// checked like every other file and decoded by the log's codec.
[[nodiscard]] std::vector<std::byte> encode_part(const Mutation& part, const PartTag& tag);

/// Reads what encode_part wrote; throws Error(corrupt_file) naming `file` for damaged or foreign bytes.
[[nodiscard]] Part decode_part(std::span<const std::byte> bytes, const std::string& file);

}  // namespace softkv::detail
