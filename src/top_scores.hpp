// TopScores: keeps the m best (score, row) pairs a soft scan offers, ties to the smaller id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "simd/kernel_table.hpp"

namespace softkv::detail {

/// A bounded min-heap of the best m rows seen during a scan.
class TopScores final : public ScoreSink {
 public:
  /// One scored row.
  struct Item {
    float score;         ///< s_i
    std::uint64_t id;    ///< the entry's id
  };

  /// Keeps up to m items; ids[row] is the id of an offered row of the scanned span.
  TopScores(std::size_t m, const std::uint64_t* ids);

  void offer(const float* scores, std::size_t first_row, std::size_t count) override;

  /// Offers count scores of rows whose ids are ids[0 .. count) (rows not in one scanned span).
  void offer_ids(const float* scores, const std::uint64_t* ids, std::size_t count);

  /// Whether m items are kept.
  [[nodiscard]] bool full() const noexcept { return heap_.size() >= m_; }
  /// The worst kept item; requires at least one.
  [[nodiscard]] const Item& worst() const noexcept { return heap_.front(); }

  /// Adds other's items (for merging the parts of a split scan).
  void absorb(const TopScores& other);

  /// The kept items, best first (higher score, then smaller id).
  [[nodiscard]] std::vector<Item> sorted() const;

 private:
  void push(Item item);

  std::size_t m_;
  const std::uint64_t* ids_;
  std::vector<Item> heap_;  // min-heap by "better", the worst kept item on top
};

}  // namespace softkv::detail
