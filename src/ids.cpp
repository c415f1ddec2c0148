// The id rules every write path shares (ids.hpp), and the id -> row map (id_map.hpp).
#include "ids.hpp"
#include "id_map.hpp"

#include <algorithm>
#include <string>

#include "softkv/error.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

std::vector<std::uint64_t> next_ids(std::uint64_t first, std::size_t n) {
  if (first > kReservedId || n > kReservedId - first)
    throw Error(ErrorCode::invalid_argument, "the id space is exhausted: " + std::to_string(n) + " new ids from " + std::to_string(first) +
                                                 " would reach the reserved id 2^64-1");
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = first + i;
  return ids;
}

void check_distinct(std::span<const std::uint64_t> ids) {
  if (ids.size() < 2) return;
  std::vector<std::uint64_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (const auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end())
    throw Error(ErrorCode::invalid_argument, "remove: id " + std::to_string(*twice) + " is given twice (a remove names each id once)");
}

bool IdMap::erase(std::uint64_t id) noexcept {
  std::size_t i = locate(id);
  if (i == kAbsent) return false;
  // Backward shift: each later id of the run moves into the hole unless its home lies cyclically in
  // (hole, its slot], where a lookup from its home would not pass the hole. No tombstones.
  for (std::size_t j = (i + 1) & mask_; slots_[j].id != kReservedId; j = (j + 1) & mask_) {
    const std::size_t k = home(slots_[j].id);
    const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (!stays) {
      slots_[i] = slots_[j];
      i = j;
    }
  }
  slots_[i] = Slot{};
  --size_;
  return true;
}

void IdMap::grow_for(std::size_t n) {
  if (n * 10 <= slots_.size() * 7) return;
  std::size_t capacity = 16;
  unsigned bits = 4;
  while (n * 10 > capacity * 7) capacity *= 2, ++bits;
  std::vector<Slot> old(capacity);
  old.swap(slots_);
  mask_ = capacity - 1;
  shift_ = 64 - bits;
  for (const Slot& s : old)
    if (s.id != kReservedId) slots_[slot_for(s.id)] = s;
}

}  // namespace softkv::detail
