// Which SIMD kernel path softkv runs on: chosen once at start-up, reported for logs, forceable for tests.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace softkv {

/// Name of the kernel path in use (throws Error(unsupported) if SOFTKV_SIMD names one this CPU lacks): "scalar", "sse2", "avx2" (AVX2 + FMA3) or "avx512".
std::string_view simd_path();

/// Every path this CPU can run, from the portable scalar reference to the widest.
std::vector<std::string_view> available_simd_paths();

/// Forces a kernel path for the whole process (tests, benchmarks, debugging).
/// Throws Error(unsupported) if the CPU cannot run it or the name is unknown.
/// The environment variable SOFTKV_SIMD does the same at start-up.
/// Not synchronised with running queries: call it before querying.
void force_simd_path(std::string_view name);

/// Measures the scans' key-stream prefetch settings on this machine (about 0.4 s and 256 MiB while it
/// runs: scans out of cache on the query threads) and keeps the fastest for the rest of the process; returns what it chose and measured.
/// softkv-server --tune-scans calls it at start-up. Answers do not change, only the speed of the scans.
std::string tune_scans();

/// The scans' prefetch settings in use.
std::string scan_tuning();

/// How batch passes compute their two tile products (scores, blend) on this CPU: softkv's own register
/// tiles or libxsmm's JIT-generated GEMMs, each chosen by measuring both at first use (about 10-20 ms,
/// once per process; SOFTKV_TILES=softkv|libxsmm|auto decides instead), with the measured rates.
std::string tile_products();

/// Forces the tile products for the process: "softkv", "libxsmm" or "auto" (measure again). Throws
/// Error(unsupported) for an unknown name, or "libxsmm" in a build without it. Safe beside running
/// queries: a pass already started finishes with the tiles it began with.
void force_tile_products(std::string_view name);

}  // namespace softkv
