// Catch2's implementation, compiled once (it is the slowest file of the build) and linked into every
// test runner: the unit tests' main (test_main.cpp) and the MPI one (mpi/test_main_mpi.cpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_run.hpp"

int softkv::test::catch_run(int argc, char** argv) { return Catch::Session().run(argc, argv); }
