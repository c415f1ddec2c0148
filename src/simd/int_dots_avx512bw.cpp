// int_dots_avx512.hpp's body with AVX512-BW (compiled with -mavx512f -mavx512bw -mavx512vl).
#include "int_dots_avx512.hpp"

namespace softkv::detail {

void int_dots_avx512bw(const std::int16_t* q, const std::int8_t* rows, std::size_t n, std::size_t d, std::int32_t* out) {
  avx512_int::dots(q, rows, n, d, out);
}

}  // namespace softkv::detail
