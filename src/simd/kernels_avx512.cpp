// The avx512 kernel path: the shared scan algorithms instantiated with xsimd's xsimd::avx512f (compiled with its ISA flags).
#include "kernel_table.hpp"
#include "primitives_xsimd.hpp"
#include "make_table.hpp"

namespace softkv::detail {

const KernelTable& avx512_kernels() {
  static const KernelTable table = scan::make_table<XsimdPrimitives<xsimd::avx512f>>("avx512");
  return table;
}

}  // namespace softkv::detail
