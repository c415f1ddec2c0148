// The peers softkv is measured against: a naive scalar loop and OpenBLAS two-pass attention.
#pragma once

#include <cstddef>
#include <cstdint>

namespace softkv::bench {

/// Textbook soft retrieval in scalar loops: scores, max, exp and sum, weighted sum (out: dv floats).
void naive_soft(const float* q, const float* keys, const float* values, std::size_t n, std::size_t d,
                std::size_t dv, float scale, float* scores, float* out);

/// Textbook argmax of q . k_i in scalar loops.
std::size_t naive_hard(const float* q, const float* keys, std::size_t n, std::size_t d);

/// OpenBLAS sgemv (scores) + scalar softmax + sgemv (blend): two passes over memory.
void blas_soft(const float* q, const float* keys, const float* values, std::size_t n, std::size_t d,
               std::size_t dv, float scale, float* scores, float* out);

/// OpenBLAS sgemm (nq x n scores) + row softmax + sgemm (blend); scores holds nq x n floats.
void blas_soft_batch(const float* queries, std::size_t nq, const float* keys, const float* values, std::size_t n,
                     std::size_t d, std::size_t dv, float scale, float* scores, float* out);

}  // namespace softkv::bench
