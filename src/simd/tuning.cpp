// The scans' prefetch settings measured on the machine at hand (scan_tuning.hpp, softkv::tune_scans).
//
// A hard scan over 256 MiB of float32 keys (d = 128: 512-byte rows), split over the pool's threads as a
// query's is, is timed with each candidate setting, three times round, best of three. Out of cache on
// purpose: a 32 MiB scan ran from the L3 of a Zen 5 VM, where the ranking of the settings differs. A
// candidate replaces the settings in force only when it is at least 5% faster (the noise of a shared VM is a few
// percent). Prefetching changes no result: only how fast the rows arrive.
#include "simd/scan_tuning.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "softkv/simd.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"
#include "thread_pool.hpp"

namespace softkv {
namespace detail::scan {

std::uint32_t default_page_stride_from() {
  static const std::uint32_t from = [] {
    __builtin_cpu_init();  // safe even if this first runs before the CPU-model constructor
    return __builtin_cpu_is("amd") ? 256u : kEveryLine;
  }();
  return from;
}

ScanTuning& tuning() {
  static ScanTuning settings{{4096}, {default_page_stride_from()}};
  return settings;
}

}  // namespace detail::scan

std::string tune_scans() {
  using Clock = std::chrono::steady_clock;
  constexpr std::size_t kDim = 128, kBytes = std::size_t{256} << 20, kRows = kBytes / (kDim * sizeof(float));
  std::vector<float> keys(kRows * kDim);
  std::uint32_t x = 2463534242u;  // xorshift: any bytes do, the scan's speed does not depend on them
  for (float& k : keys) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    k = static_cast<float>(x >> 8) * 0x1p-24f - 0.5f;
  }
  std::vector<std::uint64_t> ids(kRows);
  for (std::size_t i = 0; i < kRows; ++i) ids[i] = i;
  const std::vector<float> query(keys.begin(), keys.begin() + kDim);
  detail::RowSpan span;
  span.keys = keys.data();
  span.ids = ids.data();
  span.rows = kRows;
  span.dim = kDim;
  const detail::KernelTable& kernels = detail::kernels();
  // As queries scan: split over the thread pool's threads (on two cores, both: the memory bus is then
  // the limit, and what a prefetch costs in instructions matters less than when it is issued).
  const std::size_t parts = detail::ThreadPool::shared().concurrency();
  detail::scan::ScanTuning& t = detail::scan::tuning();
  const std::uint32_t default_ahead = t.ahead, default_from = t.page_stride_from;
  // Every candidate (the defaults first), timed in turn three times round, so that a change in the
  // machine's load (a shared VM) hits them alike; each keeps its best time.
  struct Candidate {
    std::uint32_t ahead, from;
    double ns = std::numeric_limits<double>::infinity();
  };
  std::vector<Candidate> candidates{{default_ahead, default_from}};
  // Page strides from 256-byte rows on, or every line of these 512-byte rows, at three distances. Where
  // every line wins, it is kept for longer rows too on CPUs whose default is every line (Ice Lake: no loss
  // at 2 KiB rows); on AMD rows of 1 KiB and more stay a page apart (every line unmeasured there).
  const std::uint32_t every_line = detail::scan::default_page_stride_from() == detail::scan::kEveryLine ? detail::scan::kEveryLine : 1024u;
  for (const std::uint32_t from : {256u, every_line})
    for (const std::uint32_t ahead : {2048u, 4096u, 8192u})
      if (ahead != default_ahead || from != default_from) candidates.push_back({ahead, from});
  (void)detail::hard_scan_split(kernels, query.data(), 1.0f, span, parts);  // the first pass faults the pages in
  for (int round = 0; round < 3; ++round)
    for (Candidate& c : candidates) {
      t.ahead = c.ahead;
      t.page_stride_from = c.from;
      const auto t0 = Clock::now();
      const detail::ArgMax winner = detail::hard_scan_split(kernels, query.data(), 1.0f, span, parts);
      const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
      if (winner.row != detail::ArgMax::kNoRow) c.ns = std::min(c.ns, ns);
    }
  // The fastest, if it beats the defaults by 5% (the noise of a shared VM is a few percent): else the defaults.
  const double at_default = candidates.front().ns;
  std::uint32_t best_ahead = default_ahead, best_from = default_from;
  double best = at_default;
  for (const Candidate& c : candidates)
    if (c.ns < 0.95 * at_default && c.ns < best) best = c.ns, best_ahead = c.ahead, best_from = c.from;
  t.ahead = best_ahead;
  t.page_stride_from = best_from;
  char line[256];
  std::snprintf(line, sizeof line,
                "key stream prefetched %u bytes ahead, %s for 512-byte rows (%.2f GB/s on %zu threads; the settings before: %u, %s: %.2f GB/s)",
                best_ahead, best_from <= 512 ? "a page apart" : "every line", static_cast<double>(kBytes) / best, parts, default_ahead,
                default_from <= 512 ? "a page apart" : "every line", static_cast<double>(kBytes) / at_default);
  return line;
}

std::string scan_tuning() {
  const detail::scan::ScanTuning& t = detail::scan::tuning();
  const std::uint32_t from = t.page_stride_from.load();
  return "key stream prefetched " + std::to_string(t.ahead.load()) + " bytes ahead, " +
         (from == detail::scan::kEveryLine ? std::string("every line of every key row")
                                           : "a page apart for key rows of " + std::to_string(from) + " bytes and more");
}

}  // namespace softkv
