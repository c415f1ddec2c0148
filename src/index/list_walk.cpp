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
  std::vector<std::uint32_t> live, cold;
  std::vector<std::pair<double, std::uint32_t>> heap;
};
thread_local WalkBuffers walk_buffers;

}  // namespace

ListWalk::ListWalk(const CertifiedLists& lists, const float* query, float factor) {
  ub_.swap(walk_buffers.ub);
  live_.swap(walk_buffers.live);
  cold_.swap(walk_buffers.cold);
  heap_.swap(walk_buffers.heap);
  lists.bounds(query, factor, ub_, live_);
  start();
}

ListWalk::ListWalk(const double* ub, const std::uint32_t* live, std::size_t count) {
  ub_.swap(walk_buffers.ub);
  live_.swap(walk_buffers.live);
  cold_.swap(walk_buffers.cold);
  heap_.swap(walk_buffers.heap);
  ub_.assign(ub, ub + count);
  live_.assign(live, live + count);
  start();
}

void ListWalk::start() {
  heap_.clear();
  // The shift of the masses: at least every finite ub_c + log live_c (so each term is at most 1), from
  // the largest bound and the largest list, without a log per list. Both passes over the lists are
  // branch-free where they run over every list, with four running maxima: one maximum is a chain of
  // dependent instructions as long as the lists are many. (A list without live members has ub -inf,
  // CertifiedLists::bounds.)
  const std::size_t count = ub_.size();
  const double* ub = ub_.data();
  const std::uint32_t* live = live_.data();
  // (Four lists a step, each lane its own maximum in a register.)
  double t0 = -kInf, t1 = -kInf, t2 = -kInf, t3 = -kInf;
  std::uint32_t m0 = 1, m1 = 1, m2 = 1, m3 = 1;
  std::uint64_t rows = 0;
  const auto finite = [](double b) { return b < kInf ? b : -kInf; };
  std::size_t c = 0;
  for (; c + 4 <= count; c += 4) {
    rows += std::uint64_t{live[c]} + live[c + 1] + live[c + 2] + live[c + 3];
    m0 = std::max(m0, live[c]), m1 = std::max(m1, live[c + 1]), m2 = std::max(m2, live[c + 2]), m3 = std::max(m3, live[c + 3]);
    t0 = std::max(t0, finite(ub[c])), t1 = std::max(t1, finite(ub[c + 1])), t2 = std::max(t2, finite(ub[c + 2])),
    t3 = std::max(t3, finite(ub[c + 3]));
  }
  for (; c < count; ++c) rows += live[c], m0 = std::max(m0, live[c]), t0 = std::max(t0, finite(ub[c]));
  const double top_ub = std::max(std::max(t0, t1), std::max(t2, t3));
  rows_left_ = rows;
  most_ = std::max(std::max(m0, m1), std::max(m2, m3));
  top_ = top_ub + std::log(static_cast<double>(most_));
  // Only the lists near the top bound go into the heap and the buckets at once; the rest wait, unordered
  // and counted together at the largest of their bounds, until the walk reaches it (peaked attention
  // never does, and a heap or a bucket count of every list costs as much as the centroid pass).
  const double hot = top_ub - kHotNats;
  counts_.assign(kBucketMass.size(), 0);
  cold_.resize(count);
  std::uint32_t* cold = cold_.data();
  std::size_t n_cold = 0;
  std::uint64_t hot_rows = 0;
  // The cold lists' largest bound (four lanes, branch-free), then the lists split (the hot ones rare).
  double c0 = -kInf, c1 = -kInf, c2 = -kInf, c3 = -kInf;
  const auto below = [hot](double b) { return b < hot ? b : -kInf; };
  c = 0;
  for (; c + 4 <= count; c += 4)
    c0 = std::max(c0, below(ub[c])), c1 = std::max(c1, below(ub[c + 1])), c2 = std::max(c2, below(ub[c + 2])),
    c3 = std::max(c3, below(ub[c + 3]));
  for (; c < count; ++c) c0 = std::max(c0, below(ub[c]));
  for (c = 0; c < count; ++c) {
    const bool is_cold = ub[c] < hot;
    cold[n_cold] = static_cast<std::uint32_t>(c);
    n_cold += static_cast<std::size_t>(is_cold && live[c] != 0);
    if (!is_cold && live[c] != 0) {
      hot_rows += live[c];
      if (std::isinf(ub[c])) infinite_ = true;
      else counts_[static_cast<std::size_t>(bucket_of(ub[c], top_))] += live[c];
      heap_.emplace_back(ub[c], static_cast<std::uint32_t>(c));
    }
  }
  cold_.resize(n_cold);
  cold_rows_ = rows - hot_rows;
  cold_max_ = std::max(std::max(c0, c1), std::max(c2, c3));
  std::make_heap(heap_.begin(), heap_.end());
  rest_ = total_ = recounted();
}

double ListWalk::cold_term() const {
  return cold_rows_ == 0 ? 0.0 : static_cast<double>(cold_rows_) * bucket_mass(cold_max_, top_);
}

double ListWalk::recounted() const { return counted() + cold_term(); }

double ListWalk::counted() const {
  double sum = 0;
  for (std::size_t b = 0; b < counts_.size(); ++b)
    if (counts_[b] != 0) sum += static_cast<double>(counts_[b]) * kBucketMass[b];
  return sum;
}

ListWalk::~ListWalk() {
  ub_.swap(walk_buffers.ub);
  live_.swap(walk_buffers.live);
  cold_.swap(walk_buffers.cold);
  heap_.swap(walk_buffers.heap);
}

void ListWalk::warm(double limit) {
  // The cold lists bounded at limit or above join the heap and the buckets; the others stay cold,
  // counted together at the largest of their bounds.
  const double* ub = ub_.data();
  const std::uint32_t* live = live_.data();
  std::uint32_t* cold = cold_.data();
  std::size_t kept = 0;
  double next_max = -kInf;
  std::uint64_t rows = 0;
  for (std::size_t i = 0, n = cold_.size(); i < n; ++i) {
    const std::uint32_t c = cold[i];
    if (!(ub[c] < limit)) {
      heap_.emplace_back(ub[c], c);
      counts_[static_cast<std::size_t>(bucket_of(ub[c], top_))] += live[c];
    } else {
      cold[kept++] = c;
      rows += live[c];
      next_max = std::max(next_max, ub[c]);
    }
  }
  cold_.resize(kept);
  cold_rows_ = rows;
  cold_max_ = next_max;
  std::make_heap(heap_.begin(), heap_.end());
  rest_ = total_ = recounted();
}

void ListWalk::recount() {
  // (An infinite bound is never cold: it is above every hot threshold.)
  infinite_ = std::any_of(heap_.begin(), heap_.end(), [](const auto& e) { return std::isinf(e.first); });
  rest_ = total_ = recounted();
}

std::size_t ListWalk::next() {
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
  rest_ = total_ = recounted();  // (the cold lists: their count at their largest bound, shifted anew)
}

bool ListWalk::can_meet(std::size_t top_k, double epsilon, std::size_t budget_rows, double known_max, double log_visited) {
  // The verdict needs every list's own bound: the cold ones join the heap and the buckets (a walk asks
  // once, after an eighth of its budget: only walks that go deep pay for it).
  if (!cold_.empty() && !infinite_) warm(-kInf);
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
  for (const std::uint32_t c : cold_) out.emplace_back(ub_[c], c);
}

double ListWalk::next_bound() const noexcept { return std::max(heap_.empty() ? -kInf : heap_.front().first, cold_max_); }

double ListWalk::log_rest() {
  if (done()) return -kInf;
  if (infinite_) return kInf;
  // The running sum's own rounding: each term and each subtraction errs by at most 2^-53 of the total it
  // was counted from, over at most the buckets plus two per list.
  const double error = 4 * static_cast<double>(counts_.size() + ub_.size() + 1) * 0x1p-53 * total_;
  return rest_ + error > 0 ? top_ + std::log(rest_ + error) : -kInf;
}

}  // namespace softkv::detail
