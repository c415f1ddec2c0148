// The scalar kernel path: the shared scan algorithms over plain loops, the reference for every SIMD path.
#include "kernel_table.hpp"
#include "primitives_scalar.hpp"
#include "make_table.hpp"

namespace softkv::detail {

const KernelTable& scalar_kernels() {
  static const KernelTable table = scan::make_table<ScalarPrimitives>("scalar");
  return table;
}

}  // namespace softkv::detail
