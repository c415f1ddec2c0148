// Centroids for the certified lists (kmeans.hpp): FAISS's k-means, in one level or two.
#include "index/kmeans.hpp"

#include <faiss/Clustering.h>

#include <algorithm>
#include <cmath>

#include "index/pruning_index.hpp"

namespace softkv::detail {
namespace {

// k-means centroids (L2) of n points, k <= n, on FAISS's copies under shift; returned at the keys' scale.
std::vector<float> kmeans(const float* x, std::size_t n, std::size_t k, std::size_t d, int shift) {
  if (k >= n) {
    std::vector<float> out(x, x + n * d);
    return out;
  }
  faiss::ClusteringParameters cp;
  cp.niter = 12;
  cp.verbose = false;
  cp.min_points_per_centroid = 1;   // small lists are the point; FAISS would warn on stderr otherwise
  cp.max_points_per_centroid = 64;  // a sample of 64 points per centroid trains well
  faiss::Clustering clustering(static_cast<int>(d), k, cp);
  faiss::IndexFlatL2 assign(static_cast<faiss::Index::idx_t>(d));
  const std::vector<float> safe = faiss_copy(x, n * d, shift);
  clustering.train(static_cast<faiss::Index::idx_t>(n), safe.data(), assign);
  std::vector<float> out(clustering.centroids.begin(), clustering.centroids.end());
  for (float& v : out) v = std::ldexp(v, shift);
  return out;
}

}  // namespace

std::vector<std::uint32_t> nearest_centroid(const faiss::IndexFlatL2& centroids, const float* keys, std::size_t n, std::size_t d, int shift) {
  std::vector<std::uint32_t> out(n, 0);
  if (n == 0 || centroids.ntotal == 0) return out;
  const std::vector<float> safe = faiss_copy(keys, n * d, shift);
  std::vector<float> dist(n);
  std::vector<faiss::Index::idx_t> label(n);
  centroids.search(static_cast<faiss::Index::idx_t>(n), safe.data(), 1, dist.data(), label.data());
  // A key whose distances overflow gets no label: any list is correct (its radius grows to cover it).
  for (std::size_t i = 0; i < n; ++i) out[i] = label[i] < 0 ? 0 : static_cast<std::uint32_t>(label[i]);
  return out;
}

std::vector<float> train_centroids(const float* keys, std::size_t n, std::size_t d, std::size_t nlist, int shift) {
  if (nlist <= 256) {
    const std::size_t sample = std::min(n, 64 * nlist);
    std::vector<float> x(sample * d);
    for (std::size_t i = 0; i < sample; ++i) std::copy_n(keys + (i * n / sample) * d, d, x.begin() + static_cast<std::ptrdiff_t>(i * d));
    return kmeans(x.data(), sample, nlist, d, shift);
  }
  const auto coarse_count = static_cast<std::size_t>(std::ceil(std::sqrt(static_cast<double>(nlist))));
  const std::vector<float> coarse = train_centroids(keys, n, d, coarse_count, shift);
  faiss::IndexFlatL2 coarse_index(static_cast<faiss::Index::idx_t>(d));
  const std::vector<float> safe = faiss_copy(coarse.data(), coarse.size(), shift);
  coarse_index.add(static_cast<faiss::Index::idx_t>(coarse.size() / d), safe.data());
  const std::vector<std::uint32_t> cell = nearest_centroid(coarse_index, keys, n, d, shift);
  std::vector<std::vector<std::size_t>> members(coarse.size() / d);
  for (std::size_t i = 0; i < n; ++i) members[cell[i]].push_back(i);
  std::vector<float> out;
  std::vector<float> x;
  for (const auto& m : members) {
    if (m.empty()) continue;
    const std::size_t k = std::clamp<std::size_t>((nlist * m.size() + n / 2) / n, 1, m.size());
    x.resize(m.size() * d);
    for (std::size_t i = 0; i < m.size(); ++i) std::copy_n(keys + m[i] * d, d, x.begin() + static_cast<std::ptrdiff_t>(i * d));
    const std::vector<float> fine = kmeans(x.data(), m.size(), k, d, shift);
    out.insert(out.end(), fine.begin(), fine.end());
  }
  return out;
}

}  // namespace softkv::detail
