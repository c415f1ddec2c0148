// mpi_bench: a ShardedCollection's query latency and its reduction cost, run under mpirun (not a test).
// Every rank prints nothing but rank 0, which prints one Markdown table row per measurement.
#include <CLI/CLI.hpp>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "common.hpp"
#include "mpi/partial_record.hpp"
#include "softkv/mpi.hpp"
#include "softkv/simd.hpp"

namespace {

// Median over reps of a collective step, timed on rank 0 after a barrier (one warm-up first);
// `reduce_us` receives the median time the step spent in its reductions, in microseconds.
template <class F>
double median_collective_ms(MPI_Comm comm, int reps, const softkv::ShardedCollection& s, double& reduce_us, F&& step) {
  step();
  std::vector<double> t, r;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    step();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    r.push_back(s.last_reduce_seconds() * 1e6);
  }
  std::sort(t.begin(), t.end());
  std::sort(r.begin(), r.end());
  reduce_us = r[r.size() / 2];
  return t[t.size() / 2];
}

// The reduction alone: median microseconds of one MPI_Allreduce of `count` soft records of dv floats
// (no top list), each started after a barrier so that no rank's scan skew is counted.
double reduction_alone_us(MPI_Comm comm, std::size_t count, std::size_t dv, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    softkv::detail::PartialRecords records(count, softkv::detail::RecordKind::soft, dv, 0);
    for (std::size_t b = 0; b < count; ++b) {
      records.header(b).max = 1.0f;
      records.header(b).sum = 2.0f;
    }
    MPI_Barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    records.allreduce(comm);
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // the scan pool's threads never call MPI
  CLI::App app{"mpi_bench: sharded soft/hard query latency and reduction time (run under mpirun)"};
  std::size_t n = 2'000'000, d = 128, dv = 128, threads = 1, batch = 64, chunk = 65536;
  int reps = 15, batch_reps = 5;
  app.add_option("--n", n, "entries over all ranks")->capture_default_str();
  app.add_option("--d", d, "key dimension")->capture_default_str();
  app.add_option("--dv", dv, "value dimension")->capture_default_str();
  app.add_option("--threads", threads, "scan threads per rank (QueryOptions::threads)")->capture_default_str();
  app.add_option("--batch", batch, "queries in the batched measurement")->capture_default_str();
  app.add_option("--reps", reps, "single-query repetitions (median)")->capture_default_str();
  app.add_option("--batch-reps", batch_reps, "batch repetitions (median)")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    MPI_Finalize();
    return rc;
  }
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  {  // the collection is destroyed (collectively) before MPI_Finalize
  softkv::CollectionConfig config;
  config.dim = d;
  config.value_dim = dv;
  softkv::ShardedCollection s(MPI_COMM_WORLD, config);
  // Loaded through root in chunks, as a client's writes would arrive; the load is not timed.
  for (std::size_t start = 0; start < n; start += chunk) {
    const std::size_t rows = std::min(chunk, n - start);
    std::vector<float> keys, values;
    if (rank == 0) {
      keys = softkv::bench::uniform_floats(rows * d, start + 1);
      values = softkv::bench::uniform_floats(rows * dv, start + 7);
    }
    (void)s.add_batch(keys, values);
  }
  softkv::QueryOptions options;
  options.threads = threads;
  const std::vector<float> one = softkv::bench::uniform_floats(d, 4242);
  const std::vector<float> many = softkv::bench::uniform_floats(batch * d, 4343);
  double soft_red = 0, ignored = 0;
  const double soft_ms = median_collective_ms(MPI_COMM_WORLD, reps, s, soft_red, [&] { (void)s.query_soft(one, options); });
  const double hard_ms = median_collective_ms(MPI_COMM_WORLD, reps, s, ignored, [&] { (void)s.query_hard(one, options); });
  const double batch_ms = median_collective_ms(MPI_COMM_WORLD, batch_reps, s, ignored,
                                               [&] { (void)s.query(many, softkv::Retrieval::soft, options); });
  const double hard_batch_ms = median_collective_ms(MPI_COMM_WORLD, batch_reps, s, ignored,
                                                    [&] { (void)s.query(many, softkv::Retrieval::hard, options); });
  const double alone_one = reduction_alone_us(MPI_COMM_WORLD, 1, dv, 200);
  const double alone_batch = reduction_alone_us(MPI_COMM_WORLD, batch, dv, 50);
  // Columns: ranks x threads | N | kernel | soft ms | hard ms | soft batch ms | hard batch ms |
  // reduction alone us (1 query) | reduction alone us per query (batch) | reduction in the query us
  // (soft single; includes waiting for the slowest rank).
  if (rank == 0) {
    std::printf("| %d x %zu | %zu | %s | %.2f | %.2f | %.2f | %.2f | %.1f | %.2f | %.0f |\n", ranks, threads, n,
                std::string(softkv::simd_path()).c_str(), soft_ms, hard_ms, batch_ms, hard_batch_ms, alone_one,
                alone_batch / static_cast<double>(batch), soft_red);
  }
  }
  MPI_Finalize();
  return 0;
}
