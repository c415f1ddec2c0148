// CollectionConfig in bytes: the one layout (docs/PROTOCOL.md, "CollectionConfig") of the log, snapshots and the wire.
#pragma once

#include "codec/bytes.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

/// Appends config in the documented layout; throws Error(invalid_argument) for a field too wide for it.
void put_config(ByteWriter& w, const CollectionConfig& c);

/// Appends the compact-storage fields (issue 14): key_precision and value_precision, one byte each.
/// The extension follows put_config where a format has room for it: snapshots from version 3, log
/// create records of compact collections, and protocol version 2.
void put_config_precision(ByteWriter& w, const CollectionConfig& c);

/// Reads the fields put_config_precision wrote into c (range-checked later by check_config).
void get_config_precision(ByteReader& r, CollectionConfig& c);

/// Appends the multi-head field (issue 15): heads as a u32, after the precision fields. Written only
/// for heads > 1 (log create records, snapshot configurations, protocol version 2 always), so a
/// single-head collection's bytes are those of the release before; an older reader refuses the
/// extra bytes (corrupt_file: "bytes after the configuration") instead of misreading a multi-head one.
void put_config_heads(ByteWriter& w, const CollectionConfig& c);

/// Reads the field put_config_heads wrote into c (range-checked later by check_config).
void get_config_heads(ByteReader& r, CollectionConfig& c);

/// Reads a config written by put_config. The values are not range-checked here: check_config does
/// that (every loader calls it through the Collection constructor).
CollectionConfig get_config(ByteReader& r);

}  // namespace softkv::detail
