// Collection: dense row-major storage with an id map, validated writes, exact scans and indexed pruning.
#include "softkv/collection.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <shared_mutex>  // std::shared_lock
#include <string>
#include <unordered_map>

#include "aligned_buffer.hpp"
#include "index/pruning_index.hpp"
#include "pruning.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"
#include "softkv/error.hpp"
#include "thread_pool.hpp"
#include "validate.hpp"
#include "writer_first_mutex.hpp"

namespace softkv {

using detail::FloatBuffer;

namespace {
// Kept free so that next id = largest id + 1 never wraps.
constexpr std::uint64_t kReservedId = std::numeric_limits<std::uint64_t>::max();
}  // namespace

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
    const std::size_t d = dim();
    for (std::size_t r = 0; r * d < buffer.size(); ++r) {
      float* k = buffer.data() + r * d;
      double norm2 = 0.0;
      for (std::size_t i = 0; i < d; ++i) norm2 += static_cast<double>(k[i]) * k[i];
      if (!(norm2 > 0.0))
        throw Error(ErrorCode::invalid_argument,
                    std::string(what) + " row " + std::to_string(r) + " is a zero vector: it has no direction for cosine");
      const auto inv = static_cast<float>(1.0 / std::sqrt(norm2));
      for (std::size_t i = 0; i < d; ++i) k[i] *= inv;
    }
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
    const std::vector<std::uint64_t> ids = index_->search(query, span(), {k, options.ef_search, options.nprobe});
    std::vector<std::size_t> rows;
    rows.reserve(ids.size());
    for (std::uint64_t id : ids) rows.push_back(slot_of_.at(id));
    return rows;
  }

  // Tells the index about rows just written (keys as stored). Caller holds the write lock.
  void index_put(std::span<const std::uint64_t> ids, const float* keys) {
    if (index_) index_->put(ids, keys, span());
  }

  static void check_lse(double lse) {
    if (!std::isfinite(lse))
      throw Error(ErrorCode::numeric_overflow, "scores left the float range; use a smaller scale or a larger temperature");
  }
};

Collection::Collection(const CollectionConfig& config) {
  if (config.dim == 0 || config.value_dim == 0)
    throw Error(ErrorCode::invalid_argument, "a collection needs dim >= 1 and value_dim >= 1");
  if (config.metric != Metric::dot && config.metric != Metric::cosine)
    throw Error(ErrorCode::invalid_argument, "unknown metric");
  if (config.index.kind > IndexKind::automatic) throw Error(ErrorCode::invalid_argument, "unknown index kind");
  if (config.index.kind == IndexKind::hnsw && (config.index.hnsw_m < 2 || config.index.hnsw_ef_construction == 0))
    throw Error(ErrorCode::invalid_argument, "HNSW needs hnsw_m >= 2 and hnsw_ef_construction >= 1");
  if (!(config.index.rebuild_fraction > 0.0f))
    throw Error(ErrorCode::invalid_argument, "rebuild_fraction must be > 0");
  if (config.scale && !(std::isfinite(*config.scale) && *config.scale > 0.0f))
    throw Error(ErrorCode::invalid_argument, "the default scale must be finite and > 0");
  impl_ = std::make_unique<Impl>(config);
}

Collection::~Collection() = default;
Collection::Collection(Collection&&) noexcept = default;
Collection& Collection::operator=(Collection&&) noexcept = default;

const CollectionConfig& Collection::config() const noexcept { return impl_->config_; }

std::size_t Collection::size() const {
  std::shared_lock lock(impl_->mutex_);
  return impl_->ids_.size();
}

bool Collection::contains(std::uint64_t id) const {
  std::shared_lock lock(impl_->mutex_);
  return impl_->slot_of_.contains(id);
}

Entry Collection::get(std::uint64_t id) const {
  std::shared_lock lock(impl_->mutex_);
  auto it = impl_->slot_of_.find(id);
  if (it == impl_->slot_of_.end()) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
  const std::size_t slot = it->second;
  const std::size_t d = impl_->dim();
  const std::size_t dv = impl_->value_dim();
  Entry e;
  e.id = id;
  e.key.assign(impl_->keys_.begin() + static_cast<std::ptrdiff_t>(slot * d),
               impl_->keys_.begin() + static_cast<std::ptrdiff_t>((slot + 1) * d));
  e.value.assign(impl_->values_.begin() + static_cast<std::ptrdiff_t>(slot * dv),
                 impl_->values_.begin() + static_cast<std::ptrdiff_t>((slot + 1) * dv));
  return e;
}

std::vector<std::uint64_t> Collection::ids() const {
  std::shared_lock lock(impl_->mutex_);
  return impl_->ids_;
}

std::uint64_t Collection::add(std::span<const float> key, std::span<const float> value) {
  detail::check_dimension(key.size(), impl_->dim(), "key");
  detail::check_dimension(value.size(), impl_->value_dim(), "value");
  return add_batch(key, value).front();
}

std::vector<std::uint64_t> Collection::add_batch(std::span<const float> keys, std::span<const float> values) {
  const std::size_t n = impl_->check_rows(keys, values);
  std::vector<float> buffer;
  const std::span<const float> prepared = impl_->prepare_keys(keys, buffer, "key");
  std::vector<std::uint64_t> ids(n);
  std::unique_lock lock(impl_->mutex_);
  if (n > kReservedId - impl_->next_id_) throw Error(ErrorCode::invalid_argument, "the id space is exhausted");
  impl_->reserve_more(n);
  for (std::size_t r = 0; r < n; ++r) {
    ids[r] = impl_->next_id_;
    impl_->put(ids[r], prepared.data() + r * impl_->dim(), values.data() + r * impl_->value_dim());
  }
  impl_->index_put(ids, prepared.data());
  return ids;
}

void Collection::upsert(std::uint64_t id, std::span<const float> key, std::span<const float> value) {
  detail::check_dimension(key.size(), impl_->dim(), "key");
  detail::check_dimension(value.size(), impl_->value_dim(), "value");
  upsert_batch(std::span<const std::uint64_t>(&id, 1), key, value);
}

void Collection::upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys,
                              std::span<const float> values) {
  const std::size_t n = impl_->check_rows(keys, values);
  if (ids.size() != n)
    throw Error(ErrorCode::dimension_mismatch, std::to_string(ids.size()) + " ids but " + std::to_string(n) + " keys");
  for (std::uint64_t id : ids)
    if (id == kReservedId) throw Error(ErrorCode::invalid_argument, "id 2^64-1 is reserved");
  std::vector<float> buffer;
  const std::span<const float> prepared = impl_->prepare_keys(keys, buffer, "key");
  std::unique_lock lock(impl_->mutex_);
  impl_->reserve_more(n);
  for (std::size_t r = 0; r < n; ++r)
    impl_->put(ids[r], prepared.data() + r * impl_->dim(), values.data() + r * impl_->value_dim());
  impl_->index_put(ids, prepared.data());
}

void Collection::remove(std::uint64_t id) {
  std::unique_lock lock(impl_->mutex_);
  Impl& s = *impl_;
  auto it = s.slot_of_.find(id);
  if (it == s.slot_of_.end()) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
  const std::size_t slot = it->second;
  const std::size_t last = s.ids_.size() - 1;
  const std::size_t d = s.dim();
  const std::size_t dv = s.value_dim();
  if (slot != last) {
    std::copy_n(s.keys_.begin() + static_cast<std::ptrdiff_t>(last * d), d, s.keys_.begin() + static_cast<std::ptrdiff_t>(slot * d));
    std::copy_n(s.values_.begin() + static_cast<std::ptrdiff_t>(last * dv), dv,
                s.values_.begin() + static_cast<std::ptrdiff_t>(slot * dv));
    s.ids_[slot] = s.ids_[last];
    s.slot_of_[s.ids_[slot]] = slot;
  }
  s.ids_.pop_back();
  s.keys_.resize(last * d);
  s.values_.resize(last * dv);
  s.slot_of_.erase(it);
  if (s.index_) s.index_->erase(id, s.span());
}

float Collection::resolve_scale(const QueryOptions& options) const {
  if (options.scale && options.temperature)
    throw Error(ErrorCode::invalid_argument, "give a temperature or a scale, not both");
  if (options.scale) {
    if (!(std::isfinite(*options.scale) && *options.scale > 0.0f))
      throw Error(ErrorCode::invalid_argument, "scale must be finite and > 0, got " + std::to_string(*options.scale));
    return *options.scale;
  }
  if (options.temperature) {
    const float t = *options.temperature;
    if (!(std::isfinite(t) && t > 0.0f))
      throw Error(ErrorCode::invalid_argument, "temperature must be finite and > 0, got " + std::to_string(t));
    const double s = 1.0 / (std::sqrt(static_cast<double>(impl_->dim())) * t);
    if (!(s <= static_cast<double>(std::numeric_limits<float>::max())))
      throw Error(ErrorCode::invalid_argument, "temperature " + std::to_string(t) + " is too small: the scale overflows a float");
    return static_cast<float>(s);
  }
  if (impl_->config_.scale) return *impl_->config_.scale;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(impl_->dim())));
}

SoftResult Collection::query_soft(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  const float scale = resolve_scale(options);
  std::size_t count = 0;
  const std::vector<float> q = impl_->prepare_queries(query, count);

  impl_->check_pruning(options);

  std::shared_lock lock(impl_->mutex_);
  impl_->require_entries();
  const detail::RowSpan span = impl_->span();
  const std::size_t parts = impl_->parts_for(options, impl_->dim() + impl_->value_dim());
  const detail::KernelTable& kernels = detail::kernels();
  const bool prune = (options.top_k || options.epsilon) && impl_->use_index(options);
  const detail::CandidateFinder find = [&](std::size_t k) { return impl_->index_rows(q.data(), k, options); };
  detail::PrunedSoft pruned =
      !prune            ? detail::exact_soft(kernels, q.data(), scale, span, options.top_m, parts)
      : options.top_k   ? detail::pruned_soft(kernels, q.data(), scale, span, *options.top_k, options.top_m, parts, find)
                        : detail::adaptive_soft(kernels, q.data(), scale, span, *options.epsilon, options.top_m, parts, find);
  detail::SoftScan& scan = pruned.scan;

  SoftResult result;
  result.lse = scan.state.lse();
  Impl::check_lse(result.lse);
  result.max_score = scan.state.max;
  result.candidates = pruned.k;
  result.tail_bound = pruned.tail_bound;
  const bool scanned_all = pruned.k == span.rows;
  result.searched_with = scanned_all ? IndexKind::exact : impl_->index_->kind();
  result.tail_bound_guaranteed = scanned_all || impl_->index_->exact_top_k();
  result.value.resize(impl_->value_dim());
  const float inv = 1.0f / scan.state.sum;
  for (std::size_t i = 0; i < result.value.size(); ++i) result.value[i] = scan.state.acc[i] * inv;
  result.top.reserve(scan.top.size());
  for (const auto& item : scan.top)
    result.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - result.lse)), item.score});
  return result;
}

HardResult Collection::query_hard(std::span<const float> query, const QueryOptions& options) const {
  detail::check_dimension(query.size(), impl_->dim(), "query");
  const float scale = resolve_scale(options);
  std::size_t count = 0;
  const std::vector<float> q = impl_->prepare_queries(query, count);

  std::shared_lock lock(impl_->mutex_);
  impl_->require_entries();
  const detail::RowSpan span = impl_->span();
  detail::ArgMax best;
  HardResult result;
  const IndexKind index_kind = impl_->use_index(options) ? impl_->index_->kind() : IndexKind::exact;
  if (index_kind == IndexKind::hnsw || index_kind == IndexKind::ivf) {
    // The index's top-1, rescored with our kernel; flat gains nothing over the scan below.
    for (std::size_t row : impl_->index_rows(q.data(), 1, options))
      best = {detail::kernels().dot(q.data(), span.keys + row * span.dim, span.dim), row};
    result.searched_with = index_kind;
  }
  if (best.row == detail::ArgMax::kNoRow) {
    best = detail::hard_scan_split(detail::kernels(), q.data(), span, impl_->parts_for(options, impl_->dim()));
    result.searched_with = IndexKind::exact;
  }
  if (best.row == detail::ArgMax::kNoRow)
    throw Error(ErrorCode::numeric_overflow, "every score is -inf; the keys or the query are too large");
  result.id = span.ids[best.row];
  result.score = scale * best.dot;
  result.value.assign(span.values + best.row * span.value_dim, span.values + (best.row + 1) * span.value_dim);
  return result;
}

SoftBatchResult Collection::query_soft_batch(std::span<const float> queries, const QueryOptions& options) const {
  if (options.top_m != 0)
    throw Error(ErrorCode::invalid_argument, "batched queries do not report contributors: top_m must be 0");
  const float scale = resolve_scale(options);
  std::size_t nq = 0;
  const std::vector<float> q = impl_->prepare_queries(queries, nq);

  std::shared_lock lock(impl_->mutex_);
  impl_->require_entries();
  const detail::RowSpan span = impl_->span();
  const std::size_t parts = impl_->parts_for(options, (impl_->dim() + impl_->value_dim()) * nq);
  const std::vector<detail::SoftmaxState> states = detail::soft_scan_batch_split(detail::kernels(), q.data(), nq, scale, span, parts);

  const std::size_t dv = impl_->value_dim();
  SoftBatchResult result;
  result.values.resize(nq * dv);
  result.lse.resize(nq);
  result.max_score.resize(nq);
  for (std::size_t b = 0; b < nq; ++b) {
    result.lse[b] = states[b].lse();
    Impl::check_lse(result.lse[b]);
    result.max_score[b] = states[b].max;
    const float inv = 1.0f / states[b].sum;
    for (std::size_t i = 0; i < dv; ++i) result.values[b * dv + i] = states[b].acc[i] * inv;
  }
  return result;
}

HardBatchResult Collection::query_hard_batch(std::span<const float> queries, const QueryOptions& options) const {
  const float scale = resolve_scale(options);
  std::size_t nq = 0;
  const std::vector<float> q = impl_->prepare_queries(queries, nq);

  std::shared_lock lock(impl_->mutex_);
  impl_->require_entries();
  const detail::RowSpan span = impl_->span();
  const std::size_t parts = impl_->parts_for(options, impl_->dim() * nq);
  const std::vector<detail::ArgMax> best = detail::hard_scan_batch_split(detail::kernels(), q.data(), nq, span, parts);

  const std::size_t dv = impl_->value_dim();
  HardBatchResult result;
  result.ids.resize(nq);
  result.scores.resize(nq);
  result.values.resize(nq * dv);
  for (std::size_t b = 0; b < nq; ++b) {
    if (best[b].row == detail::ArgMax::kNoRow)
      throw Error(ErrorCode::numeric_overflow, "every score is -inf; the keys or the query are too large");
    result.ids[b] = span.ids[best[b].row];
    result.scores[b] = scale * best[b].dot;
    std::copy_n(span.values + best[b].row * dv, dv, result.values.begin() + static_cast<std::ptrdiff_t>(b * dv));
  }
  return result;
}

}  // namespace softkv
