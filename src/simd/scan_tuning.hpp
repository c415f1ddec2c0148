// The prefetch settings of the scans' key stream, for the machine at hand: softkv::tune_scans()
// (simd.hpp) measures candidates and keeps the fastest; until then (or without it) the defaults below,
// measured on Zen 5 (bench/analysis.md). Prefetching changes no result, only how fast the rows arrive.
#pragma once

#include <atomic>
#include <cstdint>

namespace softkv::detail::scan {

/// The settings every kernel path reads when it starts a stream (relaxed loads: a change applies to later scans).
struct ScanTuning {
  std::atomic<std::uint32_t> ahead{4096};            ///< bytes prefetched ahead of the reads
  std::atomic<std::uint32_t> page_stride_from{256};  ///< key rows this size or larger: one prefetch per 4 KiB page, else per line
};

/// The process's settings.
ScanTuning& tuning();

}  // namespace softkv::detail::scan
