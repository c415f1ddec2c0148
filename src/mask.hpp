// Query masks: which rows a query may see (QueryOptions tags_any, tag_range, exclude_ids), as the
// EligibleRows every scan of scan.hpp takes (reading only those rows' keys and values).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "scan.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

/// Whether the options restrict the rows at all.
bool has_mask(const QueryOptions& options) noexcept;

/// Error(invalid_argument) for a mask outside its documented limits (sizes, lo > hi).
void check_mask(const QueryOptions& options);

/// Per zone of kRows consecutive rows, the smallest and largest tag: a min-max "zone map", as column
/// stores keep per row group. A mask skips a zone whose [min, max] meets neither its range nor any of its
/// tags without reading the zone's tags. Zones are conservative: an overwrite or a removal only widens a
/// zone, so a zone always covers its rows' tags; rebuild() makes them exact again.
class TagZones {
 public:
  /// Rows per zone (8 KiB of tags).
  static constexpr std::size_t kRows = 1024;
  /// Exact zones for tags.
  void rebuild(std::span<const std::uint64_t> tags);
  /// Row row (at most the row count before the call: == appends a row) now has tag tag.
  void set(std::size_t row, std::uint64_t tag);
  /// The rows are now rows (after a removal took the last row away): drops zones past the end.
  void shrink(std::size_t rows);
  /// Number of zones.
  [[nodiscard]] std::size_t size() const noexcept { return lo_.size(); }
  /// Smallest tag of zone z (a lower bound after overwrites and removals).
  [[nodiscard]] std::uint64_t lo(std::size_t z) const noexcept { return lo_[z]; }
  /// Largest tag of zone z (an upper bound after overwrites and removals).
  [[nodiscard]] std::uint64_t hi(std::size_t z) const noexcept { return hi_[z]; }

 private:
  std::vector<std::uint64_t> lo_, hi_;
};

/// The rows whose tag passes options' tag tests and which are not in excluded_rows (sorted ascending).
/// Reads only the tags (8 bytes a row), never keys or values, and of those only the zones that may
/// hold an eligible tag (zones: the zone map of tags, or null to read every tag).
EligibleRows eligible_rows(std::span<const std::uint64_t> tags, const TagZones* zones, const QueryOptions& options,
                           std::span<const std::size_t> excluded_rows);

/// One byte per row of span: 1 where the row is eligible (for filtering an index's candidates).
std::vector<std::uint8_t> eligible_flags(const EligibleRows& rows, std::size_t total_rows);

}  // namespace softkv::detail
