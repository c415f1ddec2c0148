// Query masks: eligibility from the tags and excluded rows, and the scans over eligible runs.
#include "mask.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "softkv/error.hpp"

namespace softkv::detail {

bool has_mask(const QueryOptions& options) noexcept {
  return !options.tags_any.empty() || options.tag_range.has_value() || !options.exclude_ids.empty();
}

void check_mask(const QueryOptions& options) {
  if (options.tags_any.size() > QueryOptions::kMaxTagsAny)
    throw Error(ErrorCode::invalid_argument, "tags_any holds " + std::to_string(options.tags_any.size()) + " tags; at most " +
                                                 std::to_string(QueryOptions::kMaxTagsAny) + " are allowed");
  if (options.exclude_ids.size() > QueryOptions::kMaxExcludeIds)
    throw Error(ErrorCode::invalid_argument, "exclude_ids holds " + std::to_string(options.exclude_ids.size()) +
                                                 " ids; at most " + std::to_string(QueryOptions::kMaxExcludeIds) + " are allowed");
  if (options.tag_range && options.tag_range->lo > options.tag_range->hi)
    throw Error(ErrorCode::invalid_argument, "tag_range has lo " + std::to_string(options.tag_range->lo) + " above hi " +
                                                 std::to_string(options.tag_range->hi));
}

namespace {

// Appends a run of rows [begin, end) to out, merged into the last run if it continues it.
void append_run(EligibleRows& out, std::size_t begin, std::size_t end) {
  if (!out.runs.empty() && out.runs.back().begin + out.runs.back().count == begin) out.runs.back().count += end - begin;
  else out.runs.push_back({begin, end - begin});
}

// Appends the rows of [first, last) that keep(tag) accepts to out, as runs. The tags are tested 64 at a
// time into a bit mask (each row once, without a branch), and the runs are read off the mask's bit
// transitions: the cost is a pass over 8 bytes a row whether the rows alternate or come in long runs.
template <class Keep>
void collect_runs(std::span<const std::uint64_t> tags, std::size_t first, std::size_t last, const Keep& keep,
                  EligibleRows& out) {
  const std::uint64_t* t = tags.data();
  bool open = false;
  std::size_t begin = 0;
  for (std::size_t r = first; r < last; r += 64) {
    const std::size_t n = std::min<std::size_t>(64, last - r);
    std::uint64_t bits = 0;
    for (std::size_t j = 0; j < n; ++j) bits |= static_cast<std::uint64_t>(keep(t[r + j])) << j;
    for (std::size_t j = 0; j < n;) {
      const std::uint64_t next = open ? ~bits >> j : bits >> j;  // the next row whose test differs
      if (next == 0) break;
      j += static_cast<std::size_t>(__builtin_ctzll(next));
      if (j >= n) break;
      if (open) append_run(out, begin, r + j);
      else begin = r + j;
      open = !open;
    }
  }
  if (open) append_run(out, begin, last);
}

// A set of more than 8 tags as an open-addressing hash table: one or two probes a test, where a
// binary search would branch unpredictably log2(size) times.
class TagSet {
 public:
  explicit TagSet(const std::vector<std::uint64_t>& sorted) {
    std::size_t size = 16;
    while (size < 2 * sorted.size()) size *= 2;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(size));
    mask_ = size - 1;
    for (const std::uint64_t t : sorted) {  // the empty marker: the smallest value not in the set
      if (t != empty_) break;
      ++empty_;
    }
    slots_.assign(size, empty_);
    for (const std::uint64_t t : sorted) {
      std::size_t i = slot(t);
      while (slots_[i] != empty_) i = (i + 1) & mask_;
      slots_[i] = t;
    }
  }
  [[nodiscard]] bool contains(std::uint64_t t) const {
    for (std::size_t i = slot(t);; i = (i + 1) & mask_) {
      if (slots_[i] == t) return t != empty_;
      if (slots_[i] == empty_) return false;
    }
  }

 private:
  [[nodiscard]] std::size_t slot(std::uint64_t t) const { return static_cast<std::size_t>((t * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<std::uint64_t> slots_;
  std::uint64_t empty_ = 0;
  unsigned shift_ = 0;
  std::size_t mask_ = 0;
};

// Tests the rows of every zone that may hold a tag keep accepts (may(lo, hi)); all rows without zones.
template <class May, class Keep>
void collect_zones(std::span<const std::uint64_t> tags, const TagZones* zones, const May& may, const Keep& keep,
                   EligibleRows& out) {
  if (zones == nullptr || zones->size() * TagZones::kRows < tags.size()) {
    collect_runs(tags, 0, tags.size(), keep, out);
    return;
  }
  for (std::size_t z = 0; z * TagZones::kRows < tags.size(); ++z) {
    if (!may(zones->lo(z), zones->hi(z))) continue;
    const std::size_t first = z * TagZones::kRows;
    collect_runs(tags, first, std::min(tags.size(), first + TagZones::kRows), keep, out);
  }
}

// Cuts the (sorted, distinct) excluded rows out of the runs.
void cut_excluded(EligibleRows& rows, std::span<const std::size_t> excluded) {
  if (excluded.empty()) return;
  std::vector<RowRun> kept;
  kept.reserve(rows.runs.size() + excluded.size());
  std::size_t e = 0;
  for (RowRun run : rows.runs) {
    const std::size_t end = run.begin + run.count;
    while (e < excluded.size() && excluded[e] < run.begin) ++e;
    std::size_t from = run.begin;
    for (; e < excluded.size() && excluded[e] < end; ++e) {
      if (excluded[e] > from) kept.push_back({from, excluded[e] - from});
      from = excluded[e] + 1;
    }
    if (end > from) kept.push_back({from, end - from});
  }
  rows.runs = std::move(kept);
}

}  // namespace

void TagZones::rebuild(std::span<const std::uint64_t> tags) {
  const std::size_t zones = (tags.size() + kRows - 1) / kRows;
  lo_.assign(zones, std::numeric_limits<std::uint64_t>::max());
  hi_.assign(zones, 0);
  for (std::size_t r = 0; r < tags.size(); ++r) {
    lo_[r / kRows] = std::min(lo_[r / kRows], tags[r]);
    hi_[r / kRows] = std::max(hi_[r / kRows], tags[r]);
  }
}

void TagZones::set(std::size_t row, std::uint64_t tag) {
  const std::size_t z = row / kRows;
  if (z == lo_.size()) {
    lo_.push_back(tag);
    hi_.push_back(tag);
    return;
  }
  lo_[z] = std::min(lo_[z], tag);
  hi_[z] = std::max(hi_[z], tag);
}

void TagZones::shrink(std::size_t rows) {
  const std::size_t zones = (rows + kRows - 1) / kRows;
  if (zones < lo_.size()) {
    lo_.resize(zones);
    hi_.resize(zones);
  }
}

EligibleRows eligible_rows(std::span<const std::uint64_t> tags, const TagZones* zones, const QueryOptions& options,
                           std::span<const std::size_t> excluded_rows) {
  std::vector<std::uint64_t> any = options.tags_any;
  std::sort(any.begin(), any.end());
  any.erase(std::unique(any.begin(), any.end()), any.end());
  const TagRange range = options.tag_range.value_or(TagRange{});
  const std::uint64_t lo = range.lo, hi = range.hi;
  // A zone [zlo, zhi] may hold an eligible tag when it meets the range and (with a set) holds one of its tags.
  auto may = [&](std::uint64_t zlo, std::uint64_t zhi) {
    if (zhi < lo || zlo > hi) return false;
    if (any.empty()) return true;
    const auto it = std::lower_bound(any.begin(), any.end(), zlo);
    return it != any.end() && *it <= zhi;
  };
  // The tests are branch-free where they can be (bitwise on the comparisons): the range is two
  // compares, one tag a third, up to 8 tags compared in turn; a larger set is a hash table.
  auto in_range = [lo, hi](std::uint64_t t) { return (t >= lo) & (t <= hi); };
  EligibleRows out;
  if (any.empty()) {
    collect_zones(tags, zones, may, in_range, out);
  } else if (any.size() == 1) {
    const std::uint64_t only = any[0];
    collect_zones(tags, zones, may, [&](std::uint64_t t) { return in_range(t) & (t == only); }, out);
  } else if (any.size() <= 8) {
    std::uint64_t set[8];
    const std::size_t m = any.size();
    for (std::size_t i = 0; i < 8; ++i) set[i] = any[i < m ? i : m - 1];  // padded with a repeat
    collect_zones(tags, zones, may, [&](std::uint64_t t) {
      bool hit = false;
      for (std::size_t i = 0; i < 8; ++i) hit |= t == set[i];
      return in_range(t) & hit;
    }, out);
  } else {
    const TagSet set(any);
    collect_zones(tags, zones, may, [&](std::uint64_t t) { return in_range(t) & set.contains(t); }, out);
  }
  std::vector<std::size_t> excluded(excluded_rows.begin(), excluded_rows.end());
  excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());  // an id given twice
  cut_excluded(out, excluded);
  for (const RowRun& run : out.runs) out.count += run.count;
  return out;
}

std::vector<std::uint8_t> eligible_flags(const EligibleRows& rows, std::size_t total_rows) {
  std::vector<std::uint8_t> flags(total_rows, 0);
  for (const RowRun& run : rows.runs) std::fill_n(flags.begin() + static_cast<std::ptrdiff_t>(run.begin), run.count, 1);
  return flags;
}

}  // namespace softkv::detail
