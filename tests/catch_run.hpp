// The Catch2 session a test runner's main calls (Catch2's implementation is compiled once, in
// catch_impl.cpp: a runner's own file then needs none of catch.hpp).
#pragma once

namespace softkv::test {

/// Runs the test cases selected by argv (Catch2's command line); the number of failed test cases.
int catch_run(int argc, char** argv);

}  // namespace softkv::test
