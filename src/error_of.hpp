// The one mapping from any exception to softkv's error vocabulary, for every place that catches an
// exception to report it rather than let it through: the server's replies, the sharded server's and the
// sharded collection's agreement between ranks (where a rank that let an exception through would leave
// the others waiting in a collective).
#pragma once

#include <exception>
#include <string>

#include "softkv/error.hpp"

namespace softkv::detail {

/// An exception as an error code and message.
struct ErrorOf {
  ErrorCode code = ErrorCode::internal;  ///< the error's code
  std::string message;                   ///< what to tell the caller
};

/// softkv::Error: its code and message; std::bad_alloc: resource_exhausted (a resource limit, not the
/// caller's mistake); any other exception: internal, "internal error (please report): " and its what();
/// anything else thrown: internal. error must not be null.
ErrorOf error_of(std::exception_ptr error);

}  // namespace softkv::detail
