// Database: the registry of named collections and the one Mutation path. Every write is checked
// against the current state, logged and applied by the journal, through the same apply() that replays
// the log at open.
#include "ids.hpp"
#include "softkv/database.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

#include "codec/records.hpp"
#include "config_limits.hpp"
#include "overloaded.hpp"
#include "precision.hpp"
#include "softkv/error.hpp"
#include "storage/directory.hpp"
#include "storage/file.hpp"
#include "storage/journal.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

constexpr const char* kLockFile = "LOCK";

void check_name(std::string_view name) {
  const bool ok = !name.empty() && name.size() <= 64 && name.front() != '.' &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                           c == '-' || c == '.';
                  });
  if (!ok)
    throw Error(ErrorCode::invalid_argument, "collection name '" + std::string(name) +
                                                 "' must be 1-64 characters of [A-Za-z0-9_.-], not starting with '.'");
}

detail::File lock_directory(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot create data directory " + dir.string() + ": " + ec.message());
  detail::File f(dir / kLockFile, O_RDWR | O_CREAT);
  f.lock_exclusive();
  return f;
}

}  // namespace

class Database::Impl {
 public:
  Impl(const std::filesystem::path& dir, DatabaseOptions options) : dir_(dir), options_(std::move(options)), lock_(lock_directory(dir)) {
    if (!options_.log) options_.log = [](std::string_view line) { std::fprintf(stderr, "softkv: %.*s\n", int(line.size()), line.data()); };
    const detail::RecoveredLog recovered = detail::recover_directory(dir_, options_.repair, recovery_handlers());
    journal_ = std::make_unique<detail::Journal>(
        dir_, options_, recovered,
        detail::Journal::Hooks{[this](const detail::Mutation& m) { apply(m); }, [this] { return capture(); }, options_.log});
  }

  // ---- the registry ----
  std::shared_ptr<Collection> find_or_null(std::string_view name) const {
    std::shared_lock lock(map_mutex_);
    const auto it = collections_.find(name);
    return it == collections_.end() ? nullptr : it->second;
  }

  std::shared_ptr<Collection> find(std::string_view name) const {
    auto c = find_or_null(name);
    if (!c) throw Error(ErrorCode::unknown_collection, "no collection is named '" + std::string(name) + "'");
    return c;
  }

  // A collection looked up before the write lock (to validate rows outside it) must still be the one
  // under that name when the write is logged: a drop (and a create of the same name) in between makes
  // the write fail with unknown_collection instead of logging a record that applies elsewhere or nowhere.
  void require_current(std::string_view name, const std::shared_ptr<Collection>& c) const {
    if (find_or_null(name) != c) throw Error(ErrorCode::unknown_collection, "collection '" + std::string(name) + "' was dropped");
  }

  // The one apply: live writes (after logging) and replay at open.
  void apply(const detail::Mutation& m) {
    std::visit(detail::Overloaded{
                   [&](const detail::mutation::Create& c) {
                     // Live creates were checked; a record from before ConfigLimits may need fitting.
                     std::string changed;
                     auto collection = std::make_shared<Collection>(detail::fit_index_limits(c.config, &changed));
                     collection->set_coalescing(options_.coalesce);
                     if (!changed.empty()) options_.log("'" + c.name + "': index settings brought into range: " + changed);
                     std::unique_lock lock(map_mutex_);
                     collections_[c.name] = std::move(collection);
                   },
                   [&](const detail::mutation::Drop& d) {
                     std::unique_lock lock(map_mutex_);
                     collections_.erase(d.name);
                   },
                   [&](const detail::mutation::Upsert& u) {
                     const auto c = find(u.name);
                     if (!u.keys_as_given || c->config().metric != Metric::cosine) return c->apply(u.rows);
                     // A record from before format 2 holds cosine keys as the client gave them: they are
                     // normalised the way that release did, so the replay stores the same bits.
                     Rows rows = u.rows;
                     detail::normalise_rows_v1(rows.keys, c->config().dim, "key");
                     c->apply(rows);
                   },
                   [&](const detail::mutation::Remove& r) { find(r.name)->remove_batch(r.ids); },
               },
               m);
  }

  // Every collection's image, under the journal's write lock (so at one sequence number).
  detail::SnapshotCapture capture() const {
    detail::SnapshotCapture capture;
    std::shared_lock lock(map_mutex_);
    for (const auto& [name, c] : collections_) {
      CollectionImage image = c->image();
      if (!image.index.empty()) capture.indexes[name] = std::move(image.index);
      image.index.clear();
      capture.image.collections.push_back({name, std::move(image)});
    }
    return capture;
  }

  detail::RecoveryHandlers recovery_handlers() {
    detail::RecoveryHandlers h;
    h.log = options_.log;
    h.restore = [this](std::string name, CollectionImage image) {
      std::string note;
      auto c = std::make_shared<Collection>(Collection::restore(std::move(image), &note));
      c->set_coalescing(options_.coalesce);
      if (!note.empty()) options_.log("'" + name + "': " + note);
      collections_[std::move(name)] = std::move(c);
    };
    h.replay = [this](const detail::Mutation& m) { apply(m); };
    h.dimensions = [this](const std::string& name) -> std::optional<std::pair<std::size_t, std::size_t>> {
      const auto c = find_or_null(name);
      if (!c) return std::nullopt;
      return std::pair{c->config().dim, c->config().value_dim};
    };
    return h;
  }

  std::filesystem::path dir_;
  DatabaseOptions options_;
  detail::File lock_;                    // the directory's LOCK file, held while open
  mutable std::shared_mutex map_mutex_;  // the collections map (queries hold it only to look up)
  std::map<std::string, std::shared_ptr<Collection>, std::less<>> collections_;
  std::unique_ptr<detail::Journal> journal_;  // last: destroyed (background stopped, log synced) first
};

Database::Database(const std::filesystem::path& dir, DatabaseOptions options)
    : impl_(std::make_unique<Impl>(dir, std::move(options))) {}

Database::~Database() = default;

void Database::check_name(std::string_view name) { softkv::check_name(name); }

void Database::create_collection(std::string_view name, const CollectionConfig& config) {
  check_name(name);
  check_config(config);
  impl_->journal_->commit([&]() -> detail::Mutation {
    if (impl_->find_or_null(name)) throw Error(ErrorCode::collection_exists, "a collection named '" + std::string(name) + "' exists");
    return detail::mutation::Create{std::string(name), config};
  });
}

void Database::drop_collection(std::string_view name) {
  impl_->journal_->commit([&]() -> detail::Mutation {
    (void)impl_->find(name);
    return detail::mutation::Drop{std::string(name)};
  });
}

std::vector<std::string> Database::list_collections() const {
  std::shared_lock lock(impl_->map_mutex_);
  std::vector<std::string> names;
  for (const auto& entry : impl_->collections_) names.push_back(entry.first);
  return names;
}

bool Database::has_collection(std::string_view name) const { return impl_->find_or_null(name) != nullptr; }

std::shared_ptr<const Collection> Database::collection(std::string_view name) const { return impl_->find(name); }

CollectionStats Database::stats(std::string_view name) const {
  const auto c = impl_->find(name);
  CollectionStats s;
  s.name = name;
  s.size = c->size();
  s.dim = c->config().dim;
  s.value_dim = c->config().value_dim;
  s.metric = c->config().metric;
  s.index = c->config().index.kind;
  s.heads = c->config().heads;
  // Compact storage: elements at their precision, plus one float scale per row for i8 keys; and the tag.
  const Precision kp = c->config().key_precision, vp = c->config().value_precision;
  s.key_precision = kp;
  s.value_precision = vp;
  s.bytes_in_memory = s.size * (8 + 8 + s.dim * detail::element_bytes(kp) + (kp == Precision::i8 ? 4 : 0) +
                                s.value_dim * detail::element_bytes(vp));  // id, tag, key, value
  s.bytes_on_disk = impl_->journal_->snapshot_bytes(s.name);
  return s;
}

std::vector<std::uint64_t> Database::add(std::string_view name, std::span<const float> keys, std::span<const float> values,
                                        std::span<const std::uint64_t> tags) {
  const auto c = impl_->find(name);
  Rows rows = c->prepare({}, keys, values, tags);  // validated and normalised once, outside the write lock
  const std::size_t n = rows.keys.size() / c->config().dim;
  std::vector<std::uint64_t> ids;
  impl_->journal_->commit([&]() -> detail::Mutation {
    impl_->require_current(name, c);
    rows.ids = detail::next_ids(c->next_id(), n);  // next_id changes only under this lock
    ids = rows.ids;
    return detail::mutation::Upsert{std::string(name), std::move(rows)};
  });
  return ids;
}

void Database::upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                      std::span<const float> values, std::span<const std::uint64_t> tags) {
  const auto c = impl_->find(name);
  Rows rows = c->prepare(ids, keys, values, tags);
  if (rows.ids.size() * c->config().dim != rows.keys.size())  // no ids for n > 0 rows (prepare reads that as an add)
    throw Error(ErrorCode::dimension_mismatch,
                "0 ids but " + std::to_string(rows.keys.size() / c->config().dim) + " keys");
  impl_->journal_->commit([&]() -> detail::Mutation {
    impl_->require_current(name, c);
    return detail::mutation::Upsert{std::string(name), std::move(rows)};
  });
}

void Database::remove(std::string_view name, std::span<const std::uint64_t> ids) {
  const auto c = impl_->find(name);
  impl_->journal_->commit([&]() -> detail::Mutation {  // all or nothing: every id present, once
    impl_->require_current(name, c);
    detail::check_distinct(ids);
    for (std::uint64_t id : ids)
      if (!c->contains(id)) throw Error(ErrorCode::unknown_id, "no entry has id " + std::to_string(id));
    return detail::mutation::Remove{std::string(name), {ids.begin(), ids.end()}};
  });
}

void Database::snapshot() { impl_->journal_->snapshot(); }

void Database::sync() { impl_->journal_->sync(); }

std::uint64_t Database::last_sequence() const { return impl_->journal_->last_sequence(); }

}  // namespace softkv
