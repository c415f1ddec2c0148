// The scatter of a sharded write's parts: root encodes every rank's part (codec/parts.hpp), one
// MPI_Scatterv delivers them.
#include "mpi/parts.hpp"

#include "assert.hpp"
#include "mpi/sharded_impl.hpp"

namespace softkv::detail {

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
