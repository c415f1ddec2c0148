#!/usr/bin/env bash
# make bench: builds in Release and runs the whole benchmark suite (bench/run_bench.py), writing
# bench/results/RESULTS.md and PNG plots. It reports and never fails on a figure. Sizes:
#   BENCH_SIZES (default 10000,100000,1000000), BENCH_REPS (5), BENCH_SERVER_SECONDS (5)
# The defaults take about 15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh python3-torch python3-faiss python3-matplotlib redis-server redis-tools
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target softkv_bench pruning_bench load_gen softkv-server softkv_python mpi_bench
/usr/bin/python3 bench/run_bench.py --build build --sizes "${BENCH_SIZES:-10000,100000,1000000}" \
  --reps "${BENCH_REPS:-5}" --server-seconds "${BENCH_SERVER_SECONDS:-5}"
# Coalesced queries: softkv-server with --coalesce on and off under load (bench/results/COALESCING.md).
/usr/bin/python3 bench/coalescing_bench.py --build build --seconds "${BENCH_SERVER_SECONDS:-6}"
# Sharded queries under mpirun: 1 rank x 2 threads vs 2 ranks x 1 thread, P = 1..4 (bench/results/SHARDING.md).
bench/mpi_bench.sh build > bench/results/sharding_run.md
