// IdMap: a collection's id -> row map, flat (open addressing with linear probing, Fibonacci hashing) so
// that a lookup is one or two cache lines instead of a chain of nodes: the pruned paths map every id a
// list or a top-k search returns to its row, thousands a query (docs/DESIGN.md, "Layout").
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "softkv/types.hpp"  // kReservedId: no entry has it, so it marks an empty slot

namespace softkv::detail {

/// Ids (any but kReservedId) to rows. Not thread safe for writes; lookups are const and may run together.
class IdMap {
 public:
  /// The row of id, or null when absent (valid until the next write).
  [[nodiscard]] const std::uint64_t* find(std::uint64_t id) const noexcept {
    const std::size_t i = locate(id);
    return i == kAbsent ? nullptr : &slots_[i].row;
  }
  /// Whether id has a row.
  [[nodiscard]] bool contains(std::uint64_t id) const noexcept { return find(id) != nullptr; }
  /// Adds id -> row unless id is present or is kReservedId (then false, nothing changed).
  bool emplace(std::uint64_t id, std::uint64_t row) {
    if (id == kReservedId) return false;
    grow_for(size_ + 1);
    Slot& s = slots_[slot_for(id)];
    if (s.id == id) return false;
    s = {id, row};
    ++size_;
    return true;
  }
  /// Sets id's row, adding id if absent (kReservedId: nothing). Allocates only to add: re-pointing a
  /// present id (remove() moving the last row into a hole) cannot throw.
  void set(std::uint64_t id, std::uint64_t row) {
    if (id == kReservedId) return;
    if (const std::size_t i = locate(id); i != kAbsent) {
      slots_[i].row = row;
      return;
    }
    grow_for(size_ + 1);
    slots_[slot_for(id)] = {id, row};
    ++size_;
  }
  /// Removes id; false when absent.
  bool erase(std::uint64_t id) noexcept;
  /// Room for n ids without rehashing.
  void reserve(std::size_t n) { grow_for(n); }
  /// Ids held.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  struct Slot {
    std::uint64_t id = kReservedId;
    std::uint64_t row = 0;
  };
  // Fibonacci hashing: the top bits of id times 2^64 / phi (consecutive ids land far apart), the high
  // half folded in first (ids differing only in their top bits would otherwise share a few homes).
  [[nodiscard]] std::size_t home(std::uint64_t id) const noexcept {
    return static_cast<std::size_t>(((id ^ (id >> 32)) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  static constexpr std::size_t kAbsent = ~std::size_t{0};
  // id's slot, or kAbsent (kReservedId marks the empty slots: never found).
  [[nodiscard]] std::size_t locate(std::uint64_t id) const noexcept {
    if (size_ == 0 || id == kReservedId) return kAbsent;
    for (std::size_t i = home(id);; i = (i + 1) & mask_) {
      if (slots_[i].id == id) return i;
      if (slots_[i].id == kReservedId) return kAbsent;
    }
  }
  // id's slot, or the empty slot where it would go.
  [[nodiscard]] std::size_t slot_for(std::uint64_t id) const noexcept {
    std::size_t i = home(id);
    while (slots_[i].id != id && slots_[i].id != kReservedId) i = (i + 1) & mask_;
    return i;
  }
  // Rehashes into enough slots for n ids at a load of at most 7/10.
  void grow_for(std::size_t n);

  std::vector<Slot> slots_;
  std::size_t size_ = 0, mask_ = 0;
  unsigned shift_ = 64;
};

}  // namespace softkv::detail
