// CollectionConfig codec: fixed-width little-endian fields, refusing values that do not fit rather than
// truncating; the extension groups of every form decided here alone.
#include "codec/config.hpp"

#include <limits>
#include <string>

namespace softkv::detail {
namespace {

std::uint32_t narrow(std::size_t v, const char* field) {
  if (v > std::numeric_limits<std::uint32_t>::max())
    throw Error(ErrorCode::invalid_argument, std::string(field) + " = " + std::to_string(v) + " does not fit its 32-bit field");
  return static_cast<std::uint32_t>(v);
}

constexpr int kGroups = 2;  // extension groups defined so far (config.hpp lists them)

// Whether group g (1-based) of c differs from a default config's.
bool group_set(const CollectionConfig& c, int g) {
  switch (g) {
    case 1: return c.key_precision != Precision::f32 || c.value_precision != Precision::f32;
    case 2: return c.heads != 1;
    default: return false;
  }
}

void put_group(ByteWriter& w, const CollectionConfig& c, int g) {
  switch (g) {
    case 1:
      w.put(static_cast<std::uint8_t>(c.key_precision));
      w.put(static_cast<std::uint8_t>(c.value_precision));
      return;
    case 2: w.put(narrow(c.heads, "heads")); return;
    default: return;
  }
}

void get_group(ByteReader& r, CollectionConfig& c, int g) {
  switch (g) {
    case 1:
      c.key_precision = static_cast<Precision>(r.get<std::uint8_t>("key_precision"));
      c.value_precision = static_cast<Precision>(r.get<std::uint8_t>("value_precision"));
      return;
    case 2: c.heads = r.get<std::uint32_t>("heads"); return;
    default: return;
  }
}

// The groups a form always writes and its readers require (0..kGroups); -1: the form has no tail at all.
int required_groups(ConfigForm form) {
  switch (form) {
    case ConfigForm::wire: return kGroups;
    case ConfigForm::snapshot: return 1;
    case ConfigForm::log_record: return 0;
    case ConfigForm::wire_v1:
    case ConfigForm::snapshot_v2: return -1;
  }
  return -1;
}

}  // namespace

void put_config(ByteWriter& w, const CollectionConfig& c, ConfigForm form) {
  w.put(narrow(c.dim, "dim"));
  w.put(narrow(c.value_dim, "value_dim"));
  w.put(static_cast<std::uint8_t>(c.metric));
  w.put(static_cast<std::uint8_t>(c.scale.has_value()));
  w.put(c.scale.value_or(0.0f));
  w.put(static_cast<std::uint8_t>(c.index.kind));
  w.put(narrow(c.index.hnsw_m, "hnsw_m"));
  w.put(narrow(c.index.hnsw_ef_construction, "hnsw_ef_construction"));
  w.put(narrow(c.index.ivf_nlist, "ivf_nlist"));
  w.put(static_cast<std::uint64_t>(c.index.ivf_train_size));
  w.put(static_cast<std::uint64_t>(c.index.auto_threshold));
  w.put(c.index.rebuild_fraction);
  const int required = required_groups(form);
  if (required < 0) return;
  int last = required;  // the last group written: every required one, and up to the last one set
  for (int g = required + 1; g <= kGroups; ++g)
    if (group_set(c, g)) last = g;
  for (int g = 1; g <= last; ++g) put_group(w, c, g);
}

CollectionConfig get_config(ByteReader& r, ConfigForm form) {
  CollectionConfig c;
  c.dim = r.get<std::uint32_t>("dim");
  c.value_dim = r.get<std::uint32_t>("value_dim");
  c.metric = static_cast<Metric>(r.get<std::uint8_t>("metric"));
  const bool has_scale = r.get<std::uint8_t>("scale flag") != 0;
  const float scale = r.get<float>("scale");
  if (has_scale) c.scale = scale;
  c.index.kind = static_cast<IndexKind>(r.get<std::uint8_t>("index kind"));
  c.index.hnsw_m = r.get<std::uint32_t>("hnsw_m");
  c.index.hnsw_ef_construction = r.get<std::uint32_t>("hnsw_ef_construction");
  c.index.ivf_nlist = r.get<std::uint32_t>("ivf_nlist");
  c.index.ivf_train_size = r.get<std::uint64_t>("ivf_train_size");
  c.index.auto_threshold = r.get<std::uint64_t>("auto_threshold");
  c.index.rebuild_fraction = r.get<float>("rebuild_fraction");
  const int required = required_groups(form);
  if (required < 0) return c;
  for (int g = 1; g <= kGroups && (g <= required || r.remaining() != 0); ++g) get_group(r, c, g);
  return c;
}

}  // namespace softkv::detail
