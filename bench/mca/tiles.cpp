// The batched kernels' inner loops as stand-alone functions, for scripts/mca.py: compiled to assembly once
// per instruction set (-DSOFTKV_MCA_ARCH=xsimd::avx2 or xsimd::avx512f, with that set's flags, as
// src/CMakeLists.txt compiles the kernel files) and fed loop by loop to llvm-mca. Each function is
// the very template the kernels instantiate, with the tile shape the kernels use; nothing here is
// built into softkv.
#include <cstddef>

#include "simd/primitives_xsimd.hpp"

using P = softkv::detail::XsimdPrimitives<SOFTKV_MCA_ARCH>;

extern "C" {
// Batch, the score tile: kTileRows key rows x kTileVecs vectors of query lanes.
[[gnu::noinline]] void mca_scores_tile(const float* qt, std::size_t lanes, const float* k, std::size_t d, float* s) {
  P::scores_tile<P::kTileRows, P::kTileVecs>(qt, lanes, k, d, s);
}
// Batch, the blend tile: kTileRows queries x kTileVecs vectors of value columns.
[[gnu::noinline]] void mca_blend_tile(const float* w, std::size_t lanes, const float* v, std::size_t rows, std::size_t dv,
                                      float* acc) {
  P::blend_tile<P::kTileRows, P::kTileVecs>(w, lanes, v, rows, dv, acc);
}
// Batch, the exponentials down the columns of a score block.
[[gnu::noinline]] void mca_exp_columns(float* s, std::size_t rows, std::size_t lanes, const float* shift, float* sums) {
  P::exp_columns(s, rows, lanes, shift, sums);
}
}
