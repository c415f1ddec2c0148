// CollectionConfig in bytes: one layout (docs/PROTOCOL.md, "CollectionConfig") for the log and the wire.
#pragma once

#include "softkv/collection.hpp"
#include "storage/bytes.hpp"

namespace softkv::detail {

/// Appends config in the documented layout.
inline void put_config(ByteWriter& w, const CollectionConfig& c) {
  w.put(static_cast<std::uint32_t>(c.dim));
  w.put(static_cast<std::uint32_t>(c.value_dim));
  w.put(static_cast<std::uint8_t>(c.metric));
  w.put(static_cast<std::uint8_t>(c.scale.has_value()));
  w.put(c.scale.value_or(0.0f));
  w.put(static_cast<std::uint8_t>(c.index.kind));
  w.put(static_cast<std::uint32_t>(c.index.hnsw_m));
  w.put(static_cast<std::uint32_t>(c.index.hnsw_ef_construction));
  w.put(static_cast<std::uint32_t>(c.index.ivf_nlist));
  w.put(static_cast<std::uint64_t>(c.index.ivf_train_size));
  w.put(static_cast<std::uint64_t>(c.index.auto_threshold));
  w.put(c.index.rebuild_fraction);
}

/// Reads a config written by put_config (the Collection constructor validates its values).
inline CollectionConfig get_config(ByteReader& r) {
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

}  // namespace softkv::detail
