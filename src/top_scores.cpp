// TopScores: a bounded heap fed block by block during a scan.
#include "top_scores.hpp"

#include <algorithm>
#include <limits>

namespace softkv::detail {
namespace {

// a ranks before b: higher score, then smaller id.
bool better(const TopScores::Item& a, const TopScores::Item& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

}  // namespace

TopScores::TopScores(std::size_t m, const std::uint64_t* ids) : m_(m), ids_(ids) {
  heap_.reserve(m);
}

void TopScores::push(Item item) {
  if (m_ == 0) return;
  if (heap_.size() < m_) {
    heap_.push_back(item);
    std::push_heap(heap_.begin(), heap_.end(), better);
  } else if (better(item, heap_.front())) {
    std::pop_heap(heap_.begin(), heap_.end(), better);
    heap_.back() = item;
    std::push_heap(heap_.begin(), heap_.end(), better);
  }
}

void TopScores::offer(const float* scores, std::size_t first_row, std::size_t count) {
  offer_ids(scores, ids_ + first_row, count);
}

void TopScores::offer_ids(const float* scores, const std::uint64_t* ids, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    // Cheap reject before touching ids: most rows of a large scan lose to the current worst.
    const float s = scores[i];
    if (heap_.size() == m_ && m_ > 0 && s < heap_.front().score) continue;
    // A NaN score (it left the float range) ranks first, like +inf, so the query that gets this row
    // as a candidate fails with numeric_overflow instead of silently ranking around it.
    push({s != s ? std::numeric_limits<float>::infinity() : s, ids[i]});
  }
}

void TopScores::absorb(const TopScores& other) {
  for (const Item& item : other.heap_) push(item);
}

std::vector<TopScores::Item> TopScores::sorted() const {
  std::vector<Item> items = heap_;
  std::sort(items.begin(), items.end(), better);
  return items;
}

}  // namespace softkv::detail
