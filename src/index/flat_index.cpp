// The flat index: FAISS's exact inner-product top-k run directly over the collection's key storage.
#include <faiss/utils/distances.h>

#include <algorithm>
#include <limits>

#include "index/pruning_index.hpp"
#include "thread_pool.hpp"

namespace softkv::detail {
namespace {

// Stateless: it searches the live storage, so writes need no bookkeeping and never disagree with it.
class FlatIndex final : public PruningIndex {
 public:
  [[nodiscard]] IndexKind kind() const override { return IndexKind::flat; }
  [[nodiscard]] bool ready() const override { return true; }
  [[nodiscard]] bool exact_top_k() const override { return true; }
  void put(std::span<const std::uint64_t>, const float*, const RowSpan&) override {}
  void erase(std::uint64_t, const RowSpan&) override {}

  // The rows are cut into p.parts slices searched on the scan pool (each FAISS call on one OpenMP
  // thread); the true top k is among the slices' top k, so merging them keeps the search exact.
  [[nodiscard]] std::vector<std::uint64_t> search(const float* query, const RowSpan& all,
                                                  const IndexSearch& p) const override {
    const std::size_t k = std::min(p.k, all.rows);
    const std::size_t parts = std::clamp<std::size_t>(p.parts, 1, all.rows);
    std::vector<float> scores(parts * k, -std::numeric_limits<float>::infinity());
    std::vector<std::int64_t> rows(parts * k, -1);
    ThreadPool::shared().run(parts, [&](std::size_t part) {
      const std::size_t begin = all.rows * part / parts, end = all.rows * (part + 1) / parts;
      const std::size_t kp = std::min(k, end - begin);
      OmpThreads one(1);
      faiss::knn_inner_product(query, all.keys + begin * all.dim, all.dim, 1, end - begin, kp, &scores[part * k], &rows[part * k]);
      for (std::size_t j = 0; j < kp; ++j)
        if (rows[part * k + j] >= 0) rows[part * k + j] += static_cast<std::int64_t>(begin);
    });
    std::vector<std::size_t> order(parts * k);
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                      [&](std::size_t a, std::size_t b) { return scores[a] > scores[b]; });
    std::vector<std::uint64_t> ids;
    ids.reserve(k);
    for (std::size_t i = 0; i < k; ++i)
      if (rows[order[i]] >= 0) ids.push_back(all.ids[rows[order[i]]]);
    return ids;
  }
};

}  // namespace

std::unique_ptr<PruningIndex> make_flat_index() { return std::make_unique<FlatIndex>(); }

}  // namespace softkv::detail
