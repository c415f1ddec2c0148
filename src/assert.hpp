// The assertion tier: a broken internal invariant (a bug in softkv, never bad input) becomes
// Error(internal) naming the invariant, the file and the line, in every build type — never a wrong
// answer and never undefined behaviour. Input is checked with typed errors at the doors (validate.hpp);
// SOFTKV_ASSERT is for what no input can cause. Its cost is one predictable branch.
#pragma once

namespace softkv::detail {

/// Throws Error(internal, "internal error (please report): <what> [<condition>] at <file>:<line>").
[[noreturn]] void assertion_failed(const char* condition, const char* what, const char* file, int line);

}  // namespace softkv::detail

/// Checks an internal invariant: Error(internal) with the condition, what it means, the file and line when it fails.
#define SOFTKV_ASSERT(condition, what) \
  ((condition) ? static_cast<void>(0) : ::softkv::detail::assertion_failed(#condition, what, __FILE__, __LINE__))
