// Partial records of a sharded query and their merge: log-sum-exp for soft, (score, smaller id) for hard.
#include "partial_record.hpp"

#include <algorithm>
#include <cstring>

#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

constexpr std::size_t kHeaderBytes = sizeof(RecordHeader);
static_assert(kHeaderBytes % 8 == 0, "the id array after the header must stay 8-byte aligned");

std::size_t record_bytes_for(std::size_t value_dim, std::size_t top_cap) {
  const std::size_t bytes = kHeaderBytes + top_cap * (sizeof(std::uint64_t) + sizeof(float)) + value_dim * sizeof(float);
  return (bytes + 7) / 8 * 8;  // every record of a run starts 8-byte aligned
}

// Views into one record, laid out as header | ids[cap] | scores[cap] | vector[dv].
struct RecordView {
  RecordHeader* header;
  std::uint64_t* ids;
  float* scores;
  float* vector;

  explicit RecordView(std::byte* at)
      : header(reinterpret_cast<RecordHeader*>(at)),
        ids(reinterpret_cast<std::uint64_t*>(at + kHeaderBytes)),
        scores(reinterpret_cast<float*>(at + kHeaderBytes + header->top_cap * sizeof(std::uint64_t))),
        vector(scores + header->top_cap) {}
};

// (score, id) order of the top lists: higher score first, then smaller id (docs/DESIGN.md, "Semantics every path keeps": the tie rule).
bool better(float score_a, std::uint64_t id_a, float score_b, std::uint64_t id_b) {
  return score_a > score_b || (score_a == score_b && id_a < id_b);
}

void merge_top(const RecordView& in, RecordView& out) {
  const std::size_t cap = out.header->top_cap;
  const std::size_t na = out.header->top_count, nb = in.header->top_count;
  if (nb == 0) return;
  std::vector<std::uint64_t> ids(cap);
  std::vector<float> scores(cap);
  std::size_t a = 0, b = 0, n = 0;
  while (n < cap && (a < na || b < nb)) {
    const bool take_a = b >= nb || (a < na && better(out.scores[a], out.ids[a], in.scores[b], in.ids[b]));
    ids[n] = take_a ? out.ids[a] : in.ids[b];
    scores[n] = take_a ? out.scores[a++] : in.scores[b++];
    ++n;
  }
  std::copy_n(ids.begin(), n, out.ids);
  std::copy_n(scores.begin(), n, out.scores);
  out.header->top_count = static_cast<std::uint32_t>(n);
}

void reduce_records(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  auto* src = static_cast<std::byte*>(in);
  auto* dst = static_cast<std::byte*>(inout);
  for (int i = 0; i < *len; ++i) {
    const std::size_t bytes = record_bytes_for(reinterpret_cast<RecordHeader*>(src)->value_dim,
                                               reinterpret_cast<RecordHeader*>(src)->top_cap);
    merge_record(src, dst);
    src += bytes;
    dst += bytes;
  }
}

// Created once per process (after MPI_Init) and kept: an MPI_Op is a process-wide handle.
MPI_Op merge_op() {
  static const MPI_Op op = [] {
    MPI_Op created;
    MPI_Op_create(&reduce_records, /*commute=*/1, &created);
    return created;
  }();
  return op;
}

}  // namespace

void merge_record(const std::byte* in_bytes, std::byte* inout_bytes) {
  // The view only reads through `in`; the const_cast keeps one view type for both sides.
  const RecordView in(const_cast<std::byte*>(in_bytes));
  RecordView out(inout_bytes);
  RecordHeader& h = *out.header;
  const RecordHeader& o = *in.header;
  if (o.error != 0 && (h.error == 0 || o.error < h.error)) h.error = o.error;
  h.guaranteed = h.guaranteed & o.guaranteed;
  h.rows += o.rows;
  h.searched_with = std::max(h.searched_with, o.searched_with);
  h.filtered_after = h.filtered_after | o.filtered_after;
  merge_top(in, out);
  const std::size_t dv = h.value_dim;
  if (h.kind == RecordKind::soft) {
    // The library's own rule (SoftmaxState::merge), so threads and ranks merge identically.
    SoftmaxState mine(0), theirs(0);
    mine.max = h.max;
    mine.sum = h.sum;
    mine.acc.assign(out.vector, out.vector + dv);
    theirs.max = o.max;
    theirs.sum = o.sum;
    theirs.acc.assign(in.vector, in.vector + dv);
    mine.merge(theirs);
    h.max = mine.max;
    h.sum = mine.sum;
    std::copy_n(mine.acc.begin(), dv, out.vector);
  } else if (o.has_best != 0 && (h.has_best == 0 || better(o.max, o.best_id, h.max, h.best_id))) {
    h.has_best = 1;
    h.max = o.max;
    h.best_id = o.best_id;
    std::copy_n(in.vector, dv, out.vector);
  }
}

PartialRecords::PartialRecords(std::size_t n, RecordKind kind, std::size_t value_dim, std::size_t top_cap)
    : count_(n), bytes_(record_bytes_for(value_dim, top_cap)), top_cap_(top_cap), value_dim_(value_dim),
      buffer_(n * bytes_) {
  for (std::size_t i = 0; i < n; ++i) {
    RecordHeader& h = header(i);
    h = RecordHeader{};
    h.kind = kind;
    h.value_dim = static_cast<std::uint32_t>(value_dim);
    h.top_cap = static_cast<std::uint32_t>(top_cap);
    h.max = kind == RecordKind::soft ? SoftmaxState(0).max : 0.0f;
  }
}

RecordHeader& PartialRecords::header(std::size_t i) { return *reinterpret_cast<RecordHeader*>(buffer_.data() + i * bytes_); }

std::span<std::uint64_t> PartialRecords::top_ids(std::size_t i) { return {RecordView(buffer_.data() + i * bytes_).ids, top_cap_}; }

std::span<float> PartialRecords::top_scores(std::size_t i) { return {RecordView(buffer_.data() + i * bytes_).scores, top_cap_}; }

std::span<float> PartialRecords::vector(std::size_t i) { return {RecordView(buffer_.data() + i * bytes_).vector, value_dim_}; }

SoftmaxState PartialRecords::state(std::size_t i) {
  SoftmaxState s(0);
  s.max = header(i).max;
  s.sum = header(i).sum;
  const std::span<float> v = vector(i);
  s.acc.assign(v.begin(), v.end());
  return s;
}

void PartialRecords::set_state(std::size_t i, const SoftmaxState& state) {
  header(i).max = state.max;
  header(i).sum = state.sum;
  std::copy(state.acc.begin(), state.acc.end(), vector(i).begin());
}

void PartialRecords::set_error(std::uint32_t code) {
  for (std::size_t i = 0; i < count_; ++i) {
    RecordHeader& h = header(i);
    if (h.error == 0 || code < h.error) h.error = code;
  }
}

void PartialRecords::allreduce(MPI_Comm comm) {
  if (count_ == 0) return;
  if (bytes_ > static_cast<std::size_t>(INT32_MAX) || count_ > static_cast<std::size_t>(INT32_MAX))
    throw Error(ErrorCode::resource_exhausted, "sharded query: a partial record or batch exceeds MPI's int counts");
  MPI_Datatype type;
  MPI_Type_contiguous(static_cast<int>(bytes_), MPI_BYTE, &type);
  MPI_Type_commit(&type);
  const int rc = MPI_Allreduce(MPI_IN_PLACE, buffer_.data(), static_cast<int>(count_), type, merge_op(), comm);
  MPI_Type_free(&type);
  if (rc != MPI_SUCCESS) throw Error(ErrorCode::internal, "sharded query: MPI_Allreduce failed");
}

}  // namespace softkv::detail
