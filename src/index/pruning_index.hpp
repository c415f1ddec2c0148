// The pruning-index interface: candidates for a query, kept in step with the collection's writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "simd/kernel_table.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

class CertifiedLists;

/// Per-query search effort.
struct IndexSearch {
  std::size_t k = 0;          ///< candidates wanted per query
  std::size_t ef_search = 64; ///< HNSW candidate list
  std::size_t nprobe = 16;    ///< IVF lists visited
  std::size_t parts = 1;      ///< row slices an exhaustive (flat) search runs in parallel
};

/// A (re)build prepared under the collection's lock and run without it.
class IndexBuild {
 public:
  virtual ~IndexBuild() = default;
  /// The expensive part (training, graph construction); holds no collection lock.
  virtual void run() = 0;
};

/// Finds the (approximately) best keys for a query. Writes (put/erase) happen under the collection's
/// exclusive lock; search may run concurrently with other searches under its shared lock. Writes only
/// record that a build is due; the collection runs it in the background (start/run/finish_build).
class PruningIndex {
 public:
  virtual ~PruningIndex() = default;

  /// The kind of candidates search() currently returns (automatic reports exact or ivf).
  [[nodiscard]] virtual IndexKind kind() const = 0;
  /// Whether search() can answer now; when not, queries fall back to the exact scan.
  [[nodiscard]] virtual bool ready() const = 0;
  /// Whether search() returns the true top-k (so the tail bound is a guarantee).
  [[nodiscard]] virtual bool exact_top_k() const = 0;
  /// The certified lists when this index has them and they are ready (ivf, automatic, hnsw's beside its graph), else null.
  [[nodiscard]] virtual const CertifiedLists* lists() const { return nullptr; }

  /// Rows inserted or replaced: ids[i] now holds keys[i * d ..] (as stored). all is the whole
  /// collection after the write (for training or rebuilding).
  virtual void put(std::span<const std::uint64_t> ids, const float* keys, const RowSpan& all) = 0;
  /// The entry id was removed; all is the collection after the removal.
  virtual void erase(std::uint64_t id, const RowSpan& all) = 0;

  /// Whether a build should be started: a training threshold was reached or too many entries are dead.
  [[nodiscard]] virtual bool build_due() const { return false; }
  /// Under the collection's lock (shared is enough): copies the rows a build needs and starts
  /// journaling writes. Null when no build is due.
  virtual std::unique_ptr<IndexBuild> start_build(const RowSpan&) { return nullptr; }
  /// Under the exclusive lock: replays the writes journaled since start_build and installs the result
  /// (null: the build failed; journaling stops and the current index keeps serving).
  virtual void finish_build(std::unique_ptr<IndexBuild>) {}
  /// Builds at once from all (on restore, before any query runs).
  virtual void build_now(const RowSpan&) {}

  /// The index's state (FAISS index and label map) as bytes, or empty when there is nothing worth
  /// keeping on disk (flat, an untrained IVF).
  [[nodiscard]] virtual std::vector<std::byte> save() const { return {}; }
  /// Replaces the state with bytes from save() if they describe exactly the live rows of all;
  /// otherwise returns false and changes nothing. The bytes must be intact (checksummed by the caller).
  virtual bool load(std::span<const std::byte>, const RowSpan&) { return false; }

  /// Batch-first, as FAISS is: for each of n row-major queries (n x d, query i split by split_scale
  /// with factor scales[i], so that its scores are scales[i] * (query . k)), the ids of up to p.k of
  /// its best keys (live entries only). An exact_top_k() index returns them best first (higher score,
  /// then smaller id); for the others the order is unspecified, and they may rank by query . k alone
  /// (the same order up to rounding).
  [[nodiscard]] virtual std::vector<std::vector<std::uint64_t>> search(const float* queries, const float* scales, std::size_t n,
                                                                       const RowSpan& all, const IndexSearch& p) const = 0;
};

/// The writes that land while a background build runs, replayed into the new index before it is
/// swapped in (shared by the indexes that build off-lock). Used under the collection's exclusive lock.
class BuildJournal {
 public:
  /// Whether a build is running (writes are being recorded).
  [[nodiscard]] bool active() const noexcept { return active_; }
  /// A build starts: record from now on.
  void start() {
    active_ = true;
    entries_.clear();
  }
  /// Rows put while a build runs (ids[i] at keys + i * dim).
  void put(std::span<const std::uint64_t> ids, const float* keys, std::size_t dim) {
    if (!active_) return;
    for (std::size_t i = 0; i < ids.size(); ++i) entries_.push_back({ids[i], std::vector<float>(keys + i * dim, keys + (i + 1) * dim)});
  }
  /// An id erased while a build runs.
  void erase(std::uint64_t id) {
    if (active_) entries_.push_back({id, {}});
  }
  /// Replays the recorded writes into built (built.kill(id), built.append(&id, key, 1)) and stops recording.
  template <class Built>
  void replay_into(Built& built) {
    for (const Entry& e : entries_) {
      if (e.key.empty()) built.kill(e.id);
      else built.append(&e.id, e.key.data(), 1);
    }
    stop();
  }
  /// Stops recording (the build ended, replayed or failed).
  void stop() {
    entries_.clear();
    active_ = false;
  }

 private:
  struct Entry {
    std::uint64_t id;
    std::vector<float> key;  // empty: a removal
  };
  bool active_ = false;
  std::vector<Entry> entries_;
};

/// The index for a collection's configuration; null for IndexKind::exact.
std::unique_ptr<PruningIndex> make_pruning_index(const CollectionConfig& config);

/// Threads for index builds: OpenMP's default as the process started (all cores, or OMP_NUM_THREADS).
int index_build_threads();

/// FAISS sums in float: keys near FLT_MAX overflow it (its k-means then aborts the process). A build
/// hands FAISS every key times 2^-shift, shift = faiss_shift(keys built on), clamped (faiss_copy).
int faiss_shift(const float* keys, std::size_t count);
/// count floats of keys as FAISS gets them under shift (times 2^-shift, clamped to +-2^50).
std::vector<float> faiss_copy(const float* keys, std::size_t count, int shift);

/// Sets FAISS's OpenMP thread count on this thread for a scope, then restores it.
class OmpThreads {
 public:
  explicit OmpThreads(int threads);
  ~OmpThreads();
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int previous_;
};

}  // namespace softkv::detail
