// The HNSW pruning index over FAISS, kept in step with writes through tombstones and rebuilds.
//
// FAISS numbers vectors by insertion position (labels 0, 1, ...). HNSW in FAISS 1.7.3 cannot remove,
// so the index is append-only: a removed or replaced entry's position is marked dead and
// filtered out of results. Rebuilding (once dead positions pass rebuild_fraction of
// the live ones) run in the background on a copy of the rows; writes that land meanwhile go to the
// old index, which keeps serving, and to a journal replayed into the new one before it is swapped in.
#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "index/certified_lists.hpp"
#include "index/pruning_index.hpp"
#include "codec/bytes.hpp"
#include "scan.hpp"  // key_row

namespace softkv::detail {

std::unique_ptr<PruningIndex> make_flat_index();

namespace {

using Label = faiss::Index::idx_t;

// Threads for index builds: OpenMP's default as the process started (all cores, or OMP_NUM_THREADS),
// read once at load time, before any query thread has lowered its own setting to 1.
const int kBuildThreads = std::max(1, omp_get_max_threads());

int build_threads() { return kBuildThreads; }

}  // namespace

// FAISS sums squares and inner products in float: keys near FLT_MAX overflow them, and its k-means
// then aborts the process (an assertion, not an exception). So FAISS gets each key times 2^-shift,
// shift chosen at build time so that the largest element built on is below 2^kFaissBuiltExponent,
// and clamped to +-2^kFaissClampExponent: keys added later may be up to 2^20 times larger than any
// built on before they are clamped, and with d <= 2^24 an inner product of two clamped keys stays
// below 2^(2 * 50 + 24) = 2^124, inside float. A power of two keeps the ranking of inner products; a
// clamped element only makes that row's candidacy approximate, and softkv rescores every candidate
// with its own kernel anyway.
constexpr int kFaissBuiltExponent = 30;
constexpr int kFaissClampExponent = 50;

int index_build_threads() { return kBuildThreads; }

int faiss_shift(const float* keys, std::size_t count) {
  float largest = 0.0f;
  for (std::size_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(keys[i]));
  return largest == 0.0f ? 0 : std::max(0, std::ilogb(largest) + 1 - kFaissBuiltExponent);
}

// count floats of keys as FAISS gets them under shift (times 2^-shift, clamped).
std::vector<float> faiss_copy(const float* keys, std::size_t count, int shift) {
  const float limit = std::ldexp(1.0f, kFaissClampExponent);
  std::vector<float> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = std::clamp(std::ldexp(keys[i], -shift), -limit, limit);
  return out;
}

namespace {

// A FAISS index and the bookkeeping that maps its positions to entry ids.
struct Built {
  std::unique_ptr<faiss::Index> index;
  int shift = 0;                                             // FAISS holds keys times 2^-shift (faiss_copy)
  std::vector<std::uint64_t> id_at;                          // FAISS label -> entry id
  std::vector<bool> dead_at;                                 // FAISS label -> removed or replaced
  std::unordered_map<std::uint64_t, std::size_t> position_of;  // live entry id -> FAISS label
  std::size_t dead = 0;

  void kill(std::uint64_t id) {
    auto it = position_of.find(id);
    if (it == position_of.end()) return;
    dead_at[it->second] = true;
    ++dead;
    position_of.erase(it);
  }

  void append(const std::uint64_t* ids, const float* keys, std::size_t n) {
    OmpThreads threads(build_threads());
    const std::vector<float> safe = faiss_copy(keys, n * static_cast<std::size_t>(index->d), shift);
    index->add(static_cast<Label>(n), safe.data());
    for (std::size_t i = 0; i < n; ++i) {
      kill(ids[i]);  // a replaced entry (or an id repeated within the batch) keeps only its newest key
      position_of[ids[i]] = id_at.size();
      id_at.push_back(ids[i]);
      dead_at.push_back(false);
    }
  }
};

class PositionalIndex;

// The rows copied for a build, and the index built from them off-lock.
class PositionalBuild final : public IndexBuild {
 public:
  PositionalBuild(const PositionalIndex& owner, const RowSpan& all);
  void run() override;
  Built built;

 private:
  const PositionalIndex& owner_;
  std::vector<std::uint64_t> ids_;
  std::vector<float> keys_;
  std::size_t dim_;
};

class PositionalIndex final : public PruningIndex {
 public:
  explicit PositionalIndex(const CollectionConfig& config) : config_(config) {}

  [[nodiscard]] IndexKind kind() const override { return ready() ? IndexKind::hnsw : IndexKind::exact; }
  [[nodiscard]] bool ready() const override { return current_.index != nullptr; }
  [[nodiscard]] bool exact_top_k() const override { return false; }

  void put(std::span<const std::uint64_t> ids, const float* keys, const RowSpan& all) override {
    journal_.put(ids, keys, all.dim);
    if (current_.index) current_.append(ids.data(), keys, ids.size());
    rows_ = all.rows;
  }

  void erase(std::uint64_t id, const RowSpan& all) override {
    journal_.erase(id);
    current_.kill(id);
    rows_ = all.rows;
  }

  [[nodiscard]] bool build_due() const override {
    if (journal_.active()) return false;  // one build at a time
    if (!current_.index) return rows_ >= train_threshold();
    return static_cast<double>(current_.dead) > config_.index.rebuild_fraction * static_cast<double>(std::max<std::size_t>(1, rows_));
  }

  std::unique_ptr<IndexBuild> start_build(const RowSpan& all) override {
    rows_ = all.rows;
    if (!build_due()) return nullptr;
    journal_.start();
    return std::make_unique<PositionalBuild>(*this, all);
  }

  void finish_build(std::unique_ptr<IndexBuild> build) override {
    if (!build) {  // the build failed: keep serving from the current index
      journal_.stop();
      return;
    }
    auto& b = static_cast<PositionalBuild&>(*build);
    journal_.replay_into(b.built);
    if (b.built.index) current_ = std::move(b.built);
  }

  void build_now(const RowSpan& all) override {
    rows_ = all.rows;
    if (!build_due()) return;
    PositionalBuild b(*this, all);
    b.run();
    if (b.built.index) current_ = std::move(b.built);
  }

  // Creates a fresh index over the given rows.
  [[nodiscard]] Built build(const std::uint64_t* ids, const float* keys, std::size_t n, std::size_t dim) const {
    Built b;
    if (n < train_threshold()) return b;
    OmpThreads threads(build_threads());
    const int d = static_cast<int>(dim);
    b.shift = faiss_shift(keys, n * dim);
    auto hnsw = std::make_unique<faiss::IndexHNSWFlat>(d, static_cast<int>(config_.index.hnsw_m), faiss::METRIC_INNER_PRODUCT);
    hnsw->hnsw.efConstruction = static_cast<int>(config_.index.hnsw_ef_construction);
    b.index = std::move(hnsw);
    b.append(ids, keys, n);
    return b;
  }

  [[nodiscard]] std::vector<std::byte> save() const override {
    if (!current_.index) return {};
    ByteWriter w;
    w.put(static_cast<std::uint8_t>(config_.index.kind));
    w.put(std::uint64_t{current_.id_at.size()});
    w.put_array(std::span<const std::uint64_t>(current_.id_at));
    std::vector<std::uint8_t> dead(current_.dead_at.begin(), current_.dead_at.end());
    w.put_array(std::span<const std::uint8_t>(dead));
    faiss::VectorIOWriter blob;
    faiss::write_index(current_.index.get(), &blob);
    w.put(std::uint64_t{blob.data.size()});
    w.put_array(std::span<const std::uint8_t>(blob.data));
    w.put(std::int32_t{current_.shift});  // absent in snapshots written before it existed: 0
    return std::move(w.bytes());
  }

  bool load(std::span<const std::byte> bytes, const RowSpan& all) override {
    try {
      ByteReader r(bytes);
      if (r.get<std::uint8_t>("index kind") != static_cast<std::uint8_t>(config_.index.kind)) return false;
      const auto n = r.get<std::uint64_t>("positions");
      Built b;
      b.id_at = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "ids"));
      const auto dead = to_vector<std::uint8_t>(r.take_array<std::uint8_t>(n, "dead map"));
      const auto blob_size = r.get<std::uint64_t>("index size");
      const auto blob = r.take_array<std::uint8_t>(blob_size, "index");
      if (r.remaining() > 0) b.shift = r.get<std::int32_t>("index key shift");
      if (b.shift < 0 || b.shift > 255) return false;
      // The live positions must be exactly the collection's rows, each once.
      for (std::size_t i = 0; i < n; ++i) {
        if (dead[i] != 0) {
          ++b.dead;
          continue;
        }
        if (!b.position_of.emplace(b.id_at[i], i).second) return false;
      }
      if (b.position_of.size() != all.rows) return false;
      for (std::size_t i = 0; i < all.rows; ++i)
        if (!b.position_of.contains(all.ids[i])) return false;
      faiss::VectorIOReader reader;
      reader.data.assign(reinterpret_cast<const std::uint8_t*>(blob.data()),
                         reinterpret_cast<const std::uint8_t*>(blob.data()) + blob.size());
      b.index.reset(faiss::read_index(&reader));
      if (b.index->d != static_cast<int>(all.dim) || static_cast<std::uint64_t>(b.index->ntotal) != n) return false;
      b.dead_at.assign(dead.begin(), dead.end());
      current_ = std::move(b);
      rows_ = all.rows;
      return true;
    } catch (const Error&) {
      return false;
    } catch (const faiss::FaissException&) {
      return false;
    }
  }

  // All n queries in one FAISS call. Dead positions are filtered out afterwards, so each query asks
  // for enough extra results to cover the dead share; queries left short are asked again, wider.
  [[nodiscard]] std::vector<std::vector<std::uint64_t>> search(const float* queries, const float*, std::size_t n,
                                                               const RowSpan& all, const IndexSearch& p) const override {
    std::vector<std::vector<std::uint64_t>> ids(n);
    if (!current_.index || p.k == 0 || n == 0) return ids;
    const auto total = static_cast<std::size_t>(current_.index->ntotal);
    const std::size_t dead = current_.dead;
    std::size_t ask = std::min(total, p.k + p.k * dead / std::max<std::size_t>(1, total - dead) + 8);
    OmpThreads one(1);
    std::vector<std::size_t> pending(n);  // queries still short of p.k live results
    for (std::size_t i = 0; i < n; ++i) pending[i] = i;
    while (!pending.empty()) {
      std::vector<float> batch(pending.size() * all.dim);
      for (std::size_t j = 0; j < pending.size(); ++j) {
        float* row = batch.data() + j * all.dim;
        std::copy_n(queries + pending[j] * all.dim, all.dim, row);
        // split_scale with scale 1 brings the largest |q_i| to [1, 2) by a power of two (a caller's split
        // may have been clamped short of that): the same ranking, and inner products with the keys as
        // FAISS holds them (at most 2^kFaissClampExponent) cannot overflow.
        (void)split_scale(std::span<float>(row, all.dim), 1.0f);
      }
      std::vector<float> scores(pending.size() * ask);
      std::vector<Label> labels(pending.size() * ask);
      run_search(batch.data(), pending.size(), ask, p, scores.data(), labels.data());
      std::vector<std::size_t> short_of_k;
      for (std::size_t j = 0; j < pending.size(); ++j) {
        std::vector<std::uint64_t>& out = ids[pending[j]];
        out.clear();
        for (std::size_t c = 0; c < ask && out.size() < p.k; ++c) {
          const Label l = labels[j * ask + c];
          if (l < 0 || current_.dead_at[static_cast<std::size_t>(l)]) continue;
          out.push_back(current_.id_at[static_cast<std::size_t>(l)]);
        }
        if (out.size() < p.k && ask < total) short_of_k.push_back(pending[j]);
      }
      pending = std::move(short_of_k);
      ask = std::min(total, ask * 2);
    }
    return ids;
  }

 private:
  // Entries needed before the index is built: one.
  [[nodiscard]] static std::size_t train_threshold() { return 1; }

  // FAISS takes int efSearch: ef_search is clamped to [k, positions] (a longer list than the graph has
  // nodes visits nothing more, and anything past INT_MAX would wrap).
  void run_search(const float* queries, std::size_t n, std::size_t k, const IndexSearch& p, float* scores, Label* labels) const {
    const auto total = static_cast<std::size_t>(current_.index->ntotal);
    faiss::SearchParametersHNSW params;  // its efSearch default (16) would override the index's: always set it
    const std::size_t ef = std::clamp(p.ef_search, k, std::max(k, total));
    params.efSearch = static_cast<int>(std::min<std::size_t>(ef, std::numeric_limits<int>::max()));
    current_.index->search(static_cast<Label>(n), queries, static_cast<Label>(k), scores, labels, &params);
  }

  CollectionConfig config_;
  Built current_;
  std::size_t rows_ = 0;            // live entries in the collection, as of the last write
  BuildJournal journal_;            // writes made while a build runs
};

PositionalBuild::PositionalBuild(const PositionalIndex& owner, const RowSpan& all)
    : owner_(owner), ids_(all.ids, all.ids + all.rows), keys_(all.rows * all.dim), dim_(all.dim) {
  // FAISS gets float32 copies of the keys as stored (compact keys widened exactly).
  for (std::size_t r = 0; r < all.rows; ++r) key_row(all, r, keys_.data() + r * all.dim);
}

void PositionalBuild::run() { built = owner_.build(ids_.data(), keys_.data(), ids_.size(), dim_); }

// hnsw: FAISS's graph answers hard queries and candidate searches; softkv's certified lists, kept beside
// it over the same rows, answer pruned soft queries with a guaranteed tail bound (the graph's own bound
// is an estimate that fails on out-of-distribution queries: docs/PRUNING.md). Writes go to both.
class GraphAndLists final : public PruningIndex {
 public:
  explicit GraphAndLists(const CollectionConfig& config) : graph_(std::make_unique<PositionalIndex>(config)) {
    CollectionConfig lists = config;
    lists.index.kind = IndexKind::ivf;  // the lists' own defaults: N / 32 lists, trained from 624 rows on
    lists_ = make_certified_index(lists);
  }

  // Either part serves as soon as it is built: the lists (seconds) while the graph builds (up to an hour at
  // 1M rows), answering hard queries too (their exact best) until the graph takes those over.
  [[nodiscard]] IndexKind kind() const override { return graph_->ready() ? IndexKind::hnsw : lists_->kind(); }
  [[nodiscard]] bool ready() const override { return graph_->ready() || lists_->ready(); }
  [[nodiscard]] bool exact_top_k() const override { return !graph_->ready(); }
  [[nodiscard]] const CertifiedLists* lists() const override { return lists_->lists(); }

  void put(std::span<const std::uint64_t> ids, const float* keys, const RowSpan& all) override {
    graph_->put(ids, keys, all);
    lists_->put(ids, keys, all);
  }
  void erase(std::uint64_t id, const RowSpan& all) override {
    graph_->erase(id, all);
    lists_->erase(id, all);
  }

  [[nodiscard]] bool build_due() const override { return graph_->build_due() || lists_->build_due(); }

  // One part per build, the lists first (seconds, where the graph may take an hour): the collection runs
  // builds until none is due, so the other follows at once.
  std::unique_ptr<IndexBuild> start_build(const RowSpan& all) override {
    auto part = std::make_unique<Part>();
    part->of_lists = lists_->build_due();
    part->build = (part->of_lists ? lists_ : graph_)->start_build(all);
    if (!part->build) return nullptr;
    return part;
  }

  void finish_build(std::unique_ptr<IndexBuild> build) override {
    if (!build) {  // the build failed: both keep serving what they have (a journal not started just stays off)
      graph_->finish_build(nullptr);
      lists_->finish_build(nullptr);
      return;
    }
    auto& part = static_cast<Part&>(*build);
    (part.of_lists ? lists_ : graph_)->finish_build(std::move(part.build));
  }

  void build_now(const RowSpan& all) override {
    lists_->build_now(all);  // seconds, then the graph
    graph_->build_now(all);
  }

  // The graph's bytes and the lists' bytes, each with its length, after a header; snapshots written
  // before the lists existed hold the graph's bytes alone (load builds the lists from the rows then).
  [[nodiscard]] std::vector<std::byte> save() const override {
    const std::vector<std::byte> graph = graph_->save();
    if (graph.empty()) return {};
    const std::vector<std::byte> lists = lists_->save();
    ByteWriter w;
    w.put(kHeader);
    w.put(std::uint64_t{graph.size()});
    w.put_array(std::span<const std::byte>(graph));
    w.put(std::uint64_t{lists.size()});
    w.put_array(std::span<const std::byte>(lists));
    return std::move(w.bytes());
  }

  bool load(std::span<const std::byte> bytes, const RowSpan& all) override {
    std::span<const std::byte> graph = bytes, lists;
    try {
      ByteReader r(bytes);
      if (bytes.size() >= sizeof(std::uint64_t) && r.get<std::uint64_t>("index header") == kHeader) {
        graph = r.take_array<std::byte>(r.get<std::uint64_t>("graph size"), "graph");
        lists = r.take_array<std::byte>(r.get<std::uint64_t>("lists size"), "lists");
        if (r.remaining() > 0) return false;
      }
    } catch (const Error&) {
      return false;
    }
    if (!graph_->load(graph, all)) return false;
    try {
      if (lists.empty() || !lists_->load(lists, all)) lists_->build_now(all);  // seconds, where the graph takes minutes
    } catch (const std::exception&) {  // e.g. out of memory: the graph serves alone; the next write retries the lists
    }
    return true;
  }

  [[nodiscard]] std::vector<std::vector<std::uint64_t>> search(const float* queries, const float* scales, std::size_t n,
                                                               const RowSpan& all, const IndexSearch& p) const override {
    return (graph_->ready() ? graph_ : lists_)->search(queries, scales, n, all, p);
  }

 private:
  static constexpr std::uint64_t kHeader = std::uint64_t{0x534C4748} << 32 | 1;  // "HGLS", version 1

  // A build of one of the two.
  struct Part final : IndexBuild {
    bool of_lists = false;
    std::unique_ptr<IndexBuild> build;
    void run() override { build->run(); }
  };

  std::unique_ptr<PruningIndex> graph_;
  std::unique_ptr<PruningIndex> lists_;
};

}  // namespace

OmpThreads::OmpThreads(int threads) : previous_(omp_get_max_threads()) { omp_set_num_threads(threads); }
OmpThreads::~OmpThreads() { omp_set_num_threads(previous_); }

std::unique_ptr<PruningIndex> make_pruning_index(const CollectionConfig& config) {
  switch (config.index.kind) {
    case IndexKind::exact: return nullptr;
    case IndexKind::flat: return make_flat_index();
    case IndexKind::hnsw: return std::make_unique<GraphAndLists>(config);
    case IndexKind::ivf:
    case IndexKind::automatic: return make_certified_index(config);
  }
  return nullptr;
}

}  // namespace softkv::detail
