// The flat index: softkv's own fused score + top-k pass over the collection's key storage.
#include <algorithm>

#include "index/pruning_index.hpp"
#include "scan.hpp"

namespace softkv::detail {
namespace {

// Stateless: it searches the live storage, so writes need no bookkeeping and never disagree with it.
// It ranks with the active kernel's own scores (ties to the smaller id), bit-identical to the
// scores the softmax over the candidates and the exact scan use: no omitted key can score above
// the k-th candidate, so the tail bound holds by construction, not by agreement with FAISS's rounding.
class FlatIndex final : public PruningIndex {
 public:
  [[nodiscard]] IndexKind kind() const override { return IndexKind::flat; }
  [[nodiscard]] bool ready() const override { return true; }
  [[nodiscard]] bool exact_top_k() const override { return true; }
  void put(std::span<const std::uint64_t>, const float*, const RowSpan&) override {}
  void erase(std::uint64_t, const RowSpan&) override {}

  // One fused pass per query (each spread over p.parts row slices): a pass is memory-bound, and
  // the scores must be the single-query kernel's, bit for bit, for the bound to hold by construction.
  [[nodiscard]] std::vector<std::vector<std::uint64_t>> search(const float* queries, const float* scales, std::size_t n,
                                                               const RowSpan& all, const IndexSearch& p) const override {
    std::vector<std::vector<std::uint64_t>> ids(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::vector<TopScores::Item> top = top_k_scan(kernels(), queries + i * all.dim, scales[i], all, p.k, p.parts);
      ids[i].resize(top.size());
      std::transform(top.begin(), top.end(), ids[i].begin(), [](const TopScores::Item& item) { return item.id; });
    }
    return ids;
  }
};

}  // namespace

std::unique_ptr<PruningIndex> make_flat_index() { return std::make_unique<FlatIndex>(); }

}  // namespace softkv::detail
