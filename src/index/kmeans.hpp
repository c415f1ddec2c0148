// Centroids for the certified lists: FAISS's k-means (L2) over keys handed to FAISS scaled by 2^-shift
// (faiss_copy, pruning_index.hpp), and the nearest centroid of each key. Internal to src/index.
#pragma once

#include <faiss/IndexFlat.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace softkv::detail {

/// About nlist centroids (row-major, at the keys' scale) for n keys of d floats: one k-means for up to
/// 256 lists; for more, a coarse k-means and a fine one inside each coarse cell (FAISS's k-means costs
/// n x lists x d per iteration: 1M keys into 62,500 lists at once would take an hour on two cores, in
/// two levels it takes seconds).
[[nodiscard]] std::vector<float> train_centroids(const float* keys, std::size_t n, std::size_t d, std::size_t nlist, int shift);

/// The nearest of the centroids (as FAISS holds them: scaled by 2^-shift) for each of n keys; a key whose
/// distances overflow gets centroid 0 (any list is correct: its radius grows to cover the key).
[[nodiscard]] std::vector<std::uint32_t> nearest_centroid(const faiss::IndexFlatL2& centroids, const float* keys, std::size_t n,
                                                          std::size_t d, int shift);

}  // namespace softkv::detail
