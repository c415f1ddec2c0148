// The fixed-size partial answer one rank contributes to a sharded query, and the MPI_Op that merges two.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "softmax_state.hpp"

namespace softkv::detail {

/// What a record carries: a soft partial (m, l, acc + top list) or a hard one (best id, score, value).
enum class RecordKind : std::uint32_t { soft = 0, hard = 1 };

/// The header of one record; top_cap (id, score) pairs and dv floats follow it. Every field merges by
/// a commutative, associative rule, so MPI may combine records in any order and tree shape.
struct RecordHeader {
  RecordKind kind = RecordKind::soft;
  std::uint32_t value_dim = 0;   ///< dv: floats in the vector part (acc for soft, the value for hard)
  std::uint32_t top_cap = 0;     ///< room for (id, score) pairs
  std::uint32_t top_count = 0;   ///< pairs in use, best first (higher score, then smaller id)
  std::uint32_t error = 0;       ///< 0, or the smallest ErrorCode a rank hit (all ranks then throw it)
  std::uint32_t guaranteed = 1;  ///< AND over ranks: every shard's tail bound is a guarantee
  float max = 0;                 ///< soft: m; hard: the best score
  float sum = 0;                 ///< soft: l (0: no rows yet)
  std::uint64_t best_id = 0;     ///< hard: the best id (valid when has_best)
  std::uint64_t rows = 0;        ///< entries scanned, summed over ranks (the global N)
  std::uint32_t has_best = 0;    ///< hard: a best row exists
  std::uint32_t searched_with = 0;  ///< the largest IndexKind code any shard answered with (0: all scanned)
  std::uint32_t filtered_after = 0;  ///< OR over ranks: a shard's index filtered masked candidates after its search
};

/// A run of n records of one shape in one contiguous buffer (the unit of one MPI reduction).
class PartialRecords {
 public:
  /// n empty records (the identity of the merge) of this kind and shape.
  PartialRecords(std::size_t n, RecordKind kind, std::size_t value_dim, std::size_t top_cap);

  [[nodiscard]] std::size_t count() const noexcept { return count_; }        ///< n
  [[nodiscard]] std::size_t record_bytes() const noexcept { return bytes_; }  ///< bytes of one record
  [[nodiscard]] std::byte* data() noexcept { return buffer_.data(); }          ///< the n records
  [[nodiscard]] RecordHeader& header(std::size_t i);                          ///< record i's header
  [[nodiscard]] std::span<std::uint64_t> top_ids(std::size_t i);             ///< record i's top_cap ids
  [[nodiscard]] std::span<float> top_scores(std::size_t i);                  ///< record i's top_cap scores
  [[nodiscard]] std::span<float> vector(std::size_t i);                      ///< record i's dv floats

  /// Record i's soft part as a SoftmaxState (for the library's log-sum-exp merge).
  [[nodiscard]] SoftmaxState state(std::size_t i);
  /// Stores a SoftmaxState into record i's soft part.
  void set_state(std::size_t i, const SoftmaxState& state);
  /// Sets the error field of every record (the first error a rank hit wins over none).
  void set_error(std::uint32_t code);

  /// Replaces every record with its merge with the same record of every rank of comm (MPI_Allreduce
  /// with the softkv merge operation): afterwards every rank holds the global records.
  void allreduce(MPI_Comm comm);

 private:
  std::size_t count_;
  std::size_t bytes_;
  std::size_t top_cap_;
  std::size_t value_dim_;
  std::vector<std::byte> buffer_;
};

/// Merges record `in` into record `inout` (same shape): the body of the MPI_Op, exposed for tests.
void merge_record(const std::byte* in, std::byte* inout);

}  // namespace softkv::detail
