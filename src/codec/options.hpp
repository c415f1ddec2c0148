// QueryOptions in bytes: the one codec of the query options (docs/PROTOCOL.md, "QueryOptions"), in the
// forms the wire's versions carry and the full form the sharded collection broadcasts over MPI.
#pragma once

#include <cstdint>

#include "codec/bytes.hpp"
#include "softkv/types.hpp"

namespace softkv::detail {

/// Which QueryOptions fields an encoding carries. Each form holds the one before it and appends.
enum class OptionsForm : std::uint8_t {
  wire_v1,  ///< temperature, scale, top_m, top_k, epsilon, ef_search, nprobe, exact
  wire_v2,  ///< + the mask (tags_any, tag_range, exclude_ids), iterations, tolerance
  wire_v3,  ///< + error_target, check_sample
  full,     ///< + threads: every field (a rank's options over MPI)
};

/// The form protocol version `version` carries (1, 2, 3 and later).
[[nodiscard]] constexpr OptionsForm options_form(std::uint16_t version) {
  return version >= 3 ? OptionsForm::wire_v3 : version == 2 ? OptionsForm::wire_v2 : OptionsForm::wire_v1;
}

/// Appends o in the form. A field the form cannot carry with its value is refused rather than dropped
/// (Error(unsupported), naming the field and the protocol version it needs: the answer would silently
/// differ), and so is a count too wide for its u32 (Error(invalid_argument)).
void put_query_options(ByteWriter& w, const QueryOptions& o, OptionsForm form);

/// Reads what put_query_options wrote in the same form. Flags are checked here (protocol_error, or the
/// reader's code); the values' ranges are the collection's to check.
[[nodiscard]] QueryOptions get_query_options(ByteReader& r, OptionsForm form);

}  // namespace softkv::detail
