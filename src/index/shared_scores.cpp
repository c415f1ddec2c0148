// A batch's shared list reads (shared_scores.hpp).
#include "index/shared_scores.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace softkv::detail {

SharedListScores::SharedListScores(const CertifiedLists& lists, const float* queries, const float* factors, std::size_t n,
                                   std::size_t dim, const double* bounds, const BoundsSummary* summaries)
    : lists_(lists), queries_(queries), factors_(factors), n_(n), dim_(dim), count_(lists.list_count()), bounds_(bounds),
      top_(n), similar_(n * n, 0), scorers_(n), held_for_(n) {
  for (std::size_t i = 0; i < n; ++i) {
    scorers_[i].owner = this;
    scorers_[i].query = i;
    top_[i] = summaries[i].top;  // (the largest finite bound of a live list, gathered in the bounds' pass)
  }
  // Cosines in double (the split queries differ from the given ones by a positive factor only).
  std::vector<double> norm(n, 0.0);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t k = 0; k < dim; ++k) norm[i] += static_cast<double>(queries[i * dim + k]) * queries[i * dim + k];
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j) {
      double dot = 0;
      for (std::size_t k = 0; k < dim; ++k) dot += static_cast<double>(queries[i * dim + k]) * queries[j * dim + k];
      const bool near = norm[i] > 0 && norm[j] > 0 && dot >= kShareCosine * std::sqrt(norm[i] * norm[j]);
      similar_[i * n + j] = similar_[j * n + i] = near ? 1 : 0;
    }
}

double SharedListScores::score(std::size_t i, std::size_t c, std::vector<std::uint64_t>& ids, std::vector<float>& scores) {
  // The earlier queries are done: what was scored for them and not taken frees its room.
  for (; current_ < i; ++current_) {
    for (const std::uint64_t key : held_for_[current_])
      if (const auto it = cache_.find(key); it != cache_.end()) {
        held_ -= it->second.scores.size();
        cache_.erase(it);
      }
    held_for_[current_].clear();
  }
  const std::uint64_t key = static_cast<std::uint64_t>(c) * n_ + i;
  if (const auto it = cache_.find(key); it != cache_.end()) {
    Held& h = it->second;
    ids.insert(ids.end(), h.ids.begin(), h.ids.end());
    scores.insert(scores.end(), h.scores.begin(), h.scores.end());
    const double error = h.error;
    held_ -= h.scores.size();
    cache_.erase(it);
    ++shared_;
    return error;
  }
  const double error = lists_.score_list(c, queries_ + i * dim_, factors_[i], ids, scores);
  ++own_;
  // The later queries likely to visit c, scored while its keys are in cache.
  const double depth = bounds_[i * count_ + c] - top_[i];
  if (!std::isfinite(depth)) return error;
  try {  // (scoring ahead is an optimisation: a failure there, out of memory, is not query i's)
    for (std::size_t j = i + 1; j < n_ && held_ < kMaxHeldScores; ++j) {
      if (similar_[i * n_ + j] == 0) continue;
      const double ub = bounds_[j * count_ + c];
      const std::uint64_t later = static_cast<std::uint64_t>(c) * n_ + j;
      if (!(ub - top_[j] >= depth - kShareNats) || cache_.contains(later)) continue;
      Held h;
      h.error = lists_.score_list(c, queries_ + j * dim_, factors_[j], h.ids, h.scores);
      held_ += h.scores.size();
      cache_.emplace(later, std::move(h));
      held_for_[j].push_back(later);
    }
  } catch (...) {
  }
  return error;
}

}  // namespace softkv::detail
