// Which tile products the batch passes run: the kernel path's own register tiles, or libxsmm's
// JIT-generated small GEMMs (code generated at run time for the CPU at hand: AVX2, AVX-512, ...),
// chosen per product by measuring both on this machine at first use. softkv's own tiles were tuned on
// one CPU (bench/analysis.md); a JIT GEMM holds its speed on CPUs they were not tuned on.
#pragma once

#include <string>
#include <string_view>

#include "kernel_table.hpp"

namespace softkv::detail {

/// The tile products a batch pass over kernel path k uses: k.tiles, except where libxsmm's code uses no
/// instruction set beyond k's (avx2 and avx512 paths; its target is the CPU's widest unless
/// LIBXSMM_TARGET narrows it), where each product is libxsmm's if the measurement at first use (or
/// force_tiles) chose it. The first call measures (about 10-20 ms, once per process) unless
/// SOFTKV_TILES or force_tiles decided.
TileProducts tiles_for(const KernelTable& k);

/// "scores <softkv|libxsmm>, blend <softkv|libxsmm>", plus the measured rates when they were measured.
std::string tiles_report();

/// Forces the choice: "softkv" (every path's own tiles), "libxsmm" (both products JIT where
/// tiles_for allows it) or "auto" (measure again). Error(unsupported) for "libxsmm" in a build without it, and
/// for an unknown name. Safe beside running queries (a pass already started keeps its tiles).
void force_tiles(std::string_view name);

/// Whether this build has libxsmm.
bool have_libxsmm() noexcept;

}  // namespace softkv::detail
