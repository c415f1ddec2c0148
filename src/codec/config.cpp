// CollectionConfig codec: fixed-width little-endian fields, refusing values that do not fit rather than truncating.
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

}  // namespace

void put_config(ByteWriter& w, const CollectionConfig& c) {
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
}

CollectionConfig get_config(ByteReader& r) {
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
  return c;
}

void put_config_precision(ByteWriter& w, const CollectionConfig& c) {
  w.put(static_cast<std::uint8_t>(c.key_precision));
  w.put(static_cast<std::uint8_t>(c.value_precision));
}

void get_config_precision(ByteReader& r, CollectionConfig& c) {
  c.key_precision = static_cast<Precision>(r.get<std::uint8_t>("key_precision"));
  c.value_precision = static_cast<Precision>(r.get<std::uint8_t>("value_precision"));
}

void put_config_heads(ByteWriter& w, const CollectionConfig& c) { w.put(narrow(c.heads, "heads")); }

void get_config_heads(ByteReader& r, CollectionConfig& c) { c.heads = r.get<std::uint32_t>("heads"); }

}  // namespace softkv::detail
