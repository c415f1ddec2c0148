// The id rules every write path shares (ids.hpp).
#include "ids.hpp"

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

}  // namespace softkv::detail
