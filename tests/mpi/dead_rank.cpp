// dead_rank: the last rank kills itself with SIGKILL while the others wait in a sharded query. MPI's
// failure model (docs/SHARDING.md, "Running sharded"): the job ends and mpirun exits non-zero; nothing hangs.
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <vector>

#include "softkv/mpi.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  {
    softkv::CollectionConfig config;
    config.dim = 4;
    config.value_dim = 2;
    softkv::ShardedCollection s(MPI_COMM_WORLD, config);
    const std::vector<float> keys(8 * 4, 1.0f), values(8 * 2, 1.0f);
    (void)s.add_batch(keys, values);
    if (rank == 0) std::printf("dead_rank: rows added\n"), std::fflush(stdout);  // the test checks the job ran this far
    if (rank == ranks - 1) std::raise(SIGKILL);
    const std::vector<float> q(4, 1.0f);
    (void)s.query_soft(q);  // waits on the dead rank's part of the reduction
  }
  MPI_Finalize();
  return 0;  // reached only if the job survived the dead rank, which the test counts as a failure
}
