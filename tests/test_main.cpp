// The Catch2 runner for softkv's unit tests (Catch2 itself is compiled once, in catch_impl.cpp).
#include "catch_run.hpp"

int main(int argc, char** argv) { return softkv::test::catch_run(argc, argv); }
