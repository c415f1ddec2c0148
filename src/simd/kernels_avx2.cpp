// The avx2 kernel path: the shared scan algorithms instantiated with xsimd's xsimd::fma3<xsimd::avx2> (compiled with its ISA flags).
#include "kernel_table.hpp"
#include "primitives_xsimd.hpp"
#include "make_table.hpp"

namespace softkv::detail {

const KernelTable& avx2_kernels() {
  static const KernelTable table = scan::make_table<XsimdPrimitives<xsimd::fma3<xsimd::avx2>>>("avx2");
  return table;
}

}  // namespace softkv::detail
