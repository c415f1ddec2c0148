// Catch2 runner for tests under mpirun: every rank runs every test case in the same order (so their
// collective calls meet); the job fails when any rank has a failure. Catch2 itself is compiled once,
// in tests/catch_impl.cpp.
#include <mpi.h>

#include "../catch_run.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // the scan pool's threads never call MPI
  const int failed = softkv::test::catch_run(argc, argv);
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
