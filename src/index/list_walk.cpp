// The walk over certified lists (ListWalk, certified_lists.hpp): lists by decreasing upper bound, and
// the bound on the mass of the lists not visited yet, kept in buckets without an exp per list.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "index/certified_lists.hpp"

namespace softkv::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

namespace {

// A list's bounded mass live e^{ub - top} is counted as live e^{b/8}, b = ceil(8 (ub - top)) (at most
// 1/8 nat above it, never below), from a table: no exp per list, and a walk subtracts exactly what it
// added. Bounds more than 128 nats below the top count as e^-128.
constexpr int kBucketsPerNat = 8;
constexpr int kLowestBucket = -128 * kBucketsPerNat;

const std::vector<double> kBucketMass = [] {
  std::vector<double> t(-kLowestBucket + 1);
  for (int b = 0; b <= -kLowestBucket; ++b) t[b] = std::exp(-static_cast<double>(b) / kBucketsPerNat);
  return t;
}();

// The bucket of a bound: 0 for the top, kBucketMass.size() - 1 for 128 nats or more below it.
int bucket_of(double ub, double top) {
  // <= 0 up to rounding; nudged up past that rounding, so that truncation toward zero is a ceiling.
  const double x = (ub - top) * kBucketsPerNat + 1e-9;
  return x >= 0 ? 0 : x <= kLowestBucket ? -kLowestBucket : -static_cast<int>(x);
}

double bucket_mass(double ub, double top) { return kBucketMass[static_cast<std::size_t>(bucket_of(ub, top))]; }

// The buffers of the last walk on this thread, reused by the next.
struct WalkBuffers {
  std::vector<double> ub;
  std::vector<std::pair<double, std::uint32_t>> heap;
  std::vector<std::uint32_t> waiting;
};

// A walk heaps at once only about this many hot lists (those of the highest buckets); the others wait,
// counted, until the walk reaches them. Building a heap of every hot list cost ~0.3 ms at 1M rows when
// attention is spread (~31,000 hot lists, Zen 5), for a walk that stops after eight lists.
constexpr std::size_t kEagerLists = 256;
thread_local WalkBuffers walk_buffers;

}  // namespace

namespace {

// BoundBins' top key for its inline add: NaN (every row through add_outside) beyond 2^30, where the
// double subtraction there might round by more than its nudge.
double fast_top(std::int64_t key) {
  return key > -(std::int64_t{1} << 30) && key < (std::int64_t{1} << 30) ? static_cast<double>(key) : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace

void BoundBins::add_outside(double ub, std::uint64_t rows) {
  constexpr double kLimit = 0x1p60;
  const double scaled = std::ceil(ub * kPerNat);
  if (!(scaled < kLimit)) {  // (too high for a key; +inf never comes here)
    unbounded_ = true;
    return;
  }
  // Far below: the lowest key, whose edge lies above the bound (a looser count, never a smaller one).
  const auto key = static_cast<std::int64_t>(std::max(scaled, -kLimit));
  if (rows_.empty()) {
    rows_.assign(kBins, 0);
    top_key_ = key + kHeadroom;  // room above for the bounds to come, which tend to rise
    top_ = fast_top(top_key_);
  } else if (key > top_key_) {
    raise(key);
  }
  rows_[static_cast<std::size_t>(std::min<std::int64_t>(top_key_ - key, kBins - 1))] += rows;
}

void BoundBins::raise(std::int64_t key) {
  key += kHeadroom;  // (rising bounds re-anchor once per 16 nats, not once per row)
  const auto shift = static_cast<std::uint64_t>(key - top_key_);  // > 0
  if (shift >= kBins - 1) {
    std::uint64_t all = 0;
    for (const std::uint64_t r : rows_) all += r;
    std::fill(rows_.begin(), rows_.end(), 0);
    rows_.back() = all;
  } else {
    const std::size_t keep = kBins - 1 - shift;  // bins that stay above the lowest
    std::uint64_t lowest = 0;
    for (std::size_t b = keep; b < kBins; ++b) lowest += rows_[b];
    std::move_backward(rows_.begin(), rows_.begin() + static_cast<std::ptrdiff_t>(keep), rows_.end() - 1);
    std::fill(rows_.begin(), rows_.begin() + static_cast<std::ptrdiff_t>(shift), 0);
    rows_.back() = lowest;
  }
  top_key_ = key;
  top_ = fast_top(key);
}

void BoundBins::merge(const BoundBins& other) {
  unbounded_ = unbounded_ || other.unbounded_;
  if (other.rows_.empty()) return;
  if (rows_.empty()) {
    rows_ = other.rows_;
    top_key_ = other.top_key_;
    top_ = other.top_;
    return;
  }
  if (other.top_key_ > top_key_) raise(other.top_key_ - kHeadroom);
  // Other's bin b holds bounds with key other.top_key_ - b (its lowest: that or below): here at that key's
  // bin, or in the lowest.
  const std::int64_t offset = top_key_ - other.top_key_;  // >= 0
  for (std::size_t b = 0; b < kBins; ++b)
    if (other.rows_[b] != 0) rows_[static_cast<std::size_t>(std::min<std::int64_t>(offset + static_cast<std::int64_t>(b), kBins - 1))] += other.rows_[b];
}

void BoundBins::clear() noexcept {
  rows_.clear();  // (keeps its memory for the next anchor)
  top_ = std::numeric_limits<double>::quiet_NaN();
  unbounded_ = false;
}

double BoundBins::mass(double shift, double (*mass_below)(double edge, double shift), std::uint64_t* rows) const {
  double sum = 0;
  std::uint64_t held = 0;
  for (std::size_t b = 0; b < rows_.size(); ++b)
    if (rows_[b] != 0) {
      held += rows_[b];
      sum += static_cast<double>(rows_[b]) * mass_below(static_cast<double>(top_key_ - static_cast<std::int64_t>(b)) / kPerNat, shift);
    }
  if (rows != nullptr) *rows = held;
  return unbounded_ ? kInf : sum;
}

void BoundsSummary::add(const double* ub, const std::uint32_t* live, std::size_t first, std::size_t n) {
  double high = top, low = cold_max;
  std::uint64_t counted_rows = 0;
  std::size_t counted = 0;
  std::uint32_t largest = most;
  const bool bin = bin_cold;
  for (std::size_t c = first; c < first + n; ++c) {
    if (live[c] == 0) continue;
    counted_rows += live[c];
    ++counted;
    largest = std::max(largest, live[c]);
    if (!(ub[c] < high - kHotNats)) {
      hot.push_back(static_cast<std::uint32_t>(c));
      if (ub[c] > high && ub[c] < kInf) high = ub[c];
    } else {
      low = std::max(low, ub[c]);
      if (bin) cold_bins.add(ub[c], live[c]);
    }
  }
  top = high;
  cold_max = low;
  rows += counted_rows;
  lists += counted;
  most = largest;
}

void BoundsSummary::merge(const BoundsSummary& other) {
  top = std::max(top, other.top);
  cold_max = std::max(cold_max, other.cold_max);
  rows += other.rows;
  lists += other.lists;
  most = std::max(most, other.most);
  hot.insert(hot.end(), other.hot.begin(), other.hot.end());
  cold_bins.merge(other.cold_bins);
  bin_cold = bin_cold && other.bin_cold;  // (bins that miss some cold lists bound nothing: recount_cold checks)
}

void BoundsSummary::finish(const double* ub, const std::uint32_t* live) {
  const double below = top - kHotNats;
  std::size_t kept = 0;
  hot_rows = 0;
  for (const std::uint32_t c : hot) {
    if (ub[c] < below) {
      cold_max = std::max(cold_max, ub[c]);
      if (bin_cold) cold_bins.add(ub[c], live[c]);
    } else {
      hot[kept++] = c;
      hot_rows += live[c];
    }
  }
  hot.resize(kept);
}

ListWalk::ListWalk(const CertifiedLists& lists, const float* query, float factor, bool mass) {
  ub_buffer_.swap(walk_buffers.ub);
  heap_.swap(walk_buffers.heap);
  waiting_.swap(walk_buffers.waiting);
  BoundsSummary summary;
  summary.bin_cold = mass;
  lists.bounds(query, factor, ub_buffer_, summary);
  ub_ = ub_buffer_.data();
  live_ = lists.live_counts();
  count_ = ub_buffer_.size();
  start(summary);
}

ListWalk::ListWalk(const double* ub, const std::uint32_t* live, std::size_t count, const BoundsSummary* summary)
    : ub_(ub), live_(live), count_(count) {
  ub_buffer_.swap(walk_buffers.ub);
  heap_.swap(walk_buffers.heap);
  waiting_.swap(walk_buffers.waiting);
  if (summary != nullptr) {
    start(*summary);
    return;
  }
  BoundsSummary gathered;
  gathered.add(ub, live, 0, count);
  gathered.finish(ub, live);
  start(gathered);
}

void ListWalk::start(const BoundsSummary& summary) {
  heap_.clear();
  // The shift of the masses: at least every finite ub_c + log live_c (so each term is at most 1), from
  // the largest bound and the largest list, without a log per list.
  rows_left_ = summary.rows;
  most_ = summary.most;
  top_ = summary.top + std::log(static_cast<double>(most_));
  // Only the lists near the top bound go into the heap and the buckets at once; the rest wait cold,
  // unlisted, their mass bounded together (recount_cold), until the walk reaches them (peaked
  // attention never does, and a heap or a bucket count of every list costs as much as the centroid pass).
  counts_.assign(kBucketMass.size(), 0);
  pending_ = false;
  pending_max_ = -kInf;
  if (summary.hot.size() <= kEagerLists) {
    for (const std::uint32_t c : summary.hot) {
      if (std::isinf(ub_[c])) infinite_ = true;
      else counts_[static_cast<std::size_t>(bucket_of(ub_[c], top_))] += live_[c];
      heap_.emplace_back(ub_[c], c);
    }
  } else {
    // Many hot lists: the buckets count them all, the heap takes those of the highest buckets that hold
    // about kEagerLists lists' worth of rows (and any unbounded list); the others wait, unlisted, in
    // waiting_ (every hot list: those bounded below eager_floor_ are the ones not heaped).
    // (Through locals: members written in the loops would be stored and reloaded every list.)
    std::int64_t* counts = counts_.data();
    const double* ub = ub_;
    const std::uint32_t* live = live_;
    const double top = top_;
    bool infinite = false;
    for (const std::uint32_t c : summary.hot) {
      if (std::isinf(ub[c])) infinite = true;
      else counts[bucket_of(ub[c], top)] += live[c];
    }
    infinite_ = infinite;
    const double eager_rows = static_cast<double>(kEagerLists) * static_cast<double>(summary.hot_rows) / static_cast<double>(summary.hot.size());
    std::size_t cut = 0;
    for (double rows = static_cast<double>(counts[0]); rows < eager_rows && cut + 1 < counts_.size();) rows += static_cast<double>(counts[++cut]);
    // A bucket holds a range of bounds: every heaped bound lies above every waiting one.
    double floor = kInf, waiting_max = -kInf;
    for (const std::uint32_t c : summary.hot) {
      if (std::isinf(ub[c]) || static_cast<std::size_t>(bucket_of(ub[c], top)) <= cut) {
        heap_.emplace_back(ub[c], c);
        floor = std::min(floor, ub[c]);
      } else {
        waiting_max = std::max(waiting_max, ub[c]);
      }
    }
    if (waiting_max > -kInf) {
      waiting_.assign(summary.hot.begin(), summary.hot.end());
      eager_floor_ = floor;
      pending_max_ = waiting_max;
      pending_ = true;
    }
  }
  cold_below_ = summary.top - kHotNats;
  cold_lists_ = summary.lists - summary.hot.size();
  cold_rows_ = summary.rows - summary.hot_rows;
  cold_max_ = summary.cold_max;
  cold_bins_ = summary.cold_bins;
  bin_cold_ = summary.bin_cold;
  std::make_heap(heap_.begin(), heap_.end());
  recount_cold();
  rest_ = total_ = recounted();
}

void ListWalk::recount_cold() {
  // Two bounds on the cold lists' mass, the smaller kept: all their rows at the largest of their bounds,
  // and their rows by bound (BoundBins, within 1/8 nat of each list's own: the one that lets a peaked walk
  // stop without warming the bulk of the lists, a few nats below its top).
  // The bins count only if they hold every cold row (not in a walk that asked for none, a top-k search).
  const double at_max = static_cast<double>(cold_rows_) * bucket_mass(cold_max_, top_);
  std::uint64_t binned = 0;
  const double by_bins = cold_rows_ == 0 ? 0.0 : cold_bins_.mass(top_, bucket_mass, &binned);
  cold_term_ = cold_rows_ == 0 ? 0.0 : binned == cold_rows_ ? std::min(at_max, by_bins) : at_max;
}

double ListWalk::recounted() const { return counted() + cold_term_; }

double ListWalk::counted() const {
  double sum = 0;
  for (std::size_t b = 0; b < counts_.size(); ++b)
    if (counts_[b] != 0) sum += static_cast<double>(counts_[b]) * kBucketMass[b];
  return sum;
}

ListWalk::~ListWalk() {
  ub_buffer_.swap(walk_buffers.ub);
  heap_.swap(walk_buffers.heap);
  waiting_.swap(walk_buffers.waiting);
}

void ListWalk::release() {
  if (!pending_) return;
  for (const std::uint32_t c : waiting_)
    if (ub_[c] < eager_floor_) heap_.emplace_back(ub_[c], c);
  pending_ = false;
  pending_max_ = -kInf;
  std::make_heap(heap_.begin(), heap_.end());
}

void ListWalk::warm(double limit) {
  // The cold lists bounded at limit or above join the heap and the buckets; the others stay cold, binned
  // afresh if they were binned. (A pass over every list: the cold ones are not
  // listed, and a walk warms a few times at most, 16 nats at a time.)
  const double* ub = ub_;
  const std::uint32_t* live = live_;
  double next_max = -kInf;
  std::uint64_t rows = 0;
  std::size_t still = 0;
  const bool bin = bin_cold_;
  cold_bins_.clear();
  for (std::size_t c = 0; c < count_; ++c) {
    if (live[c] == 0 || !(ub[c] < cold_below_)) continue;  // no member, or hot or visited already
    if (!(ub[c] < limit)) {
      heap_.emplace_back(ub[c], static_cast<std::uint32_t>(c));
      counts_[static_cast<std::size_t>(bucket_of(ub[c], top_))] += live[c];
    } else {
      ++still;
      rows += live[c];
      next_max = std::max(next_max, ub[c]);
      if (bin) cold_bins_.add(ub[c], live[c]);
    }
  }
  cold_below_ = limit;
  cold_lists_ = still;
  cold_rows_ = rows;
  cold_max_ = next_max;
  std::make_heap(heap_.begin(), heap_.end());
  recount_cold();
  rest_ = total_ = recounted();
}

void ListWalk::recount() {
  // (An infinite bound is never cold: it is above every hot threshold.)
  infinite_ = std::any_of(heap_.begin(), heap_.end(), [](const auto& e) { return std::isinf(e.first); });
  rest_ = total_ = recounted();
}

std::size_t ListWalk::next() {
  if (pending_ && (heap_.empty() || heap_.front().first < pending_max_)) release();
  if (heap_.empty() || heap_.front().first < cold_max_) warm(cold_max_ - kHotNats);
  std::pop_heap(heap_.begin(), heap_.end());
  const auto [ub, c] = heap_.back();
  heap_.pop_back();
  rows_left_ -= live_[c];
  if (std::isinf(ub)) {
    recount();
  } else {
    const auto b = static_cast<std::size_t>(bucket_of(ub, top_));
    counts_[b] -= live_[c];
    rest_ -= static_cast<double>(live_[c]) * kBucketMass[b];
    // The running difference loses digits once it falls far below the total it was counted from:
    // count it afresh from the buckets' exact counts then (O(buckets), not O(lists)).
    if (!(rest_ > 1e-3 * total_)) rest_ = total_ = recounted();
  }
  if (!infinite_ && !done()) {
    const double highest = next_bound();
    if (highest < top_ - kRebaseNats) rebase(highest);
  }
  return c;
}

void ListWalk::rebase(double highest) {
  // As start() shifts: at least every unvisited ub_c + log live_c (with the largest list of all).
  top_ = highest + std::log(static_cast<double>(most_));
  std::fill(counts_.begin(), counts_.end(), 0);
  for (const auto& [ub, c] : heap_) counts_[static_cast<std::size_t>(bucket_of(ub, top_))] += live_[c];
  if (pending_)
    for (const std::uint32_t c : waiting_)
      if (ub_[c] < eager_floor_) counts_[static_cast<std::size_t>(bucket_of(ub_[c], top_))] += live_[c];
  recount_cold();
  rest_ = total_ = recounted();  // (the cold lists' term too, shifted anew)
}

bool ListWalk::can_meet(std::size_t top_k, double epsilon, std::size_t budget_rows, double known_max, double log_visited) {
  // The verdict needs every list's own bound: the cold ones join the heap and the buckets (a walk asks
  // once, after an eighth of its budget: only walks that go deep pay for it).
  release();
  if (cold_lists_ != 0 && !infinite_) warm(-kInf);
  if (infinite_ || heap_.empty()) return true;
  std::vector<std::pair<double, std::uint32_t>> heap = heap_;
  const double kth_most = std::max(known_max, heap.front().first);  // no score, visited or not, exceeds it
  const double visited = log_visited == -kInf ? 0.0 : std::exp(std::min(log_visited - top_, 700.0));
  std::size_t rows = 0;
  double in_reach = 0;
  while (!heap.empty()) {
    const auto [ub, c] = heap.front();
    if (rows > budget_rows) return top_k > 0 ? kth_most > ub : rest_ - in_reach <= epsilon * (visited + rest_) * (1 + 1e-9);
    if (ub < cold_max_) return true;  // the lists in reach go on among the cold ones: no verdict
    std::pop_heap(heap.begin(), heap.end());
    heap.pop_back();
    rows += live_[c];
    in_reach += static_cast<double>(live_[c]) * bucket_mass(ub, top_);
  }
  return true;  // every list is within reach
}

void ListWalk::unvisited(std::vector<std::pair<double, std::uint32_t>>& out) const {
  for (const auto& entry : heap_) out.push_back(entry);
  if (pending_)
    for (const std::uint32_t c : waiting_)
      if (ub_[c] < eager_floor_) out.emplace_back(ub_[c], c);
  if (cold_lists_ == 0) return;
  for (std::size_t c = 0; c < count_; ++c)
    if (live_[c] != 0 && ub_[c] < cold_below_) out.emplace_back(ub_[c], static_cast<std::uint32_t>(c));
}

double ListWalk::next_bound() const noexcept {
  return std::max({heap_.empty() ? -kInf : heap_.front().first, pending_max_, cold_max_});
}

double ListWalk::log_rest() {
  if (done()) return -kInf;
  if (infinite_) return kInf;
  // The running sum's own rounding: each term and each subtraction errs by at most 2^-53 of the total it
  // was counted from, over at most the buckets plus two per list.
  const double error = 4 * static_cast<double>(counts_.size() + BoundBins::kBins + count_ + 1) * 0x1p-53 * total_;
  return rest_ + error > 0 ? top_ + std::log(rest_ + error) : -kInf;
}

}  // namespace softkv::detail
