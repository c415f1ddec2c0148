// check_config: the one table of CollectionConfig limits, used at creation and by every loader.
#include <cmath>
#include <string>

#include "config_limits.hpp"
#include "softkv/collection.hpp"
#include "softkv/error.hpp"
#include "validate.hpp"

namespace softkv {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw Error(ErrorCode::invalid_argument, what);
}

std::string range(const char* field, std::size_t value, std::size_t lo, std::size_t hi) {
  return std::string(field) + " must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(value);
}

}  // namespace

void check_config(const CollectionConfig& c) {
  using L = ConfigLimits;
  require(c.dim >= 1 && c.dim <= L::kMaxDimension, range("dim", c.dim, 1, L::kMaxDimension));
  require(c.value_dim >= 1 && c.value_dim <= L::kMaxDimension, range("value_dim", c.value_dim, 1, L::kMaxDimension));
  require(c.metric == Metric::dot || c.metric == Metric::cosine, "unknown metric " + std::to_string(int(c.metric)));
  require(!c.scale || (std::isfinite(*c.scale) && *c.scale > 0.0f), "the default scale must be finite and > 0");
  require(c.key_precision <= Precision::i8, "unknown key_precision " + std::to_string(int(c.key_precision)));
  require(c.value_precision <= Precision::bf16,
          c.value_precision == Precision::i8 ? std::string("value_precision i8 is not supported (keys only): use f16 or bf16")
                                             : "unknown value_precision " + std::to_string(int(c.value_precision)));
  require(c.heads >= 1 && c.heads <= L::kMaxHeads, range("heads", c.heads, 1, L::kMaxHeads));
  require(c.dim % c.heads == 0 && c.value_dim % c.heads == 0,
          "heads (" + std::to_string(c.heads) + ") must divide dim (" + std::to_string(c.dim) + ") and value_dim (" +
              std::to_string(c.value_dim) + ")");
  require(c.heads == 1 || c.index.kind == IndexKind::exact,
          "a multi-head collection (heads > 1) has no pruning index: index kind must be exact");
  const IndexConfig& i = c.index;
  require(i.kind <= IndexKind::automatic, "unknown index kind " + std::to_string(int(i.kind)));
  // Upper bounds hold whatever the kind (the values are stored and encoded); the lower bounds only
  // where the kind uses the field, so a client may send zeros for an index it does not ask for.
  const bool hnsw = i.kind == IndexKind::hnsw;
  require(i.hnsw_m <= L::kMaxHnswM && (!hnsw || i.hnsw_m >= 2), range("hnsw_m", i.hnsw_m, hnsw ? 2 : 0, L::kMaxHnswM));
  require(i.hnsw_ef_construction <= L::kMaxHnswEfConstruction && (!hnsw || i.hnsw_ef_construction >= 1),
          range("hnsw_ef_construction", i.hnsw_ef_construction, hnsw ? 1 : 0, L::kMaxHnswEfConstruction));
  require(i.ivf_nlist <= L::kMaxIvfNlist, range("ivf_nlist", i.ivf_nlist, 0, L::kMaxIvfNlist));
  require(i.ivf_train_size <= L::kMaxIvfTrainSize, range("ivf_train_size", i.ivf_train_size, 0, L::kMaxIvfTrainSize));
  // k-means needs at least one training entry per list.
  require(i.ivf_train_size == 0 || i.ivf_nlist == 0 || i.ivf_train_size >= i.ivf_nlist,
          "ivf_train_size (" + std::to_string(i.ivf_train_size) + ") must be 0 or >= ivf_nlist (" + std::to_string(i.ivf_nlist) +
              "): IVF training needs one entry per list");
  require(std::isfinite(i.rebuild_fraction) && i.rebuild_fraction > 0.0f && i.rebuild_fraction <= L::kMaxRebuildFraction,
          "rebuild_fraction must lie in (0, 1000], got " + detail::float_text(i.rebuild_fraction));
}

namespace detail {

CollectionConfig fit_index_limits(CollectionConfig c, std::string* changed) {
  using L = ConfigLimits;
  std::string note;
  auto fit = [&](auto& field, auto lo, auto hi, const char* name) {
    const auto was = field;
    if (field < lo) field = lo;
    if (field > hi) field = hi;
    if (field != was) note += std::string(note.empty() ? "" : ", ") + name + " " + std::to_string(was) + " -> " + std::to_string(field);
  };
  IndexConfig& i = c.index;
  const bool hnsw = i.kind == IndexKind::hnsw;
  fit(i.hnsw_m, std::size_t{hnsw ? 2u : 0u}, L::kMaxHnswM, "hnsw_m");
  fit(i.hnsw_ef_construction, std::size_t{hnsw ? 1u : 0u}, L::kMaxHnswEfConstruction, "hnsw_ef_construction");
  fit(i.ivf_nlist, std::size_t{0}, L::kMaxIvfNlist, "ivf_nlist");
  fit(i.ivf_train_size, std::size_t{0}, L::kMaxIvfTrainSize, "ivf_train_size");
  if (i.ivf_train_size != 0 && i.ivf_train_size < i.ivf_nlist) fit(i.ivf_train_size, i.ivf_nlist, L::kMaxIvfTrainSize, "ivf_train_size");
  if (!(std::isfinite(i.rebuild_fraction) && i.rebuild_fraction > 0.0f)) {
    note += std::string(note.empty() ? "" : ", ") + "rebuild_fraction " + detail::float_text(i.rebuild_fraction) + " -> 0.25";
    i.rebuild_fraction = 0.25f;
  }
  fit(i.rebuild_fraction, 0.0f, L::kMaxRebuildFraction, "rebuild_fraction");
  if (changed != nullptr) *changed = std::move(note);
  return c;
}

}  // namespace detail
}  // namespace softkv
