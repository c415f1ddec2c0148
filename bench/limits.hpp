// The machine's limits, measured in the benchmark's own process: read bandwidth, sgemm throughput and
// the FMA peak.
#pragma once

#include <cstddef>
#include <string>

namespace softkv::bench {

/// GB/s of a streaming read-and-sum over bytes of memory split across threads (best of reps).
double read_bandwidth_gbs(std::size_t bytes, unsigned threads, int reps);

/// A read-bandwidth probe whose buffer is allocated and first touched once, so that it can be timed
/// again and again beside the code it is compared with (one pass per measure()).
class BandwidthProbe {
 public:
  /// bytes of buffer, first touched by threads threads (as measure() will read it).
  BandwidthProbe(std::size_t bytes, unsigned threads);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  /// GB/s of one streaming read-and-sum pass over the buffer, split across the threads.
  double measure();

 private:
  float* buf_;
  std::size_t n_;
  unsigned threads_;
};

/// GFLOP/s of OpenBLAS sgemm on n x n matrices with this many OpenBLAS threads (best of reps).
double sgemm_gflops(std::size_t n, int threads, int reps);

/// GFLOP/s of a register-only loop of independent float fused multiply-adds on threads threads, in the
/// widest vectors the CPU runs (AVX-512, AVX2+FMA, else SSE2 multiply and add): the compute peak no
/// kernel can pass, measured rather than taken from a datasheet (clocks and FMA units differ per CPU).
/// Best of reps. isa receives the instruction set used.
double fma_peak_gflops(unsigned threads, int reps, std::string* isa = nullptr);

/// The CPU model from /proc/cpuinfo.
std::string cpu_model();

}  // namespace softkv::bench
