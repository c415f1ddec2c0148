// error_of: runs a callable and returns the softkv::ErrorCode it threw (a default code if none).
#pragma once

#include "softkv/error.hpp"

namespace softkv::test {

template <class F>
ErrorCode error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode{};
}

}  // namespace softkv::test
