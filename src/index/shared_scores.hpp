// A batch's shared list reads (docs/PRUNING.md, "Batches"): the queries of a batch walk certified lists
// one after another, and a list read for one of them is scored at once, while its keys are in cache, for
// every later query of the batch likely to visit it; those queries find its scores waiting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "index/certified_lists.hpp"

namespace softkv::detail {

/// Scores lists for the n queries of a batch group, each list read from memory once for the queries that
/// share it. The queries are walked in order (for_query(0), then 1, ...): when query i scores list c, every
/// later query j gets c's scores too when it resembles i (cosine >= kShareCosine) and c's bound for j is
/// at most kShareNats further below j's largest bound than it is below i's (j is likely to reach c as
/// deep in its own walk). A guess only decides what is scored in advance: every score handed out is the
/// one CertifiedLists::score_list gives that query, so answers are those of the queries alone.
class SharedListScores {
 public:
  /// Queries row-major (dim floats each, split as bounds() takes them), factors[i], and their bounds and
  /// summaries as CertifiedLists::bounds_batch gives them (n x list_count() bounds, n summaries: their top
  /// bounds are read here). queries, factors and bounds must outlive this object.
  SharedListScores(const CertifiedLists& lists, const float* queries, const float* factors, std::size_t n, std::size_t dim,
                   const double* bounds, const BoundsSummary* summaries);
  SharedListScores(const SharedListScores&) = delete;
  SharedListScores& operator=(const SharedListScores&) = delete;

  /// The scorer for query i's walk (valid while this object lives; queries taken in increasing i).
  [[nodiscard]] ListScorer& for_query(std::size_t i) { return scorers_[i]; }
  /// Lists a query asked for and read itself (no earlier query had scored them for it).
  [[nodiscard]] std::size_t own_reads() const noexcept { return own_; }
  /// Lists a query found scored by an earlier query's read.
  [[nodiscard]] std::size_t shared_reads() const noexcept { return shared_; }

  /// Queries at least this similar (cosine) share reads.
  static constexpr double kShareCosine = 0.5;
  /// How much deeper below its top bound a list may lie for a later query than for the reader.
  static constexpr double kShareNats = 1.0;
  /// Most scores held for later queries at once (4 MiB of floats and 8 MiB of ids): past it, nothing is
  /// scored in advance until the queries take theirs or finish (a query's leftovers are dropped when a
  /// later one starts).
  static constexpr std::size_t kMaxHeldScores = std::size_t{1} << 20;

 private:
  struct Held {
    std::vector<std::uint64_t> ids;
    std::vector<float> scores;
    double error = 0;
  };
  class Scorer final : public ListScorer {
   public:
    SharedListScores* owner = nullptr;
    std::size_t query = 0;
    double score_list(std::size_t c, std::vector<std::uint64_t>& ids, std::vector<float>& scores) override {
      return owner->score(query, c, ids, scores);
    }
  };
  double score(std::size_t i, std::size_t c, std::vector<std::uint64_t>& ids, std::vector<float>& scores);

  const CertifiedLists& lists_;
  const float* queries_;
  const float* factors_;
  std::size_t n_, dim_, count_;
  const double* bounds_;
  std::vector<double> top_;                 // each query's largest finite bound (-inf: none)
  std::vector<std::uint8_t> similar_;       // n x n: cosine >= kShareCosine
  std::vector<Scorer> scorers_;
  std::unordered_map<std::uint64_t, Held> cache_;  // (list, query) -> scores held for it
  std::vector<std::vector<std::uint64_t>> held_for_;  // each query's keys in cache_ (dropped once it is done)
  std::size_t held_ = 0, own_ = 0, shared_ = 0;
  std::size_t current_ = 0;  // the query walking now: the earlier ones' leftovers are dropped
};

}  // namespace softkv::detail
