// TagTotals (tag_totals.hpp): per-tag sums of the values in double, summed by a sweep over the rows' tags
// when a write made them stale, combined into the totals over a tags_any mask's rows with a bound on every
// rounding.
#include "tag_totals.hpp"

#include <algorithm>

namespace softkv::detail {
namespace {

// One bit of 64 per tag (a multiplicative hash's top six bits): most rows of other tags are passed over
// with a shift and a test.
std::uint64_t tag_bit(std::uint64_t tag) { return std::uint64_t{1} << ((tag * 0x9E3779B97F4A7C15ull) >> 58); }

}  // namespace

void TagTotals::touch(std::uint64_t tag, std::size_t row) noexcept {
  if (entries_.empty()) return;  // (no tags_any mask has asked: every write passes here)
  const auto it = entries_.find(tag);
  if (it == entries_.end()) return;
  it->second.fresh = false;
  // (Behind the sweep its partial sums no longer hold: a later sweep sums it again. Ahead of it, the sweep
  // reads the row as it is when it gets there.)
  if (row < sweep_at_) it->second.sweeping = false;
}

void TagTotals::moved(std::uint64_t tag, std::size_t from, std::size_t to) noexcept {
  if ((from < sweep_at_) == (to < sweep_at_)) return;
  const auto it = entries_.find(tag);
  if (it != entries_.end()) it->second.sweeping = false;
}

void TagTotals::clear() noexcept {
  for (auto& [tag, entry] : entries_) entry.fresh = false, entry.sweeping = false;
  sweep_.clear();
  sweep_at_ = 0;
}

void TagTotals::advance(const RowSpan& span, std::span<const std::uint64_t> row_tags, std::size_t sweep_limit) const {
  const std::size_t dv = span.value_dim, n = std::min(span.rows, row_tags.size());
  // The tags still in the sweep (a write may have dropped some), sorted, with their entries.
  std::vector<std::pair<std::uint64_t, Entry*>> summing;
  std::uint64_t bits = 0;
  for (const std::uint64_t tag : sweep_) {
    const auto it = entries_.find(tag);
    if (it == entries_.end() || !it->second.sweeping) continue;
    summing.emplace_back(tag, &it->second);
    bits |= tag_bit(tag);
  }
  // Removes may have left fewer rows than the sweep passed: every row left is behind it (and the tags whose
  // partial sums a remove changed have left the sweep), so it is done.
  sweep_at_ = std::min(sweep_at_, n);
  if (summing.empty()) {
    sweep_.clear();
    sweep_at_ = 0;
    return;
  }
  std::sort(summing.begin(), summing.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<float> row(dv), key(span.dim);
  std::size_t read = 0, r = sweep_at_;
  for (; r < n && read < sweep_limit; ++r) {
    const std::uint64_t tag = row_tags[r];
    if ((bits & tag_bit(tag)) == 0) continue;
    const auto at = std::lower_bound(summing.begin(), summing.end(), tag, [](const auto& e, std::uint64_t t) { return e.first < t; });
    if (at == summing.end() || at->first != tag) continue;
    Entry& entry = *at->second;
    entry.abs_max = std::max(entry.abs_max, add_rows(span, r, r + 1, entry.sum.data(), entry.square.data(), row));
    if (entry.keys.kept()) {  // (row: the value add_rows read)
      key_row(span, r, key.data());
      entry.keys.add(key.data(), row.data());
    }
    ++entry.rows;
    ++read;
  }
  sweep_at_ = r;
  if (r < n) return;
  for (auto& [tag, entry] : summing) {
    entry->fresh = true, entry->sweeping = false;
    if (entry->rows == 0) {  // a tag no row holds (a narrow tag_range names every tag in it): no sums to keep
      std::vector<double>().swap(entry->sum), std::vector<double>().swap(entry->square);
      entry->keys = KeySums{};
    }
  }
  sweep_.clear();
  sweep_at_ = 0;
}

EligibleTotals TagTotals::totals(const RowSpan& span, std::span<const std::uint64_t> row_tags, std::span<const std::uint64_t> tags,
                                 std::size_t eligible_rows, std::size_t sweep_limit) const {
  const std::size_t dv = span.value_dim;
  if (eligible_rows == 0 || dv == 0 || tags.empty() || row_tags.size() != span.rows) return {};
  std::vector<std::uint64_t> wanted(tags.begin(), tags.end());
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  if (wanted.size() > kMaxTags) return {};
  const std::lock_guard lock(mutex_);
  const auto absent = [&] {
    std::size_t n = 0;
    for (const std::uint64_t tag : wanted) n += entries_.count(tag) == 0 ? 1 : 0;
    return n;
  };
  if (entries_.size() + absent() > kMaxTags)  // room for this mask's tags: first from tags known to hold no row
    std::erase_if(entries_, [&](const auto& kv) {
      return kv.second.fresh && kv.second.rows == 0 && !std::binary_search(wanted.begin(), wanted.end(), kv.first);
    });
  if (entries_.size() + absent() > kMaxTags) {  // (still none: every kept sum is forgotten)
    entries_.clear();
    sweep_.clear();
    sweep_at_ = 0;
  }
  std::vector<const Entry*> found;
  std::vector<std::uint64_t> stale;
  for (const std::uint64_t tag : wanted) {
    Entry& entry = entries_[tag];
    found.push_back(&entry);
    if (!entry.fresh) stale.push_back(tag);
  }
  if (!stale.empty()) {
    // No sweep in progress (or one whose tags writes have all dropped): this mask's stale tags start one.
    const bool idle = std::none_of(sweep_.begin(), sweep_.end(), [&](std::uint64_t t) {
      const auto it = entries_.find(t);
      return it != entries_.end() && it->second.sweeping;
    });
    if (idle) {
      sweep_.clear();
      sweep_at_ = 0;
      sweep_.reserve(kSweepTags);
      for (const std::uint64_t tag : stale) {
        if (sweep_.size() == kSweepTags) break;
        Entry& entry = entries_[tag];
        entry.sum.assign(dv, 0.0), entry.square.assign(dv, 0.0);  // (may throw: the tag then stays out)
        entry.keys.reset(span.dim, dv);
        entry.rows = 0, entry.abs_max = 0, entry.sweeping = true;
        sweep_.push_back(tag);
      }
    }
    advance(span, row_tags, sweep_limit);
    if (std::any_of(found.begin(), found.end(), [](const Entry* e) { return !e->fresh; })) return {};
  }
  std::size_t rows = 0;
  TotalsSum total(dv);
  for (const Entry* entry : found) {
    if (entry->rows == 0) continue;  // (a tag no row holds)
    rows += entry->rows;
    total.add(entry->sum.data(), entry->square.data(), static_cast<double>(entry->rows), entry->abs_max);
    total.add_keys(entry->keys);
  }
  // Rows of these tags that the mask leaves out (another mask field): not these totals.
  if (rows != eligible_rows) return {};
  return total.finish(rows);
}

}  // namespace softkv::detail
