// Bringing the index fields of configurations written before ConfigLimits existed into range.
#pragma once

#include <string>

#include "softkv/types.hpp"

namespace softkv::detail {

/// The configuration with its index tuning fields (hnsw_m, hnsw_ef_construction, ivf_nlist,
/// ivf_train_size, rebuild_fraction) moved to the nearest value check_config accepts; the fields that
/// shape the data (dimensions, metric, scale, index kind) are left alone. For loaders: a directory
/// written before the limits existed still opens (its index is built with the fitted values).
/// `changed` (optional) receives what was moved, empty when nothing was.
CollectionConfig fit_index_limits(CollectionConfig config, std::string* changed = nullptr);

}  // namespace softkv::detail
