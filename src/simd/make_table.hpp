// The kernel table of one primitives policy: every scan algorithm instantiated for P. Each
// kernels_*.cpp includes this and calls make_table once with its own P.
#pragma once

#include <string_view>

#include "kernel_table.hpp"
#include "scan_algorithms.hpp"
#include "scan_heads_algorithms.hpp"

namespace softkv::detail::scan {

// The table for one primitives policy; each kernels_*.cpp calls this once with its own P.
template <class P>
KernelTable make_table(std::string_view name) {
  return KernelTable{name,         &P::dot,           &score_span<P>,       &score_span_multi<P>, &soft_scan<P>,
                     &soft_scan_batch<P>, &hard_scan<P>, &hard_scan_batch<P>, &top_scan<P>,
                     &soft_scan_heads<P>, &hard_scan_heads<P>, &value_sums<P>, &fold_moments<P>, &fold_leverage<P>,
                     TileProducts{&P::scores_block, &P::blend_block}};
}

}  // namespace softkv::detail::scan
