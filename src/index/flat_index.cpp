// The flat index: FAISS's exact inner-product top-k run directly over the collection's key storage.
#include <faiss/utils/distances.h>

#include <algorithm>

#include "index/pruning_index.hpp"

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

  [[nodiscard]] std::vector<std::uint64_t> search(const float* query, const RowSpan& all,
                                                  const IndexSearch& p) const override {
    const std::size_t k = std::min(p.k, all.rows);
    std::vector<float> scores(k);
    std::vector<std::int64_t> rows(k);
    OmpThreads one(1);  // one query, one thread: the scan pool owns the other cores
    faiss::knn_inner_product(query, all.keys, all.dim, 1, all.rows, k, scores.data(), rows.data());
    std::vector<std::uint64_t> ids;
    ids.reserve(k);
    for (std::int64_t r : rows)
      if (r >= 0) ids.push_back(all.ids[r]);
    return ids;
  }
};

}  // namespace

std::unique_ptr<PruningIndex> make_flat_index() { return std::make_unique<FlatIndex>(); }

}  // namespace softkv::detail
