// Collection: dense row-major storage with an id map, validated writes, exact scans and indexed pruning.
#include "softkv/collection.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <shared_mutex>  // std::shared_lock
#include <string>
#include <unordered_map>

#include "collection_impl.hpp"
#include "pruning.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"
#include "softkv/error.hpp"
#include "thread_pool.hpp"
#include "validate.hpp"
#include "writer_first_mutex.hpp"

namespace softkv {


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

std::size_t Collection::size_hint() const noexcept { return impl_->size_hint_.load(std::memory_order_relaxed); }

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
  std::vector<float> buffer;
  std::size_t n = 0;
  const std::span<const float> prepared = impl_->validate_rows(keys, values, nullptr, buffer, n);
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
  std::vector<float> buffer;
  std::size_t n = 0;
  const std::span<const float> prepared = impl_->validate_rows(keys, values, &ids, buffer, n);
  impl_->store_rows(ids, prepared.data(), values.data());
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
  s.size_hint_.store(s.ids_.size(), std::memory_order_relaxed);
  if (s.index_) {
    s.index_->erase(id, s.span());
    s.start_build_if_due();
  }
}

void Collection::wait_until_indexed() const {
  std::unique_lock lock(impl_->build_mutex_);
  impl_->build_done_.wait(lock, [&] { return !impl_->building_; });
}

bool Collection::index_building() const {
  std::lock_guard lock(impl_->build_mutex_);
  return impl_->building_;
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
