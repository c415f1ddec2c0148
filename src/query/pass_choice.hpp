// How a fused pass of a few queries runs, chosen per collection by what each way measured on it: the
// batch kernel (queries side by side in 16-wide lanes, so 2 queries cost what 16 do) or the
// single-query kernel for each query over every chunk of rows while it is in cache (one pass over
// memory, then one over cache per further query; answers bit for bit those of single queries).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace softkv::detail {

/// The measured costs of the two ways for each pass size up to kMax queries, and the choice.
class PassChoice {
 public:
  /// Passes of more queries always take the batch kernel (a whole lane group or more).
  static constexpr std::size_t kMax = 32;
  /// The two ways.
  enum class Way : std::uint8_t { batch = 0, each = 1 };

  /// The way for a pass of n queries: each way is tried once for this n, then the cheaper per row
  /// measured, the other re-measured one pass in 16. Passes of more than kMax: batch.
  [[nodiscard]] Way choose(std::size_t n) noexcept {
    if (n > kMax || n < 2) return Way::batch;
    const double b = ns_per_row_[0][n].load(std::memory_order_relaxed), e = ns_per_row_[1][n].load(std::memory_order_relaxed);
    if (e == 0) return Way::each;
    if (b == 0) return Way::batch;
    const Way best = e < b ? Way::each : Way::batch;
    const bool explore = passes_[n].fetch_add(1, std::memory_order_relaxed) % 16 == 15;
    return explore ? (best == Way::each ? Way::batch : Way::each) : best;
  }

  /// A pass of n queries over rows rows took ns nanoseconds the way `way`.
  void note(Way way, std::size_t n, double ns, std::size_t rows) noexcept {
    if (n > kMax || n < 2 || rows == 0) return;
    std::atomic<double>& average = ns_per_row_[static_cast<int>(way)][n];
    const double sample = ns / static_cast<double>(rows), old = average.load(std::memory_order_relaxed);
    average.store(old == 0 ? sample : 0.75 * old + 0.25 * sample, std::memory_order_relaxed);
  }

 private:
  std::atomic<double> ns_per_row_[2][kMax + 1] = {};
  std::atomic<std::uint32_t> passes_[kMax + 1] = {};
};

}  // namespace softkv::detail
