// The machine's limits, measured in the benchmark's own process: read bandwidth and sgemm throughput.
#pragma once

#include <cstddef>
#include <string>

namespace softkv::bench {

/// GB/s of a streaming read-and-sum over bytes of memory split across threads (best of reps).
double read_bandwidth_gbs(std::size_t bytes, unsigned threads, int reps);

/// GFLOP/s of OpenBLAS sgemm on n x n matrices with this many OpenBLAS threads (best of reps).
double sgemm_gflops(std::size_t n, int threads, int reps);

/// The CPU model from /proc/cpuinfo.
std::string cpu_model();

}  // namespace softkv::bench
