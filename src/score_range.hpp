// The numeric_overflow of a query whose every score lies below -FLT_MAX, as a type of its own.
#pragma once

#include "softkv/error.hpp"

namespace softkv::detail {

/// Error(numeric_overflow) thrown when every score a query saw is below -FLT_MAX (each weighs 0, none
/// is an argmax), as opposed to a score above FLT_MAX. Callers see a plain numeric_overflow; a sharded
/// query catches this type so that such a shard sits the query out, since other shards may hold
/// representable scores (one collection holding every row would answer from those).
class EveryScoreBelowRange : public Error {
 public:
  EveryScoreBelowRange()
      : Error(ErrorCode::numeric_overflow, "every score is below -FLT_MAX; use a smaller scale or a larger temperature") {}
};

}  // namespace softkv::detail
