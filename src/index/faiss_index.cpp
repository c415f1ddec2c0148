// HNSW and IVF pruning indexes over FAISS, kept in step with writes through tombstones and rebuilds.
//
// FAISS numbers vectors by insertion position (labels 0, 1, ...). HNSW in FAISS 1.7.3 cannot remove,
// so every index here is append-only: a removed or replaced entry's position is marked dead and
// filtered out of results, and once dead positions pass rebuild_fraction of the live ones the index is
// rebuilt from the collection's storage.
#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "index/pruning_index.hpp"
#include "storage/bytes.hpp"

namespace softkv::detail {

std::unique_ptr<PruningIndex> make_flat_index();

namespace {

using Label = faiss::Index::idx_t;

int build_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

class PositionalIndex final : public PruningIndex {
 public:
  explicit PositionalIndex(const CollectionConfig& config) : config_(config) {}

  [[nodiscard]] IndexKind kind() const override {
    if (!ready()) return IndexKind::exact;
    return config_.index.kind == IndexKind::automatic ? IndexKind::ivf : config_.index.kind;
  }
  [[nodiscard]] bool ready() const override { return index_ != nullptr; }
  [[nodiscard]] bool exact_top_k() const override { return false; }

  void put(std::span<const std::uint64_t> ids, const float* keys, const RowSpan& all) override {
    if (!index_) {
      build(all);  // includes these rows if the collection is now large enough
      return;
    }
    append(ids.data(), keys, ids.size());
    rebuild_if_worn(all);
  }

  void erase(std::uint64_t id, const RowSpan& all) override {
    if (!index_) return;
    kill(id);
    rebuild_if_worn(all);
  }

  [[nodiscard]] std::vector<std::byte> save() const override {
    if (!index_) return {};
    ByteWriter w;
    w.put(static_cast<std::uint8_t>(config_.index.kind));
    w.put(std::uint64_t{id_at_.size()});
    w.put_array(std::span<const std::uint64_t>(id_at_));
    std::vector<std::uint8_t> dead(dead_at_.begin(), dead_at_.end());
    w.put_array(std::span<const std::uint8_t>(dead));
    faiss::VectorIOWriter blob;
    faiss::write_index(index_.get(), &blob);
    w.put(std::uint64_t{blob.data.size()});
    w.put_array(std::span<const std::uint8_t>(blob.data));
    return std::move(w.bytes());
  }

  bool load(std::span<const std::byte> bytes, const RowSpan& all) override {
    try {
      ByteReader r(bytes);
      if (r.get<std::uint8_t>("index kind") != static_cast<std::uint8_t>(config_.index.kind)) return false;
      const auto n = r.get<std::uint64_t>("positions");
      auto ids = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"));
      const auto dead = to_vector<std::uint8_t>(r.take_array<std::uint8_t>(n, "dead map"));
      const auto blob_size = r.get<std::uint64_t>("index size");
      const auto blob = r.take_array<std::uint8_t>(blob_size, "index");
      // The live positions must be exactly the collection's rows, each once.
      std::unordered_map<std::uint64_t, std::size_t> position_of;
      std::size_t dead_count = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (dead[i] != 0) {
          ++dead_count;
          continue;
        }
        if (!position_of.emplace(ids[i], i).second) return false;
      }
      if (position_of.size() != all.rows) return false;
      for (std::size_t i = 0; i < all.rows; ++i)
        if (!position_of.contains(all.ids[i])) return false;
      faiss::VectorIOReader reader;
      reader.data.assign(reinterpret_cast<const std::uint8_t*>(blob.data()),
                         reinterpret_cast<const std::uint8_t*>(blob.data()) + blob.size());
      std::unique_ptr<faiss::Index> index(faiss::read_index(&reader));
      if (index->d != static_cast<int>(all.dim) || static_cast<std::uint64_t>(index->ntotal) != n) return false;
      index_ = std::move(index);
      id_at_ = std::move(ids);
      dead_at_.assign(dead.begin(), dead.end());
      position_of_ = std::move(position_of);
      dead_ = dead_count;
      return true;
    } catch (const Error&) {
      return false;
    } catch (const faiss::FaissException&) {
      return false;
    }
  }

  [[nodiscard]] std::vector<std::uint64_t> search(const float* query, const RowSpan&,
                                                  const IndexSearch& p) const override {
    std::vector<std::uint64_t> ids;
    if (!index_ || p.k == 0) return ids;
    const auto total = static_cast<std::size_t>(index_->ntotal);
    // Ask for enough extra results to cover the dead positions we expect to filter out; retry wider if not.
    std::size_t ask = std::min(total, p.k + p.k * dead_ / std::max<std::size_t>(1, total - dead_) + 8);
    OmpThreads one(1);
    for (;;) {
      std::vector<float> scores(ask);
      std::vector<Label> labels(ask);
      run_search(query, ask, p, scores.data(), labels.data());
      ids.clear();
      for (Label l : labels) {
        if (l < 0 || dead_at_[static_cast<std::size_t>(l)]) continue;
        ids.push_back(id_at_[static_cast<std::size_t>(l)]);
        if (ids.size() == p.k) return ids;
      }
      if (ask >= total) return ids;
      ask = std::min(total, ask * 2);
    }
  }

 private:
  [[nodiscard]] bool is_hnsw() const { return config_.index.kind == IndexKind::hnsw; }

  // Entries needed before IVF trains (HNSW needs none).
  [[nodiscard]] std::size_t train_threshold() const {
    if (is_hnsw()) return 1;
    std::size_t n = config_.index.ivf_train_size > 0 ? config_.index.ivf_train_size
                                                     : 39 * std::max<std::size_t>(config_.index.ivf_nlist, 16);
    if (config_.index.kind == IndexKind::automatic) n = std::max(n, config_.index.auto_threshold);
    return std::max<std::size_t>(n, 1);
  }

  [[nodiscard]] std::size_t nlist_for(std::size_t n) const {
    if (config_.index.ivf_nlist > 0) return config_.index.ivf_nlist;
    // ~4 sqrt(n) lists, but never fewer than the 39 training points per list FAISS's k-means asks for.
    const auto by_size = static_cast<std::size_t>(4.0 * std::sqrt(static_cast<double>(n)));
    return std::max<std::size_t>(1, std::min(by_size, n / 39));
  }

  // Creates (and for IVF trains) a fresh index over every row of all, or nothing while too small.
  void build(const RowSpan& all) {
    index_.reset();
    id_at_.clear();
    dead_at_.clear();
    position_of_.clear();
    dead_ = 0;
    if (all.rows < train_threshold()) return;
    OmpThreads threads(build_threads());
    const int d = static_cast<int>(all.dim);
    if (is_hnsw()) {
      auto hnsw = std::make_unique<faiss::IndexHNSWFlat>(d, static_cast<int>(config_.index.hnsw_m), faiss::METRIC_INNER_PRODUCT);
      hnsw->hnsw.efConstruction = static_cast<int>(config_.index.hnsw_ef_construction);
      index_ = std::move(hnsw);
    } else {
      const std::size_t nlist = nlist_for(all.rows);
      auto ivf = std::make_unique<faiss::IndexIVFFlat>(new faiss::IndexFlatIP(d), all.dim, nlist, faiss::METRIC_INNER_PRODUCT);
      ivf->own_fields = true;  // the IVF index deletes its quantizer
      ivf->cp.verbose = false;
      // 64 points per centroid train well (FAISS asks for >= 39 and caps at 256) at a quarter of
      // the k-means cost of 256; pass an evenly strided sample of that size.
      const std::size_t sample = std::min(all.rows, 64 * nlist);
      std::vector<float> train(sample * all.dim);
      for (std::size_t i = 0; i < sample; ++i)
        std::copy_n(all.keys + (i * all.rows / sample) * all.dim, all.dim, train.begin() + static_cast<std::ptrdiff_t>(i * all.dim));
      ivf->train(static_cast<Label>(sample), train.data());
      index_ = std::move(ivf);
    }
    append(all.ids, all.keys, all.rows);
  }

  void append(const std::uint64_t* ids, const float* keys, std::size_t n) {
    OmpThreads threads(build_threads());
    index_->add(static_cast<Label>(n), keys);
    for (std::size_t i = 0; i < n; ++i) {
      kill(ids[i]);  // a replaced entry (or an id repeated within the batch) keeps only its newest key
      position_of_[ids[i]] = id_at_.size();
      id_at_.push_back(ids[i]);
      dead_at_.push_back(false);
    }
  }

  void kill(std::uint64_t id) {
    auto it = position_of_.find(id);
    if (it == position_of_.end()) return;
    dead_at_[it->second] = true;
    ++dead_;
    position_of_.erase(it);
  }

  void rebuild_if_worn(const RowSpan& all) {
    if (static_cast<double>(dead_) > config_.index.rebuild_fraction * static_cast<double>(std::max<std::size_t>(1, all.rows)))
      build(all);
  }

  void run_search(const float* query, std::size_t k, const IndexSearch& p, float* scores, Label* labels) const {
    if (is_hnsw()) {
      faiss::SearchParametersHNSW params;  // its efSearch default (16) would override the index's: always set it
      params.efSearch = static_cast<int>(std::max(p.ef_search, k));
      index_->search(1, query, static_cast<Label>(k), scores, labels, &params);
    } else {
      faiss::SearchParametersIVF params;
      params.nprobe = std::max<std::size_t>(1, p.nprobe);
      index_->search(1, query, static_cast<Label>(k), scores, labels, &params);
    }
  }

  CollectionConfig config_;
  std::unique_ptr<faiss::Index> index_;
  std::vector<std::uint64_t> id_at_;                        // FAISS label -> entry id
  std::vector<bool> dead_at_;                               // FAISS label -> removed or replaced
  std::unordered_map<std::uint64_t, std::size_t> position_of_;  // live entry id -> FAISS label
  std::size_t dead_ = 0;
};

}  // namespace

OmpThreads::OmpThreads(int threads) : previous_(omp_get_max_threads()) { omp_set_num_threads(threads); }
OmpThreads::~OmpThreads() { omp_set_num_threads(previous_); }

std::unique_ptr<PruningIndex> make_pruning_index(const CollectionConfig& config) {
  switch (config.index.kind) {
    case IndexKind::exact: return nullptr;
    case IndexKind::flat: return make_flat_index();
    case IndexKind::hnsw:
    case IndexKind::ivf:
    case IndexKind::automatic: return std::make_unique<PositionalIndex>(config);
  }
  return nullptr;
}

}  // namespace softkv::detail
