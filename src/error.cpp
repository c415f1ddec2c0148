// softkv::Error and the stable names of its codes.
#include "softkv/error.hpp"

#include <new>
#include <string>
#include <string_view>

#include "assert.hpp"
#include "error_of.hpp"

namespace softkv {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::dimension_mismatch: return "dimension_mismatch";
    case ErrorCode::empty_collection: return "empty_collection";
    case ErrorCode::non_finite: return "non_finite";
    case ErrorCode::unknown_id: return "unknown_id";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unknown_collection: return "unknown_collection";
    case ErrorCode::collection_exists: return "collection_exists";
    case ErrorCode::corrupt_file: return "corrupt_file";
    case ErrorCode::io_error: return "io_error";
    case ErrorCode::frame_too_large: return "frame_too_large";
    case ErrorCode::protocol_error: return "protocol_error";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::numeric_overflow: return "numeric_overflow";
    case ErrorCode::unauthenticated: return "unauthenticated";
    case ErrorCode::server_busy: return "server_busy";
    case ErrorCode::resource_exhausted: return "resource_exhausted";
    case ErrorCode::internal: return "internal";
  }
  return "unknown_error";
}

namespace {

// what() is a C string: a NUL inside the message (a collection name echoed from a request, say)
// would cut it there, so it is written as the four characters \x00, as the wire escapes other bytes.
std::string without_nul(std::string text) {
  for (std::size_t at = text.find('\0'); at != std::string::npos; at = text.find('\0', at + 4)) text.replace(at, 1, "\\x00");
  return text;
}

// "<code name>: message", once: an error passed on with its own what() (from one rank to another,
// say) already has the prefix and does not get it again.
std::string prefixed(ErrorCode code, const std::string& message) {
  const std::string prefix = std::string(to_string(code)) + ": ";
  if (message.compare(0, prefix.size(), prefix) == 0) return without_nul(message);
  return prefix + without_nul(message);
}

}  // namespace

Error::Error(ErrorCode code, const std::string& message) : std::runtime_error(prefixed(code, message)), code_(code) {}

}  // namespace softkv

namespace softkv::detail {

ErrorOf error_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  } catch (const std::bad_alloc&) {
    return {ErrorCode::resource_exhausted, "out of memory: the request needs more memory than could be allocated"};
  } catch (const std::exception& e) {
    return {ErrorCode::internal, std::string("internal error (please report): ") + e.what()};
  } catch (...) {
    return {ErrorCode::internal, "internal error (please report): an exception of unknown type"};
  }
}

void assertion_failed(const char* condition, const char* what, const char* file, int line) {
  std::string_view where(file);
  for (const std::string_view top : {"/src/", "/server/", "/python/", "/tests/"})  // the path inside the repository
    if (const auto at = where.rfind(top); at != std::string_view::npos) {
      where.remove_prefix(at + 1);
      break;
    }
  throw Error(ErrorCode::internal, std::string("internal error (please report): ") + what + " [" + condition + "] at " +
                                       std::string(where) + ":" + std::to_string(line));
}

}  // namespace softkv::detail
