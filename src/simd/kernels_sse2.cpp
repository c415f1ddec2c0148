// The sse2 kernel path: the shared scan algorithms instantiated with xsimd's xsimd::sse2 (compiled with its ISA flags).
#include "kernel_table.hpp"
#include "primitives_xsimd.hpp"
#include "make_table.hpp"

namespace softkv::detail {

const KernelTable& sse2_kernels() {
  static const KernelTable table = scan::make_table<XsimdPrimitives<xsimd::sse2>>("sse2");
  return table;
}

}  // namespace softkv::detail
