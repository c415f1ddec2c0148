// Collection::Impl: the storage and query plumbing behind Collection, shared with persistence.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cmath>
#include <limits>
#include <memory>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "aligned_buffer.hpp"
#include "index/pruning_index.hpp"
#include "scan.hpp"
#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "thread_pool.hpp"
#include "validate.hpp"
#include "writer_first_mutex.hpp"

namespace softkv {

// Kept free so that next id = largest id + 1 never wraps.
inline constexpr std::uint64_t kReservedId = std::numeric_limits<std::uint64_t>::max();

using detail::FloatBuffer;

class Collection::Impl {
 public:
  explicit Impl(const CollectionConfig& config) : config_(config), index_(detail::make_pruning_index(config)) {}

  // Storage: row i holds ids_[i], keys_[i*d ..], values_[i*dv ..]. Removal moves the last row
  // into the hole, so scans never see gaps and need no tombstone test.
  CollectionConfig config_;
  mutable detail::WriterFirstMutex mutex_;
  FloatBuffer keys_;
  FloatBuffer values_;
  std::vector<std::uint64_t> ids_;
  std::unordered_map<std::uint64_t, std::size_t> slot_of_;
  std::uint64_t next_id_ = 0;
  std::unique_ptr<detail::PruningIndex> index_;  // null for IndexKind::exact; updated under the write lock
  std::atomic<std::size_t> size_hint_{0};        // ids_.size(), published after each write (read without the lock)
  // Background index builds, one at a time; declared last so the thread is joined before the rest goes.
  std::mutex build_mutex_;
  std::condition_variable build_done_;
  bool building_ = false;
  std::thread builder_;

  [[nodiscard]] std::size_t dim() const { return config_.dim; }
  [[nodiscard]] std::size_t value_dim() const { return config_.value_dim; }

  [[nodiscard]] detail::RowSpan span() const {
    return {keys_.data(), values_.data(), ids_.data(), ids_.size(), dim(), value_dim()};
  }

  // The keys as they will be stored: the input itself for dot, unit-length copies in buffer for
  // cosine (a zero key has no direction and is rejected).
  std::span<const float> prepare_keys(std::span<const float> keys, std::vector<float>& buffer, std::string_view what) const {
    if (config_.metric != Metric::cosine) return keys;
    buffer.assign(keys.begin(), keys.end());
    detail::normalise_rows(buffer, dim(), what);
    return buffer;
  }

  // Checks a row-major batch of n keys and n values; returns n.
  std::size_t check_rows(std::span<const float> keys, std::span<const float> values) const {
    const std::size_t n = detail::row_count(keys.size(), dim(), "keys");
    const std::size_t nv = detail::row_count(values.size(), value_dim(), "values");
    if (n != nv)
      throw Error(ErrorCode::dimension_mismatch,
                  std::to_string(n) + " keys but " + std::to_string(nv) + " values");
    detail::check_finite(keys, "keys", dim());
    detail::check_finite(values, "values", value_dim());
    return n;
  }

  // Every check add_batch/upsert_batch make (row counts, finiteness, ids when given, zero keys under
  // cosine), changing nothing. Returns the keys as they will be stored (normalised into buffer for
  // cosine) and sets n to the row count.
  std::span<const float> validate_rows(std::span<const float> keys, std::span<const float> values,
                                       const std::span<const std::uint64_t>* ids, std::vector<float>& buffer, std::size_t& n) const {
    n = check_rows(keys, values);
    if (ids != nullptr) {
      if (ids->size() != n)
        throw Error(ErrorCode::dimension_mismatch, std::to_string(ids->size()) + " ids but " + std::to_string(n) + " keys");
      for (std::uint64_t id : *ids)
        if (id == kReservedId) throw Error(ErrorCode::invalid_argument, "id 2^64-1 is reserved");
    }
    return prepare_keys(keys, buffer, "key");
  }

  // Stores rows that validate_rows accepted (keys as it prepared them): inserts or replaces each id.
  void store_rows(std::span<const std::uint64_t> ids, const float* keys, const float* values) {
    std::unique_lock lock(mutex_);
    reserve_more(ids.size());
    for (std::size_t r = 0; r < ids.size(); ++r) put(ids[r], keys + r * dim(), values + r * value_dim());
    index_put(ids, keys);
  }

  // The id add() assigns next.
  [[nodiscard]] std::uint64_t next_id() const {
    std::shared_lock lock(mutex_);
    return next_id_;
  }

  // Inserts or replaces one row; keys are already prepared. Caller holds the exclusive lock.
  void put(std::uint64_t id, const float* key, const float* value) {
    std::size_t slot;
    if (auto it = slot_of_.find(id); it != slot_of_.end()) {
      slot = it->second;
    } else {
      slot = ids_.size();
      ids_.push_back(id);
      keys_.resize(keys_.size() + dim());
      values_.resize(values_.size() + value_dim());
      slot_of_.emplace(id, slot);
    }
    std::copy_n(key, dim(), keys_.begin() + static_cast<std::ptrdiff_t>(slot * dim()));
    std::copy_n(value, value_dim(), values_.begin() + static_cast<std::ptrdiff_t>(slot * value_dim()));
    next_id_ = std::max(next_id_, id + 1);
  }

  void reserve_more(std::size_t n) {
    ids_.reserve(ids_.size() + n);
    keys_.reserve(keys_.size() + n * dim());
    values_.reserve(values_.size() + n * value_dim());
    slot_of_.reserve(slot_of_.size() + n);
  }

  // Validates one query (dimension, finiteness) and returns it ready to score (normalised for cosine).
  std::vector<float> prepare_queries(std::span<const float> queries, std::size_t& count) const {
    count = detail::row_count(queries.size(), dim(), "queries");
    if (count == 0) throw Error(ErrorCode::dimension_mismatch, "queries is empty: give at least one row of d floats");
    detail::check_finite(queries, "query", dim());
    std::vector<float> buffer;
    const std::span<const float> prepared = prepare_keys(queries, buffer, "query");
    if (prepared.data() != buffer.data()) buffer.assign(prepared.begin(), prepared.end());
    return buffer;
  }

  void require_entries() const {
    if (ids_.empty()) throw Error(ErrorCode::empty_collection, "the collection has no entries to query");
  }

  [[nodiscard]] std::size_t parts_for(const QueryOptions& options, std::size_t floats_per_row) const {
    return detail::choose_parts(ids_.size(), floats_per_row, options.threads, detail::ThreadPool::shared().concurrency());
  }

  // Pruning options are consistent and the collection has an index to prune with.
  void check_pruning(const QueryOptions& options) const {
    if (!options.top_k && !options.epsilon) return;
    if (options.top_k && options.epsilon)
      throw Error(ErrorCode::invalid_argument, "give top_k or epsilon, not both");
    if (options.top_k && *options.top_k == 0) throw Error(ErrorCode::invalid_argument, "top_k must be >= 1");
    if (options.epsilon && !(*options.epsilon > 0.0f && *options.epsilon < 1.0f))
      throw Error(ErrorCode::invalid_argument, "epsilon must lie in (0, 1), got " + std::to_string(*options.epsilon));
    if (!index_)
      throw Error(ErrorCode::invalid_argument,
                  "top_k and epsilon need a pruning index; create the collection with index.kind flat, hnsw, ivf or automatic");
    if (options.ef_search == 0 || options.nprobe == 0)
      throw Error(ErrorCode::invalid_argument, "ef_search and nprobe must be >= 1");
  }

  // Whether queries with these options search through the index rather than scanning.
  [[nodiscard]] bool use_index(const QueryOptions& options) const { return index_ && index_->ready() && !options.exact; }

  // Rows of the index's candidates for query (live entries only).
  [[nodiscard]] std::vector<std::size_t> index_rows(const float* query, std::size_t k, const QueryOptions& options) const {
    const std::vector<std::uint64_t> ids = index_->search(query, span(), {k, options.ef_search, options.nprobe, parts_for(options, dim())});
    std::vector<std::size_t> rows;
    rows.reserve(ids.size());
    for (std::uint64_t id : ids) rows.push_back(slot_of_.at(id));
    return rows;
  }

  // Tells the index about rows just written (keys as stored). Caller holds the write lock.
  void index_put(std::span<const std::uint64_t> ids, const float* keys) {
    size_hint_.store(ids_.size(), std::memory_order_relaxed);
    if (!index_) return;
    index_->put(ids, keys, span());
    start_build_if_due();
  }

  // Starts the background builder if the index asks for a (re)build. Caller holds the write lock.
  void start_build_if_due() {
    if (!index_ || !index_->build_due()) return;
    std::lock_guard lock(build_mutex_);
    if (building_) return;
    building_ = true;
    if (builder_.joinable()) builder_.join();  // the previous job already finished (building_ was false)
    builder_ = std::thread([this] { run_builds(); });
  }

  // The builder: prepare under the shared lock, build with no lock, install under the exclusive lock.
  void run_builds() {
    for (;;) {
      std::unique_ptr<detail::IndexBuild> build;
      {
        std::shared_lock lock(mutex_);
        build = index_->start_build(span());
      }
      if (!build) break;
      bool ok = true;
      try {
        build->run();
      } catch (...) {  // e.g. out of memory: keep the current index and stop trying until the next write
        ok = false;
      }
      std::unique_lock lock(mutex_);
      index_->finish_build(ok ? std::move(build) : nullptr);
      if (!ok) break;
    }
    {
      std::lock_guard lock(build_mutex_);
      building_ = false;
    }
    build_done_.notify_all();
  }

  ~Impl() {
    if (builder_.joinable()) builder_.join();
  }

  static void check_lse(double lse) {
    if (!std::isfinite(lse))
      throw Error(ErrorCode::numeric_overflow, "scores left the float range; use a smaller scale or a larger temperature");
  }
};

}  // namespace softkv
