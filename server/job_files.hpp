// The sharded server's own files in its data directory DIR (docs/SHARDING.md, "Identity and restores"):
// the job manifest (DIR/shards: the shard count and a job id drawn at creation), each shard's identity
// (DIR/shard-R/IDENTITY: job id, rank, shard count) and the progress record (DIR/progress: how many
// logged writes each shard had applied at the last start or clean stop). Together they let a start
// refuse a directory whose shards are not the ones the job wrote: a shard deleted, emptied, swapped
// with another, taken from another job or restored from an older copy. Each file is a few lines of
// text ending with a CRC-32 line, written whole by a rename; a damaged one is refused by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace softkv::server {

/// What DIR/shards records about a sharded job.
struct JobManifest {
  std::size_t shards = 0;  ///< P, the rank count every start must have
  std::string job;         ///< 32 hex digits, drawn when the job was created
  bool created = false;    ///< this start created the job (no shard holds data yet)
  bool upgraded = false;   ///< DIR/shards had the format before identities (a bare count): rewritten now
};

/// Opens or creates the manifest of the job in dir for a job of ranks > 1 ranks: throws
/// Error(invalid_argument) for another rank count (resharding is not supported), a directory holding
/// a single-process database or shard directories without a manifest; Error(corrupt_file) for a
/// damaged manifest. A new job also gets its progress record (zero writes per shard) and an empty
/// commit log before the manifest, its commit point, is written.
[[nodiscard]] JobManifest open_job(const std::filesystem::path& dir, std::size_t ranks);

/// Refuses (Error(invalid_argument)) to serve dir as a single process (ranks == 1) when it holds a
/// sharded job; does nothing otherwise.
void check_not_sharded(const std::filesystem::path& dir);

/// On every rank before its Database opens: checks that DIR/shard-<rank> is this job's shard <rank>
/// (its IDENTITY names the job, the rank and the shard count), writing the identity when the job was
/// created or upgraded by this start. Throws Error(invalid_argument) naming the shard otherwise.
void check_shard_identity(const std::filesystem::path& dir, const JobManifest& job, std::size_t rank);

/// The progress record: each shard's logged writes (Database::last_sequence) when it was written.
/// Throws Error(invalid_argument) when it is missing and Error(corrupt_file) when damaged or of
/// another job.
[[nodiscard]] std::vector<std::uint64_t> read_progress(const std::filesystem::path& dir, const JobManifest& job);

/// Writes the progress record, on stable storage (a temporary file renamed over it).
void write_progress(const std::filesystem::path& dir, const JobManifest& job, const std::vector<std::uint64_t>& applied);

/// Checks each shard's logged writes against the progress record: a shard with fewer than recorded was
/// restored from an older copy (or lost its log) and the job would serve without acknowledged writes.
/// Returns one message per such shard (empty: consistent).
[[nodiscard]] std::vector<std::string> behind_progress(const std::vector<std::uint64_t>& recorded,
                                                       const std::vector<std::uint64_t>& applied);

}  // namespace softkv::server
