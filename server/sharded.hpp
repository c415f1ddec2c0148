// The sharded server: `mpirun -np P softkv-server --data DIR` with P > 1 (docs/SHARDING.md, "The sharded server").
#pragma once

#include <filesystem>

#include "job_files.hpp"
#include "server.hpp"
#include "softkv/database.hpp"

namespace softkv::server {

/// The rank count mpirun gave this process (Open MPI's OMPI_COMM_WORLD_SIZE), 1 when not under mpirun.
[[nodiscard]] std::size_t mpi_world_size();

/// Runs this rank of a sharded server until rank 0 is stopped (a byte on stop_pipe[0], written by its
/// SIGINT/SIGTERM handler; rank 0 writes stop_pipe[1] itself to end its waiting thread): initialises MPI (MPI_THREAD_FUNNELED), opens DIR/shard-<rank>, and on
/// rank 0 serves config over TCP, every request run on every rank by rank 0's main thread. Returns
/// the process exit status.
int run_sharded(const std::filesystem::path& dir, const DatabaseOptions& options, ServerConfig config, const int stop_pipe[2]);

}  // namespace softkv::server
