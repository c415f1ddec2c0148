// Baseline implementations (compiled without auto-vectorisation so "naive" stays scalar; BLAS does its own).
#include "baselines.hpp"

#include <cblas.h>

#include <cmath>
#include <limits>

namespace softkv::bench {
namespace {

// In-place softmax of n scores; returns their sum of exponentials' normaliser already applied.
void softmax_inplace(float* s, std::size_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
  double z = 0;
  for (std::size_t i = 0; i < n; ++i) z += s[i] = std::exp(s[i] - m);
  const auto inv = static_cast<float>(1.0 / z);
  for (std::size_t i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace

void naive_soft(const float* q, const float* keys, const float* values, std::size_t n, std::size_t d,
                std::size_t dv, float scale, float* scores, float* out) {
  for (std::size_t i = 0; i < n; ++i) {
    float s = 0;
    for (std::size_t j = 0; j < d; ++j) s += q[j] * keys[i * d + j];
    scores[i] = scale * s;
  }
  softmax_inplace(scores, n);
  for (std::size_t j = 0; j < dv; ++j) out[j] = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < dv; ++j) out[j] += scores[i] * values[i * dv + j];
}

std::size_t naive_hard(const float* q, const float* keys, std::size_t n, std::size_t d) {
  std::size_t best = 0;
  float best_s = -std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    float s = 0;
    for (std::size_t j = 0; j < d; ++j) s += q[j] * keys[i * d + j];
    if (s > best_s) best_s = s, best = i;
  }
  return best;
}

void blas_soft(const float* q, const float* keys, const float* values, std::size_t n, std::size_t d,
               std::size_t dv, float scale, float* scores, float* out) {
  const int ni = static_cast<int>(n), di = static_cast<int>(d), dvi = static_cast<int>(dv);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, ni, di, scale, keys, di, q, 1, 0.0f, scores, 1);
  softmax_inplace(scores, n);
  cblas_sgemv(CblasRowMajor, CblasTrans, ni, dvi, 1.0f, values, dvi, scores, 1, 0.0f, out, 1);
}

void blas_soft_batch(const float* queries, std::size_t nq, const float* keys, const float* values, std::size_t n,
                     std::size_t d, std::size_t dv, float scale, float* scores, float* out) {
  const int ni = static_cast<int>(n), di = static_cast<int>(d), dvi = static_cast<int>(dv), bi = static_cast<int>(nq);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bi, ni, di, scale, queries, di, keys, di, 0.0f, scores, ni);
  for (std::size_t b = 0; b < nq; ++b) softmax_inplace(scores + b * n, n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bi, dvi, ni, 1.0f, scores, ni, values, dvi, 0.0f, out, dvi);
}

}  // namespace softkv::bench
