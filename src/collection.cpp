// Collection: the state side (validated writes in two doors, images for snapshots, background index
// builds); the queries over its rows are in collection_query.cpp and src/query/.
#include "softkv/collection.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <new>
#include <shared_mutex>  // std::shared_lock
#include <string>
#include <unordered_map>

#include "assert.hpp"
#include "collection_impl.hpp"
#include "ids.hpp"
#include "mask.hpp"
#include "scan.hpp"
#include "score_range.hpp"
#include "softkv/error.hpp"
#include "thread_pool.hpp"
#include "validate.hpp"
#include "writer_first_mutex.hpp"

namespace softkv {

// ---------------------------------------------------------------------------------------------
// detail::CollectionImpl: writes and images

detail::CollectionImpl::CollectionImpl(const CollectionConfig& config)
    : config_(config),
      keys_(config.key_precision, config.dim),
      values_(config.value_precision, config.value_dim),
      index_(detail::make_pruning_index(config)) {}

detail::CollectionImpl::~CollectionImpl() {
  if (builder_.joinable()) builder_.join();
}

std::optional<std::size_t> detail::CollectionImpl::row_of(std::uint64_t id) const {
  const std::uint64_t* row = slot_of_.find(id);
  if (row == nullptr) return std::nullopt;
  return static_cast<std::size_t>(*row);
}

std::span<const float> detail::CollectionImpl::prepare_keys(std::span<const float> keys, std::vector<float>& buffer,
                                                      std::string_view what) const {
  if (config_.metric != Metric::cosine) return keys;
  buffer.assign(keys.begin(), keys.end());
  detail::normalise_rows(buffer, dim(), what, heads());  // each head's slice on its own (one slice for h = 1)
  return buffer;
}

Rows detail::CollectionImpl::prepare(std::span<const std::uint64_t> ids, std::span<const float> keys,
                               std::span<const float> values, std::span<const std::uint64_t> tags) const {
  const std::size_t n = detail::row_count(keys.size(), dim(), "keys");
  const std::size_t nv = detail::row_count(values.size(), value_dim(), "values");
  if (n != nv) throw Error(ErrorCode::dimension_mismatch, std::to_string(n) + " keys but " + std::to_string(nv) + " values");
  if (!ids.empty() && ids.size() != n)
    throw Error(ErrorCode::dimension_mismatch, std::to_string(ids.size()) + " ids but " + std::to_string(n) + " keys");
  if (!tags.empty() && tags.size() != n)
    throw Error(ErrorCode::dimension_mismatch, std::to_string(tags.size()) + " tags but " + std::to_string(n) + " keys");
  for (std::uint64_t id : ids)
    if (id == kReservedId) throw Error(ErrorCode::invalid_argument, "id 2^64-1 is reserved");
  detail::check_finite(keys, "keys", dim());
  detail::check_finite(values, "values", value_dim());
  Rows rows;
  rows.ids.assign(ids.begin(), ids.end());
  std::vector<float> buffer;
  const std::span<const float> stored = prepare_keys(keys, buffer, "key");
  if (stored.data() == buffer.data()) rows.keys = std::move(buffer);
  else rows.keys.assign(stored.begin(), stored.end());
  rows.values.assign(values.begin(), values.end());
  // Compact storage: a value its precision cannot hold is refused here, before the log sees it
  // (cosine keys are checked after normalising, which keeps them within every range).
  detail::check_range(config_.key_precision, rows.keys.data(), n, dim(), "keys");
  detail::check_range(config_.value_precision, rows.values.data(), n, value_dim(), "values");
  if (std::any_of(tags.begin(), tags.end(), [](std::uint64_t t) { return t != 0; })) rows.tags.assign(tags.begin(), tags.end());
  return rows;
}

void detail::CollectionImpl::put(std::uint64_t id, const float* key, const float* value, std::uint64_t tag) {
  SOFTKV_ASSERT(id != kReservedId, "rows reach put prepared: id 2^64-1 is refused there");  // (the id map's empty mark)
  std::size_t slot;
  if (const std::uint64_t* row = slot_of_.find(id); row != nullptr) {
    slot = static_cast<std::size_t>(*row);
  } else {
    slot = ids_.size();
    ids_.push_back(id);
    tags_.push_back(tag);
    zones_.set(slot, tag);
    keys_.resize(slot + 1);
    values_.resize(slot + 1);
    slot_of_.emplace(id, slot);
  }
  keys_.set(slot, key);
  values_.set(slot, value);
  chunks_.touch(slot);
  tag_totals_.touch(tags_[slot], slot);  // (the tag the row held: the new one's when it is new)
  tag_totals_.touch(tag, slot);
  note_value(value);
  if (tags_[slot] != tag) zones_.set(slot, tag);
  tags_[slot] = tag;
  next_id_ = std::max(next_id_, id + 1);
}

// Rows as stored, gathered for ValueMoments::update with one sign and handed over a few thousand at a time
// (and at the end of the write).
class detail::CollectionImpl::MomentRows {
 public:
  MomentRows(const CollectionImpl& impl, float sign) : impl_(impl), sign_(sign) {}
  ~MomentRows() { flush(); }
  MomentRows(const MomentRows&) = delete;
  MomentRows& operator=(const MomentRows&) = delete;
  // Row `row` as stored now.
  void add(std::size_t row) {
    const std::size_t d = impl_.dim(), dv = impl_.value_dim();
    keys_.resize((count_ + 1) * d);
    values_.resize((count_ + 1) * dv);
    impl_.keys_.get(row, keys_.data() + count_ * d);
    impl_.values_.get(row, values_.data() + count_ * dv);
    if (++count_ == kRows) flush();
  }

 private:
  static constexpr std::size_t kRows = 4096;
  void flush() noexcept {
    try {
      impl_.moments_.update(detail::kernels(), keys_.data(), values_.data(), count_, impl_.dim(), impl_.value_dim(), sign_);
    } catch (...) {  // (out of memory: the totals are summed afresh by the next query that needs them)
      impl_.moments_.clear();
    }
    count_ = 0;
    keys_.clear();
    values_.clear();
  }
  const CollectionImpl& impl_;
  float sign_;
  std::size_t count_ = 0;
  std::vector<float> keys_, values_;
};

void detail::CollectionImpl::store(std::span<const std::uint64_t> ids, const float* keys, const float* values,
                             std::span<const std::uint64_t> tags) {
  const std::size_t n = ids.size();
  // Room for n more rows, growing geometrically: reserving exactly size + n on every batch would copy
  // the whole collection on every write (quadratic in the number of batches, also at log replay).
  const std::size_t need = ids_.size() + n;
  if (need > ids_.capacity()) {
    const std::size_t room = std::max(need, ids_.capacity() + ids_.capacity() / 2);
    ids_.reserve(room);
    tags_.reserve(room);
    keys_.reserve(room);
    values_.reserve(room);
    slot_of_.reserve(room);
  }
  if (!moments_.kept()) {
    for (std::size_t r = 0; r < n; ++r) put(ids[r], keys + r * dim(), values + r * value_dim(), tags.empty() ? 0 : tags[r]);
  } else {  // the totals of error_target's control variates: the rows replaced go out, the rows stored come in
    try {
      MomentRows out(*this, -1.0f), in(*this, 1.0f);
      for (std::size_t r = 0; r < n; ++r) {
        if (const std::uint64_t* row = slot_of_.find(ids[r]); row != nullptr) out.add(static_cast<std::size_t>(*row));
        put(ids[r], keys + r * dim(), values + r * value_dim(), tags.empty() ? 0 : tags[r]);
        in.add(static_cast<std::size_t>(*slot_of_.find(ids[r])));
      }
    } catch (...) {  // (a row stored but not counted: the totals no longer match; summed afresh when next asked)
      moments_.clear();
      throw;
    }
  }
  size_hint_.store(ids_.size(), std::memory_order_relaxed);
  if (!index_) return;
  if (config_.key_precision == Precision::f32) {
    index_->put(ids, keys, span());
    return start_build_if_due();
  }
  // The index keeps float32 copies of the keys as stored (rounded), so it ranks what the scans score.
  std::vector<float> rounded(n * dim());
  for (std::size_t r = 0; r < n; ++r) keys_.get(*row_of(ids[r]), rounded.data() + r * dim());
  index_->put(ids, rounded.data(), span());
  start_build_if_due();
}

void detail::CollectionImpl::apply(const Rows& rows) {
  const std::size_t n = rows.ids.size();
  if (rows.keys.size() != n * dim() || rows.values.size() != n * value_dim() || (!rows.tags.empty() && rows.tags.size() != n))
    throw Error(ErrorCode::internal, "rows of " + std::to_string(rows.keys.size()) + " key and " +
                                         std::to_string(rows.values.size()) + " value floats for " + std::to_string(n) +
                                         " ids do not fit d = " + std::to_string(dim()) + ", dv = " + std::to_string(value_dim()));
  std::unique_lock lock(mutex_);
  store(rows.ids, rows.keys.data(), rows.values.data(), rows.tags);
}

std::vector<std::uint64_t> detail::CollectionImpl::add(Rows rows) {
  const std::size_t n = rows.keys.size() / dim();
  std::unique_lock lock(mutex_);
  rows.ids = detail::next_ids(next_id_, n);
  store(rows.ids, rows.keys.data(), rows.values.data(), rows.tags);
  return std::move(rows.ids);
}

void detail::CollectionImpl::remove(std::span<const std::uint64_t> ids) {
  std::unique_lock lock(mutex_);
  detail::check_distinct(ids);  // all or nothing: every id present, once
  for (std::uint64_t id : ids)
    if (!slot_of_.contains(id)) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
  std::optional<MomentRows> out;
  if (moments_.kept()) out.emplace(*this, -1.0f);
  for (std::uint64_t id : ids) {
    const auto slot = static_cast<std::size_t>(*slot_of_.find(id));
    if (out) out->add(slot);
    const std::size_t last = ids_.size() - 1;
    chunks_.touch(slot);
    chunks_.touch(last);
    tag_totals_.touch(tags_[slot], slot);
    if (slot != last) {
      tag_totals_.moved(tags_[last], last, slot);
      keys_.copy_row(last, slot);
      values_.copy_row(last, slot);
      ids_[slot] = ids_[last];
      tags_[slot] = tags_[last];
      zones_.set(slot, tags_[last]);
      slot_of_.set(ids_[slot], slot);
    }
    ids_.pop_back();
    tags_.pop_back();
    zones_.shrink(tags_.size());
    keys_.resize(last);
    values_.resize(last);
    slot_of_.erase(id);
    if (index_) index_->erase(id, span());
  }
  out.reset();  // (its rows go out of the totals)
  size_hint_.store(ids_.size(), std::memory_order_relaxed);
  start_build_if_due();
}

std::uint64_t detail::CollectionImpl::next_id() const {
  std::shared_lock lock(mutex_);
  return next_id_;
}

CollectionImage detail::CollectionImpl::image() const {
  CollectionImage image;
  image.config = config_;
  std::shared_lock lock(mutex_);
  image.next_id = next_id_;
  image.rows.ids = ids_;
  const std::size_t n = ids_.size();
  if (std::any_of(tags_.begin(), tags_.end(), [](std::uint64_t t) { return t != 0; })) image.rows.tags = tags_;
  image.rows.keys.resize(n * dim());
  image.rows.values.resize(n * value_dim());
  for (std::size_t r = 0; r < n; ++r) {
    keys_.get(r, image.rows.keys.data() + r * dim());
    values_.get(r, image.rows.values.data() + r * value_dim());
  }
  if (index_) image.index = index_->save();
  return image;
}

std::string detail::CollectionImpl::restore(CollectionImage image) {
  Rows& rows = image.rows;
  const std::size_t n = rows.ids.size();
  if (rows.keys.size() != n * dim() || rows.values.size() != n * value_dim() || (!rows.tags.empty() && rows.tags.size() != n))
    throw Error(ErrorCode::corrupt_file, "the image's rows do not fit its dimensions");
  std::unique_lock lock(mutex_);
  slot_of_.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (rows.ids[i] >= image.next_id)
      throw Error(ErrorCode::corrupt_file, "id " + std::to_string(rows.ids[i]) + " is at or above the id counter " +
                                               std::to_string(image.next_id));
    if (!slot_of_.emplace(rows.ids[i], i))
      throw Error(ErrorCode::corrupt_file, "id " + std::to_string(rows.ids[i]) + " appears twice");
  }
  // Images hold rows as stored, which encode back to the same bits; anything else must still fit the range.
  try {
    detail::check_range(config_.key_precision, rows.keys.data(), n, dim(), "keys");
    detail::check_range(config_.value_precision, rows.values.data(), n, value_dim(), "values");
  } catch (const Error& e) {
    throw Error(ErrorCode::corrupt_file, std::string("the image's ") + e.what());
  }
  ids_ = std::move(rows.ids);
  tags_ = rows.tags.empty() ? std::vector<std::uint64_t>(n, 0) : std::move(rows.tags);
  zones_.rebuild(tags_);
  keys_.resize(n);
  values_.resize(n);
  value_max_ = 0;
  moments_.clear();
  chunks_.clear();
  tag_totals_.clear();
  for (std::size_t r = 0; r < n; ++r) {
    keys_.set(r, rows.keys.data() + r * dim());
    values_.set(r, rows.values.data() + r * value_dim());
    note_value(rows.values.data() + r * value_dim());
  }
  next_id_ = image.next_id;
  size_hint_.store(n, std::memory_order_relaxed);
  if (!index_) return {};
  if (!image.index.empty() && index_->load(image.index, span())) return "loaded its index";
  const std::string why = image.index.empty() ? "no saved index" : "the saved index does not match the entries";
  try {
    index_->build_now(span());
  } catch (const std::exception& e) {  // FAISS or allocation failure: queries scan until a later build succeeds
    return why + "; the index could not be built (" + e.what() + "): queries scan every entry";
  }
  if (!index_->ready()) return {};  // too few entries to build yet (flat needs no build)
  return why + "; rebuilt its index";
}

void detail::CollectionImpl::start_build_if_due() {
  if (!index_ || !index_->build_due()) return;
  std::lock_guard lock(build_mutex_);
  if (building_) return;
  building_ = true;
  if (builder_.joinable()) builder_.join();  // the previous job already finished (building_ was false)
  builder_ = std::thread([this] { run_builds(); });
}

void detail::CollectionImpl::run_builds() {
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

void detail::CollectionImpl::wait_until_indexed() const {
  std::unique_lock lock(build_mutex_);
  build_done_.wait(lock, [&] { return !building_; });
}

bool detail::CollectionImpl::index_building() const {
  std::lock_guard lock(build_mutex_);
  return building_;
}

// ---- query helpers ----

std::vector<float> detail::CollectionImpl::prepare_queries(std::span<const float> queries, std::size_t& count) const {
  count = detail::row_count(queries.size(), dim(), "queries");
  if (count == 0) throw Error(ErrorCode::dimension_mismatch, "queries is empty: give at least one row of d floats");
  detail::check_finite(queries, "query", dim());
  std::vector<float> buffer;
  const std::span<const float> prepared = prepare_keys(queries, buffer, "query");
  if (prepared.data() != buffer.data()) buffer.assign(prepared.begin(), prepared.end());
  return buffer;
}

void detail::CollectionImpl::require_entries() const {
  if (ids_.empty()) throw Error(ErrorCode::empty_collection, "the collection has no entries to query");
}

detail::EligibleRows detail::CollectionImpl::eligible(const QueryOptions& options) const {
  detail::EligibleRows rows = eligible_or_none(options);
  if (rows.count == 0)
    throw Error(ErrorCode::empty_collection, "the query's mask (tags_any, tag_range, exclude_ids) leaves no eligible entry of " +
                                                 std::to_string(ids_.size()));
  return rows;
}

detail::EligibleRows detail::CollectionImpl::eligible_or_none(const QueryOptions& options) const {
  std::vector<std::size_t> excluded;
  excluded.reserve(options.exclude_ids.size());
  for (std::uint64_t id : options.exclude_ids)
    if (const std::uint64_t* row = slot_of_.find(id); row != nullptr) excluded.push_back(static_cast<std::size_t>(*row));
  std::sort(excluded.begin(), excluded.end());
  return detail::eligible_rows(tags_, &zones_, options, excluded);
}

std::size_t detail::CollectionImpl::parts_for(const QueryOptions& options, std::size_t floats_per_row) const {
  return detail::choose_parts(ids_.size(), floats_per_row, options.threads, detail::ThreadPool::shared().concurrency());
}

void detail::CollectionImpl::note_value(const float* value) {
  double largest = 0;
  for (std::size_t i = 0; i < value_dim(); ++i) largest = std::max(largest, std::fabs(static_cast<double>(value[i])));
  // As stored: f16 and bf16 round to nearest, at most 2^-8 of the value above it (an overflow is refused earlier).
  value_max_ = std::max(value_max_, largest * (1 + 0x1p-8));
}

std::vector<std::size_t> detail::CollectionImpl::index_rows(const float* query, float scale, std::size_t k,
                                                     const QueryOptions& options) const {
  const detail::IndexSearch search{.k = k, .ef_search = options.ef_search, .nprobe = options.nprobe,
                                   .parts = parts_for(options, dim())};
  const std::vector<std::uint64_t> ids = index_->search(query, &scale, 1, span(), search).front();
  std::vector<std::size_t> rows;
  rows.reserve(ids.size());
  for (std::uint64_t id : ids) {
    const std::uint64_t* row = slot_of_.find(id);
    SOFTKV_ASSERT(row != nullptr, "the pruning index returns only ids the collection holds");
    rows.push_back(static_cast<std::size_t>(*row));
  }
  return rows;
}

void detail::CollectionImpl::check_lse(double lse) {
  if (lse == -std::numeric_limits<double>::infinity()) throw detail::EveryScoreBelowRange();  // no row weighs anything
  if (!std::isfinite(lse))
    throw Error(ErrorCode::numeric_overflow, "scores left the float range; use a smaller scale or a larger temperature");
}

// ---------------------------------------------------------------------------------------------
// Collection: the public doors

Collection::Collection(const CollectionConfig& config) {
  check_config(config);
  impl_ = std::make_unique<detail::CollectionImpl>(config);
}

Collection::~Collection() = default;
Collection::Collection(Collection&&) noexcept = default;
Collection& Collection::operator=(Collection&&) noexcept = default;

const CollectionConfig& Collection::config() const noexcept { return impl_->config(); }

std::size_t Collection::size_hint() const noexcept { return impl_->size_hint(); }

std::size_t Collection::size() const {
  const auto lock = impl_->read_lock();
  return impl_->rows();
}

std::size_t Collection::eligible_count(const QueryOptions& options) const {
  detail::check_mask(options);
  const auto lock = impl_->read_lock();
  return detail::has_mask(options) ? impl_->eligible_or_none(options).count : impl_->rows();
}

bool Collection::contains(std::uint64_t id) const {
  const auto lock = impl_->read_lock();
  return impl_->row_of(id).has_value();
}

Entry Collection::get(std::uint64_t id) const {
  const auto lock = impl_->read_lock();
  const auto row = impl_->row_of(id);
  if (!row) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
  Entry e;
  e.id = id;
  e.tag = impl_->tag_of_row(*row);
  e.key = impl_->key_of(*row);
  e.value = impl_->value_of(*row);
  return e;
}

std::vector<std::uint64_t> Collection::ids() const {
  const auto lock = impl_->read_lock();
  const detail::RowSpan s = impl_->span();
  return {s.ids, s.ids + s.rows};
}

std::uint64_t Collection::add(std::span<const float> key, std::span<const float> value, std::uint64_t tag) {
  detail::check_dimension(key.size(), impl_->dim(), "key");
  detail::check_dimension(value.size(), impl_->value_dim(), "value");
  return add_batch(key, value, std::span<const std::uint64_t>(&tag, 1)).front();
}

std::vector<std::uint64_t> Collection::add_batch(std::span<const float> keys, std::span<const float> values,
                                                 std::span<const std::uint64_t> tags) {
  return impl_->add(impl_->prepare({}, keys, values, tags));
}

void Collection::upsert(std::uint64_t id, std::span<const float> key, std::span<const float> value, std::uint64_t tag) {
  detail::check_dimension(key.size(), impl_->dim(), "key");
  detail::check_dimension(value.size(), impl_->value_dim(), "value");
  upsert_batch(std::span<const std::uint64_t>(&id, 1), key, value, std::span<const std::uint64_t>(&tag, 1));
}

void Collection::upsert_batch(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                              std::span<const std::uint64_t> tags) {
  const std::size_t n = detail::row_count(keys.size(), impl_->dim(), "keys");
  if (ids.size() != n)  // prepare() reads empty ids as an add
    throw Error(ErrorCode::dimension_mismatch, std::to_string(ids.size()) + " ids but " + std::to_string(n) + " keys");
  impl_->apply(impl_->prepare(ids, keys, values, tags));
}

void Collection::remove(std::uint64_t id) { impl_->remove(std::span<const std::uint64_t>(&id, 1)); }

void Collection::remove_batch(std::span<const std::uint64_t> ids) { impl_->remove(ids); }

Rows Collection::prepare(std::span<const std::uint64_t> ids, std::span<const float> keys, std::span<const float> values,
                         std::span<const std::uint64_t> tags) const {
  return impl_->prepare(ids, keys, values, tags);
}

void Collection::apply(const Rows& rows) { impl_->apply(rows); }

std::uint64_t Collection::next_id() const { return impl_->next_id(); }

CollectionImage Collection::image() const { return impl_->image(); }

Collection Collection::restore(CollectionImage image, std::string* note) {
  Collection c(image.config);
  std::string line = c.impl_->restore(std::move(image));
  if (note != nullptr) *note = std::move(line);
  return c;
}

void Collection::wait_until_indexed() const { impl_->wait_until_indexed(); }

bool Collection::index_building() const { return impl_->index_building(); }

void Collection::set_coalescing(bool on) const noexcept { impl_->set_coalescing(on); }

bool Collection::coalescing() const noexcept { return impl_->coalescing(); }

CoalescingStats Collection::coalescing_stats() const {
  const CoalescingStats soft = impl_->soft_coalescer().stats(), hard = impl_->hard_coalescer().stats();
  return {soft.queries + hard.queries, soft.passes + hard.passes, std::max(soft.max_batch, hard.max_batch)};
}

}  // namespace softkv
