// The scatter of a sharded write's parts (their split and byte form: codec/parts.hpp): root encodes
// every rank's part and one MPI_Scatterv sends each its own. ShardedCollection writes through it; the
// sharded server's Shard, whose ranks all hold the request, takes its part with part_of directly.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "codec/parts.hpp"

namespace softkv::detail {

/// Root's half of a scatter: every rank's encode_part bytes in one buffer, with MPI counts and offsets.
struct EncodedParts {
  std::vector<std::byte> bytes;  ///< the parts, rank 0's first
  std::vector<int> counts;       ///< bytes of each rank's part (0: it owns nothing)
  std::vector<int> displs;       ///< where each rank's part starts
};

/// Encodes every rank's part of whole. Throws Error(resource_exhausted) when the parts exceed MPI's int
/// counts: call it where a root-side check may fail (detail::root_decides), before the scatter.
[[nodiscard]] EncodedParts encode_parts(const Mutation& whole, std::size_t ranks);

/// Sends every rank its part (at_root: significant at root only; one MPI_Scatter of the counts and one
/// MPI_Scatterv of the bytes) and returns this rank's (nullopt: it owns nothing), its tag checked
/// (Error(internal) for a part meant for another rank). Collective over comm.
[[nodiscard]] std::optional<Mutation> scatter_parts(const EncodedParts& at_root, int root, MPI_Comm comm);

}  // namespace softkv::detail
