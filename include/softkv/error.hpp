// softkv's typed errors: every caller mistake and every bad input surfaces as softkv::Error.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace softkv {

/// What went wrong. The numeric values are stable: they travel in wire error frames.
enum class ErrorCode : std::uint16_t {
  dimension_mismatch = 1,   ///< a vector's length differs from the collection's d or dv
  empty_collection = 2,     ///< a query on a collection with no entries
  non_finite = 3,           ///< a NaN or infinity in an input vector or parameter
  unknown_id = 4,           ///< no entry has this id
  invalid_argument = 5,     ///< a parameter out of range (T <= 0, bad scale, zero-norm cosine key, ...)
  unknown_collection = 6,   ///< no collection has this name
  collection_exists = 7,    ///< a collection with this name already exists
  corrupt_file = 8,         ///< a snapshot or log failed a size or checksum check
  io_error = 9,             ///< the operating system refused a file operation
  frame_too_large = 10,     ///< a wire frame longer than the configured limit
  protocol_error = 11,      ///< a malformed frame or an unknown opcode
  unsupported = 12,         ///< a feature not available on this build or CPU
  numeric_overflow = 13,    ///< scores left the float range (lower the scale)
  unauthenticated = 14,     ///< the server requires an auth token first, or the token was wrong
  server_busy = 15,         ///< the server is at its connection limit or shutting down
  resource_exhausted = 16,  ///< a request needs more memory (or another resource) than is available
  internal = 17,            ///< a broken internal invariant (a bug in softkv: please report it)
};

/// The stable lower-case name of a code, e.g. "dimension_mismatch".
std::string_view to_string(ErrorCode code) noexcept;

/// The exception softkv throws for caller mistakes and bad input; what() carries a readable message.
class Error : public std::runtime_error {
 public:
  /// Builds an error with a code and a message that names the offending value.
  Error(ErrorCode code, const std::string& message);

  /// The typed reason, for programs that branch on it.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace softkv
