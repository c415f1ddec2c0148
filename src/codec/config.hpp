// CollectionConfig in bytes: the one layout (docs/PROTOCOL.md, "CollectionConfig") of the log, snapshots
// and the wire, and the one rule for which extension fields each of those forms carries.
#pragma once

#include "codec/bytes.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

/// The forms a CollectionConfig takes. Each is the fixed part (dim ... rebuild_fraction) followed by a
/// tail of extension groups in a fixed order — 1: key_precision, value_precision (u8 each, issue 14);
/// 2: heads (u32, issue 15) — that runs to the end of the block enclosing it (a log record's payload,
/// a snapshot's sized configuration block, a create frame), which is the tail's length prefix. A reader
/// reads the groups present; a form states the groups its writer always writes (its readers require
/// them) and the groups it writes only when not at their default (so a collection without the newer
/// feature has the bytes of the release before, which older readers still read). A new field is a new
/// group at the end: one change here, and every form carries it.
enum class ConfigForm {
  wire_v1,     ///< protocol version 1: no tail (a v1 peer cannot name a compact or multi-head collection)
  wire,        ///< protocol version 2 and later: every group, always
  snapshot_v2, ///< snapshot formats 1 and 2: no tail
  snapshot,    ///< snapshot format 3 and later: group 1 always, later groups when not at their default
  log_record,  ///< a create record: each group when it or a later one is not at its default
};

/// Appends config in `form`; throws Error(invalid_argument) for a field too wide for its bytes.
void put_config(ByteWriter& w, const CollectionConfig& c, ConfigForm form);

/// Reads a config in `form`: the fixed part, the groups the form requires (Error(r's code) naming the
/// field when absent) and any later groups present. Values are not range-checked here: check_config
/// does that (every loader calls it through the Collection constructor). The caller checks that its
/// block ends where the config does.
CollectionConfig get_config(ByteReader& r, ConfigForm form);

}  // namespace softkv::detail
