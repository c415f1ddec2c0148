// Collection: dense row-major storage with an id map and validated writes (queries: collection_query.cpp).
#include "softkv/collection.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <shared_mutex>  // std::shared_lock
#include <string>
#include <unordered_map>

#include "collection_impl.hpp"
#include "scan.hpp"
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

}  // namespace softkv
