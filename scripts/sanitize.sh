#!/usr/bin/env bash
# Builds the tests with sanitizers and runs them (CI runs both after `make test`).
#   scripts/sanitize.sh asan   whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer)
#   scripts/sanitize.sh tsan   concurrency, stress and server tests under ThreadSanitizer
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/sanitize.sh asan|tsan}
jobs=$(nproc)
# -g1 (line tables: reports keep file:line, no variable info) and -O1 for the test programs: an
# instrumented build in about half the time of -O2 -g everywhere (measured: the AVX-512 kernels' TU
# 122 s -> 78 s, a test TU 53 s -> 24 s on one core).
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
        -DSOFTKV_TEST_CXX_FLAGS=-O1 -DSOFTKV_BUILD_BENCH=OFF -DSOFTKV_BUILD_EXAMPLES=OFF)
# FAISS and OpenBLAS are not instrumented. FAISS's OpenMP threads synchronise through libgomp,
# which ThreadSanitizer cannot see, so its parallel index builds would be reported as races:
# one OpenMP thread keeps the report about softkv's own code (softkv reads OMP_NUM_THREADS once).
export OMP_NUM_THREADS=1
case "$mode" in
  asan)
    dir=build-asan
    cmake -S . -B "$dir" "${common[@]}" \
      -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    cmake --build "$dir" -j "$jobs"
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    # The package tests build a separate, uninstrumented consumer against the instrumented library: skip them.
    (cd "$dir" && ctest --output-on-failure -j "$jobs" -E '^package_' -LE mpi)
    # The MPI tests (label mpi: the sharded collection, the sharded server, its Python client) run
    # with every ASan and UBSan check but the leak check: Open MPI (not instrumented) keeps what
    # MPI_Init allocates until exit, and LeakSanitizer cannot unwind through it to suppress those
    # reports by library.
    (cd "$dir" && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1 ctest --output-on-failure -j "$jobs" -L mpi)
    ;;
  tsan)
    dir=build-tsan
    # -Wno-tsan: GCC notes that TSan does not model atomic_thread_fence (Asio uses fences); TSan still
    # checks every access, it just cannot credit a fence with ordering, which could only add reports.
    cmake -S . -B "$dir" "${common[@]}" -DCMAKE_CXX_FLAGS="-fsanitize=thread -Wno-tsan"
    cmake --build "$dir" -j "$jobs" --target softkv_tests
    export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
    # The out-of-process crash and abuse tests gain nothing from TSan in this process: leave them to the asan run.
    # Timing tests measure wall time, which TSan stretches 5-15x (a 40-GFLOP scan outlived the client's timeout).
    # [estimate]: a sample scans its blocks on the shared pool's threads ([statistical]: long runs of the same
    # paths over many queries, left out). (Catch2 ties each ~exclusion to its comma-separated term.)
    "$dir/tests/softkv_tests" --durations yes "[concurrency],[stress],[coalescing],[estimate]~[statistical],[server]~[crash]~[abuse]~[timing]"
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
