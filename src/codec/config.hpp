// CollectionConfig in bytes: the one layout (docs/PROTOCOL.md, "CollectionConfig") of the log, snapshots and the wire.
#pragma once

#include "codec/bytes.hpp"
#include "softkv/collection.hpp"

namespace softkv::detail {

/// Appends config in the documented layout; throws Error(invalid_argument) for a field too wide for it.
void put_config(ByteWriter& w, const CollectionConfig& c);

/// Reads a config written by put_config. The values are not range-checked here: check_config does
/// that (every loader calls it through the Collection constructor).
CollectionConfig get_config(ByteReader& r);

}  // namespace softkv::detail
