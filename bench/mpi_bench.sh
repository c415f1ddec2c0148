#!/usr/bin/env bash
# Runs mpi_bench for 1 rank x 2 threads, 2 ranks x 1 thread and P = 1..4 ranks x 1 thread (N = 2M,
# d = dv = 128 unless MPI_BENCH_N is set) and prints one Markdown table (bench/results/SHARDING.md
# explains the columns). Usage: bench/mpi_bench.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
n=${MPI_BENCH_N:-2000000}
run="mpirun --allow-run-as-root --oversubscribe --bind-to none"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| ranks x threads | N | kernel | soft ms | hard ms | soft batch-64 ms | hard batch-64 ms | reduction alone us | reduction alone us/query (batch) | reduction in query us |"
echo "|---|---|---|---|---|---|---|---|---|---|"
$run -np 1 "$build/bench/mpi_bench" --n "$n" --threads 2
$run -np 2 "$build/bench/mpi_bench" --n "$n" --threads 1
for p in 1 3 4; do $run -np "$p" "$build/bench/mpi_bench" --n "$n" --threads 1; done
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
