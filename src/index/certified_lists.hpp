// Certified inverted lists (softkv's IVF): lists of keys with an upper bound on q.k for every member,
// so a query stops visiting lists with a proof (docs/PRUNING.md, "Certified inverted lists").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "index/pruning_index.hpp"

namespace softkv::detail {

/// Lists whose bound lies more than this below the largest one wait cold in a walk (ListWalk): outside
/// its heap, their mass bounded together (at the largest of their bounds, or by their BoundBins) until
/// the walk comes near them.
inline constexpr double kHotNats = 16;

/// Live rows of lists by their upper bound, in bins of 1/8 nat anchored at absolute bounds (no largest
/// bound needed while they are gathered): a list bounded by ub counts in the bin of ceil(8 ub), whose
/// upper edge then bounds its rows' scores. Bins more than 128 nats below the highest one merge into the
/// lowest (counted at its edge: looser, never below a bound). A walk bounds its cold lists' mass with them
/// far more tightly than by their largest bound alone.
class BoundBins {
 public:
  /// Bins per nat, and how many (the lowest takes everything below).
  static constexpr int kPerNat = 8;
  static constexpr std::size_t kBins = 128 * kPerNat + 1;
  BoundBins() = default;
  BoundBins(const BoundBins&) = default;
  BoundBins& operator=(const BoundBins&) = default;
  /// Moves leave the source empty (and unanchored: its inline add must not see bins it no longer has).
  BoundBins(BoundBins&& other) noexcept { *this = std::move(other); }
  BoundBins& operator=(BoundBins&& other) noexcept {
    rows_ = std::move(other.rows_);
    top_key_ = other.top_key_;
    top_ = other.top_;
    unbounded_ = other.unbounded_;
    other.rows_.clear();
    other.top_ = std::numeric_limits<double>::quiet_NaN();
    other.unbounded_ = false;
    return *this;
  }
  ~BoundBins() = default;
  /// Counts rows under the finite bound ub (inline: a bounds pass bins every cold list).
  void add(double ub, std::uint64_t rows) {
    // Bin top_key_ - ceil(8 ub) = floor(top_key_ - 8 ub): a truncation when in range (top_ is NaN before
    // the first row and for keys beyond 2^30). The nudge outweighs the subtraction's rounding (at most 2^-22
    // below 2^31): a bound on a bin's edge may count a bin higher, never lower.
    const double at = top_ - ub * kPerNat - 0x1p-20;
    if (at >= 0 && at < static_cast<double>(kBins - 1)) rows_[static_cast<std::size_t>(at)] += rows;
    else add_outside(ub, rows);
  }
  /// Takes in another's rows (anchored anywhere).
  void merge(const BoundBins& other);
  /// Forgets every row and the anchor (the next row anchors the bins afresh).
  void clear() noexcept;
  /// sum over the rows of e^{edge - shift} (edge: their bin's upper edge) rounded up through mass_below:
  /// a bound on the rows' mass relative to e^shift; +inf when a bound fell outside what bins can hold.
  /// rows (if given): how many rows the bins hold (not counting those of such a bound).
  [[nodiscard]] double mass(double shift, double (*mass_below)(double edge, double shift), std::uint64_t* rows = nullptr) const;

 private:
  void add_outside(double ub, std::uint64_t rows);  // the first row, a bound above the bins, or below them
  static constexpr std::int64_t kHeadroom = 16 * kPerNat;  // bins kept above a new anchor's row
  void raise(std::int64_t key);  // re-anchors so that the bin of key lies kHeadroom bins below the highest
  std::vector<std::uint64_t> rows_;  // rows_[b]: the bin of ceil(8 ub) = top_key_ - b (the last: that or below)
  std::int64_t top_key_ = 0;
  double top_ = std::numeric_limits<double>::quiet_NaN();  // top_key_ as a double (NaN until the first row)
  bool unbounded_ = false;  // a bound beyond +-2^60 / 8 nats was added: mass() is +inf
};

/// What a walk starts from, gathered while a query's bounds are computed (CertifiedLists::bounds): the
/// largest finite bound, the lists within kHotNats of it, and what the others weigh together. Lists are
/// added in any order (add), parts of them gathered apart are merged (merge), and finish() settles
/// which candidates stay hot. Only lists with live members count.
struct BoundsSummary {
  double top = -std::numeric_limits<double>::infinity();       ///< the largest finite bound
  double cold_max = -std::numeric_limits<double>::infinity();  ///< the largest bound of a list not in hot
  std::uint64_t rows = 0;                                      ///< live rows of all lists
  std::uint64_t hot_rows = 0;                                  ///< live rows of the hot lists (after finish)
  std::size_t lists = 0;                                       ///< lists with live members
  std::uint32_t most = 1;                                      ///< the largest list's live rows (at least 1)
  std::vector<std::uint32_t> hot;  ///< after finish: every list bounded within kHotNats of top, or not finitely
  BoundBins cold_bins;             ///< after finish: the rows of the lists not in hot, by bound (if bin_cold)
  bool bin_cold = true;  ///< set before the lists are added: whether cold_bins is gathered (a top-k search needs no mass)

  /// Counts lists [first, first + n) (bounds ub[c], live members live[c]). A list bounded within kHotNats
  /// of the largest bound seen so far is a candidate for hot; finish() drops those the final top leaves
  /// behind. (The running sums are locals, in registers: not this summary's members, which the hot
  /// list's growth could touch.)
  void add(const double* ub, const std::uint32_t* live, std::size_t first, std::size_t n);
  /// Takes in the lists another summary counted (none counted twice).
  void merge(const BoundsSummary& other);
  /// Keeps in hot the candidates within kHotNats of top (or bounded by +inf) and counts their rows; the
  /// others go to cold_max. ub and live: every list's bound and live members.
  void finish(const double* ub, const std::uint32_t* live);
};

/// What a query needs from certified lists beyond PruningIndex. Read under the collection's shared lock.
class CertifiedLists {
 public:
  virtual ~CertifiedLists() = default;
  /// Number of lists (some may have no live member).
  [[nodiscard]] virtual std::size_t list_count() const = 0;
  /// For a query split by split_scale into (query, factor): ub[c] >= the kernel's score of every live
  /// member of list c, float rounding included (+inf when the bound is not finite; -inf when live_counts()[c]
  /// is 0), and in summary (finished) what a walk starts from, gathered on the way (its cold bins only if
  /// summary.bin_cold was set on entry).
  virtual void bounds(const float* query, float factor, std::vector<double>& ub, BoundsSummary& summary) const = 0;
  /// Every list's live member count (list_count() of them), valid while the collection's lock is held.
  [[nodiscard]] virtual const std::uint32_t* live_counts() const = 0;
  /// bounds() for n queries (row-major, split as bounds() takes one, factors[i] each): ub gets n x
  /// list_count() bounds, query i's from ub[i * list_count()], and summaries[i] query i's as bounds()
  /// gives it (the live counts: live_counts()). Reads the centroids once for all the queries (a batch's
  /// walks share that pass). This default calls bounds().
  virtual void bounds_batch(const float* queries, const float* factors, std::size_t n, std::size_t dim, std::vector<double>& ub,
                            std::vector<BoundsSummary>& summaries) const;
  /// Appends the ids and kernel scores (KernelTable::scores) of list c's live members, and returns a bound
  /// on |kernel score - true score| of each of them, less u |score| (u = 2^-24) which the caller adds per row.
  virtual double score_list(std::size_t c, const float* query, float factor, std::vector<std::uint64_t>& ids,
                            std::vector<float>& scores) const = 0;
};

/// Where a walk gets the scores of a list for its query: CertifiedLists::score_list, or a batch's shared
/// reads (SharedListScores: a list read once and scored for every query of the batch likely to visit it).
class ListScorer {
 public:
  virtual ~ListScorer() = default;
  /// CertifiedLists::score_list(c, ...) for the walk's query: the same ids, scores and returned error.
  virtual double score_list(std::size_t c, std::vector<std::uint64_t>& ids, std::vector<float>& scores) = 0;
};

/// The lists of a certified index in decreasing upper bound, with a bound on the mass of those not yet
/// visited: sum over them of live_c e^{ub_c}, each term rounded up to 1/8 nat (at most 13% above it; a
/// cold list's term through its bin up to 1/4 nat, 28%).
class ListWalk {
 public:
  /// Computes every list's bound for the query (O(lists x d)) and starts from what that pass gathered.
  /// mass: false when the walk needs no tight log_rest() (a top-k search, which asks next_bound() only):
  /// the cold lists are not binned, and their mass is bounded at their largest bound.
  ListWalk(const CertifiedLists& lists, const float* query, float factor, bool mass = true);
  /// A walk over bounds computed beforehand (count lists: ub as CertifiedLists::bounds gives them, and
  /// live), read in place: both must outlive the walk. summary: what the bounds' pass gathered for them
  /// (CertifiedLists::bounds_batch), or null to gather it here (one pass over the lists).
  ListWalk(const double* ub, const std::uint32_t* live, std::size_t count, const BoundsSummary* summary = nullptr);
  /// Hands its buffers back to the thread for the next walk (a walk per query: fresh buffers of a few
  /// hundred KiB each would be page-faulted in every time).
  ~ListWalk();
  ListWalk(const ListWalk&) = delete;
  ListWalk& operator=(const ListWalk&) = delete;
  /// Whether every list with a live member was visited.
  [[nodiscard]] bool done() const noexcept { return heap_.empty() && !pending_ && cold_lists_ == 0; }
  /// The list with the largest bound among the unvisited ones; marks it visited. Requires !done().
  std::size_t next();
  /// The largest bound among the unvisited lists (-inf when done).
  [[nodiscard]] double next_bound() const noexcept;
  /// log of sum over the unvisited lists of live_c e^{ub_c} (-inf when done; +inf when a bound is not finite).
  [[nodiscard]] double log_rest();
  /// False when no walk of at most budget_rows more rows can meet the target, judged from the bounds
  /// alone (no row is scored): top_k > 0, the k-th score beating the bound of the first list out of
  /// reach (the k-th score is at most known_max, the best score visited, or the largest unvisited
  /// bound); else a tail bound <= epsilon (the unvisited mass out of reach must be at most epsilon of
  /// the visited mass, log_visited, plus all unvisited mass). Only lets a walk give up early where the
  /// exact scan must answer anyway: a false verdict never changes an answer, only its cost.
  /// Moves every cold list into the heap and the buckets first (O(lists)).
  [[nodiscard]] bool can_meet(std::size_t top_k, double epsilon, std::size_t budget_rows, double known_max,
                              double log_visited);
  /// Live rows in the lists not yet visited.
  [[nodiscard]] std::size_t rows_left() const noexcept { return rows_left_; }
  /// Appends (bound, list) for every list not yet visited that has a live member.
  void unvisited(std::vector<std::pair<double, std::uint32_t>>& out) const;
  /// List c's live members.
  [[nodiscard]] std::uint32_t live(std::size_t c) const noexcept { return live_[c]; }

 private:
  void start(const BoundsSummary& summary);  // the heap, the buckets and the sum from the hot lists; the rest cold
  void recount();                  // after a list with an infinite bound: the flag, and the sum afresh
  [[nodiscard]] double counted() const;  // the unvisited mass from the bucket counts
  void warm(double limit);  // moves the cold lists bounded at limit or above into the heap and the buckets
  void rebase(double highest);  // the shift moved down to the highest unvisited bound, the buckets afresh
  void recount_cold();  // cold_term_ afresh (after the shift or the cold lists changed)
  void release();       // moves the pending hot lists into the heap
  [[nodiscard]] double recounted() const;  // counted() plus cold_term_: the unvisited mass afresh

  /// Once every unvisited bound lies this far below the shift, the buckets are counted afresh from the
  /// highest of them: the lowest bucket holds everything 128 nats below the shift at e^-128, a floor that
  /// would otherwise outweigh a query whose best score lies far below the first lists' bounds (a wide
  /// list ranked first), and epsilon could never be met.
  static constexpr double kRebaseNats = 32;

  std::vector<double> ub_buffer_;  // the bounds when the walk computed them
  std::vector<std::pair<double, std::uint32_t>> heap_;  // max-heap of (ub, list) over unvisited hot lists
  // When the hot lists are many (spread attention), those bounded below eager_floor_ are pending: counted
  // in the buckets but heaped only once the walk reaches them (most walks stop within a few lists).
  std::vector<std::uint32_t> waiting_;  // every hot list at the start (when pending_)
  double eager_floor_ = 0;              // the lowest bound heaped at the start
  bool pending_ = false;                // whether lists below eager_floor_ wait to be heaped
  double pending_max_ = -std::numeric_limits<double>::infinity();  // their largest bound (-inf: none)
  const double* ub_ = nullptr;                          // every list's bound
  const std::uint32_t* live_ = nullptr;                 // every list's live members
  std::size_t count_ = 0;                               // lists
  // The cold lists are not listed: they are the lists with live members bounded below cold_below_ (the
  // walk's thresholds only go down, so every list at or above it is in the heap or visited).
  double cold_below_ = -std::numeric_limits<double>::infinity();
  std::size_t cold_lists_ = 0;                          // how many
  std::vector<std::int64_t> counts_;                    // unvisited hot live rows per 1/8-nat bucket below top_
  std::uint64_t cold_rows_ = 0;                         // live rows of the cold lists
  std::uint32_t most_ = 1;                              // the largest list's live rows
  double cold_max_ = -std::numeric_limits<double>::infinity();  // their largest bound
  BoundBins cold_bins_;                                 // their rows by bound (if bin_cold_)
  bool bin_cold_ = true;                                // whether warm() bins the lists it leaves cold
  double cold_term_ = 0;  // their mass bound relative to e^top_: the smaller of (rows at cold_max_) and cold_bins_
  double top_ = 0;      // the shift of rest_: the largest finite bound plus the log of the largest list
  double rest_ = 0;     // sum over unvisited of live_c e^{ub_c - top_}
  double total_ = 0;    // rest_ when last counted afresh (start, recount, rebase): the scale of its rounding (log_rest)
  bool infinite_ = false;  // some unvisited bound is +inf
  std::size_t rows_left_ = 0;
};

/// The certified-list index for a configuration with IndexKind::ivf or automatic.
std::unique_ptr<PruningIndex> make_certified_index(const CollectionConfig& config);

}  // namespace softkv::detail
