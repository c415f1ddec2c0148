#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a bounded time.
#   scripts/fuzz.sh [seconds per target, default 60]
# Seeds: tests/fuzz/corpus/<target>/ (read only); new inputs go to build-fuzz/corpus-<target>/.
# Any crash, leak, sanitizer report or allocation over 128 MiB fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
./scripts/install-deps.sh clang libclang-rt-14-dev libomp-14-dev
dir=build-fuzz
CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  -DSOFTKV_BUILD_TESTS=OFF -DSOFTKV_BUILD_EXAMPLES=OFF -DSOFTKV_BUILD_BENCH=OFF -DSOFTKV_BUILD_SERVER=OFF -DSOFTKV_BUILD_FUZZ=ON \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all"
cmake --build "$dir" -j "$(nproc)"
export OMP_NUM_THREADS=1
for target in frame wal records snapshot parts; do
  mkdir -p "$dir/corpus-$target"
  echo "== fuzz_$target for ${seconds} s"
  # malloc_limit_mb: twice the 64 MiB frame limit; any larger single allocation is a finding.
  log="$dir/fuzz-$target.log"
  status=0
  dict=()
  [ -f "tests/fuzz/$target.dict" ] && dict=(-dict="tests/fuzz/$target.dict")  # field extremes (frame.dict)
  "$dir/tests/fuzz/fuzz_$target" "$dir/corpus-$target" "tests/fuzz/corpus/$target" "${dict[@]}" \
    -max_total_time="$seconds" -malloc_limit_mb=128 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$dir/" >"$log" 2>&1 || status=$?
  grep -E "stat::number_of_executed_units|stat::new_units_added" "$log" || true
  if [ "$status" -ne 0 ]; then
    echo "fuzz_$target FAILED (exit $status); the input is saved as $dir/crash-* (or leak-*, oom-*):"
    tail -n 60 "$log"
    exit 1
  fi
done
