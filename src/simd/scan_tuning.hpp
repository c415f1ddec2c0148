// The prefetch settings of the scans' key stream, for the machine at hand: softkv::tune_scans()
// (simd.hpp) measures candidates and keeps the fastest; until then (or without it) the defaults of the
// CPU's vendor (tuning()), measured on Zen 5 and Ice Lake (bench/analysis.md). Prefetching changes no
// result, only how fast the rows arrive.
#pragma once

#include <atomic>
#include <cstdint>

namespace softkv::detail::scan {

/// page_stride_from for "every line of every key row" (no row is this long).
inline constexpr std::uint32_t kEveryLine = 0xffffffffu;

/// The settings every kernel path reads when it starts a stream (relaxed loads: a change applies to later scans).
struct ScanTuning {
  std::atomic<std::uint32_t> ahead{4096};            ///< bytes prefetched ahead of the reads
  std::atomic<std::uint32_t> page_stride_from{256};  ///< key rows this size or larger: one prefetch per 4 KiB page, else per line
};

/// page_stride_from before any tuning: a page apart from 256-byte rows on AMD (Zen 5: every line cost
/// the hard scan ~20% of the bandwidth), every line elsewhere (Ice Lake: a page stride cost the hard scan
/// 13-24% at d = 128, f32 and f16, and never gained). Read from the CPU's vendor once.
std::uint32_t default_page_stride_from();

/// The process's settings (the vendor's defaults until tune_scans measures others).
ScanTuning& tuning();

}  // namespace softkv::detail::scan
