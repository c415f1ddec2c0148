// The rules about ids that every write path shares (one collection, the database, the sharded
// collection and the sharded server): the ids an add assigns, and the ids a remove may name.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace softkv::detail {

/// The n ids an add assigns after the largest ever used: first, first + 1, ..., first + n - 1.
/// Error(invalid_argument, "the id space is exhausted") when they would reach the reserved id 2^64 - 1.
[[nodiscard]] std::vector<std::uint64_t> next_ids(std::uint64_t first, std::size_t n);

/// Error(invalid_argument) naming the smallest id a remove gives twice (a remove is all or nothing).
void check_distinct(std::span<const std::uint64_t> ids);

}  // namespace softkv::detail
