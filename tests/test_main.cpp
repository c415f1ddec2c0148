// The Catch2 runner for softkv's unit tests (compiled once, shared by every test file).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
