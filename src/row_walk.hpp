// Walking the eligible runs of a masked (or multi-head) scan: parts by eligible row count, and blocks
// that are either long runs in place or short runs gathered as stored.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mask.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"

namespace softkv::detail {

// Runs at least this long are scanned in place; shorter ones are gathered into a block first, so a
// kernel call always has enough rows to amortise its set-up (the batched kernels transpose queries).
inline constexpr std::size_t kInPlaceRun = 64;

// Cuts the runs into parts holding about equally many eligible rows (at least one part).
inline std::vector<std::vector<RowRun>> split_runs(const EligibleRows& rows, std::size_t parts) {
  parts = std::clamp<std::size_t>(parts, 1, std::max<std::size_t>(1, rows.count));
  std::vector<std::vector<RowRun>> out(parts);
  std::size_t part = 0, taken = 0;
  for (RowRun run : rows.runs) {
    while (run.count > 0) {
      const std::size_t quota = rows.count * (part + 1) / parts;  // rows parts 0..part hold in all
      const std::size_t n = part + 1 == parts ? run.count : std::min(run.count, quota - taken);
      if (n > 0) out[part].push_back({run.begin, n});
      run.begin += n;
      run.count -= n;
      taken += n;
      if (taken == quota && part + 1 < parts) ++part;
    }
  }
  return out;
}

// Visits the rows of runs in order as RowSpans: long runs in place (rows == nullptr, absolute row =
// first + r), short runs gathered into one block (absolute row = rows[r]). Values are copied only when
// span has them. The gather block (up to 1 MiB at d = dv = 512) is allocated on the first short run,
// and not zeroed: a walk of long runs only (every unmasked multi-head scan) allocates nothing, and a
// few short runs touch only the pages they fill. Allocated and zeroed up front it cost every part of
// every query 1.4-2.1 ms where its pages were faulted in afresh (heads_bench at 256 rows).
class BlockWalker {
 public:
  explicit BlockWalker(const RowSpan& span) : span_(span) {}

  template <class Visit>
  void walk(std::span<const RowRun> runs, const Visit& visit) {
    // Rows are copied as stored (at their precision, with their i8 scale): the kernels widen them
    // exactly as they widen rows in place.
    const std::size_t kb = span_.key_row_bytes(), vb = span_.value_row_bytes();
    const auto* keys = static_cast<const std::byte*>(span_.keys);
    const auto* values = static_cast<const std::byte*>(span_.values);
    std::size_t filled = 0;
    auto flush = [&] {
      if (filled == 0) return;
      RowSpan block = span_;
      block.keys = keys_.get();
      block.values = values_.get();
      block.key_scales = span_.key_scales != nullptr ? scales_.data() : nullptr;
      block.ids = ids_.data();
      block.rows = filled;
      visit(block, rows_.data(), 0);
      filled = 0;
    };
    for (const RowRun& run : runs) {
      if (run.count >= kInPlaceRun) {
        flush();
        visit(span_.sub(run.begin, run.count), nullptr, run.begin);
        continue;
      }
      if (ids_.empty()) allocate();
      for (std::size_t r = run.begin; r < run.begin + run.count; ++r) {
        std::copy_n(keys + r * kb, kb, keys_.get() + filled * kb);
        if (values != nullptr) std::copy_n(values + r * vb, vb, values_.get() + filled * vb);
        if (span_.key_scales != nullptr) scales_[filled] = span_.key_scales[r];
        ids_[filled] = span_.ids[r];
        rows_[filled] = r;
        if (++filled == kScanBlockRows) flush();
      }
    }
    flush();
  }

 private:
  // Rows are written before a kernel reads them, so the block is left uninitialised.
  void allocate() {
    keys_ = std::make_unique_for_overwrite<std::byte[]>(kScanBlockRows * span_.key_row_bytes());
    if (span_.values != nullptr) values_ = std::make_unique_for_overwrite<std::byte[]>(kScanBlockRows * span_.value_row_bytes());
    if (span_.key_scales != nullptr) scales_.resize(kScanBlockRows);
    ids_.resize(kScanBlockRows);
    rows_.resize(kScanBlockRows);
  }

  RowSpan span_;
  std::unique_ptr<std::byte[]> keys_, values_;
  std::vector<float> scales_;
  std::vector<std::uint64_t> ids_;
  std::vector<std::size_t> rows_;
};

// The absolute row of row r of a visited block.
inline std::size_t absolute(const std::size_t* rows, std::size_t first, std::size_t r) { return rows != nullptr ? rows[r] : first + r; }

// Merges the argmaxes a kernel found in a visited block (rows relative to the block) into best, lane
// by lane; rows become absolute within the span whose ids break ties.
inline void merge_block_best(std::span<const ArgMax> block_best, const std::size_t* rows, std::size_t first,
                             const std::uint64_t* ids, ArgMax* best) {
  for (std::size_t i = 0; i < block_best.size(); ++i) {
    ArgMax one = block_best[i];
    if (one.row != ArgMax::kNoRow) one.row = absolute(rows, first, one.row);
    merge_argmax(one, ids, best[i]);
  }
}

// Every part's lanes merged into one argmax per lane.
inline std::vector<ArgMax> merge_part_best(const std::vector<std::vector<ArgMax>>& part_best, std::size_t lanes,
                                           const std::uint64_t* ids) {
  std::vector<ArgMax> merged(lanes);
  for (const auto& best : part_best)
    for (std::size_t i = 0; i < lanes; ++i) merge_argmax(best[i], ids, merged[i]);
  return merged;
}

inline RowSpan keys_only(RowSpan span) {
  span.values = nullptr;
  return span;
}

}  // namespace softkv::detail
