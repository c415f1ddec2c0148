// The certified lists' storage (certified_lists.cpp builds and serves it): centroids, each list's members
// and keys in insertion order, radii that only widen, the id -> slot map, and the refinement that
// splits lists holding two groups. Internal to src/index; included by certified_lists.cpp only.
#pragma once

#include <faiss/IndexFlat.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

#include "index/kmeans.hpp"
#include "index/pruning_index.hpp"
#include "precision.hpp"
#include "thread_pool.hpp"

namespace softkv::detail::certified {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kUnit = 1.0 / 16777216.0;  // float's unit roundoff, 2^-24
const double kTiny = std::ldexp(1.0, -149);  // float's smallest subnormal: the absolute error of an underflow

// Rows per list when ivf_nlist is 0 (before refine() splits lists that hold two groups): small lists
// keep the radii tight, and the centroid pass reads 1/128 of the bytes of float32 keys (i8 centroids).
constexpr std::size_t kRowsPerList = 32;

// ||a - b|| in double, rounded up a little so that it is an upper bound despite its own rounding.
inline double distance_up(const float* a, const float* b, std::size_t d) {
  double s = 0;
  for (std::size_t j = 0; j < d; ++j) {
    const double x = static_cast<double>(a[j]) - static_cast<double>(b[j]);
    s += x * x;
  }
  return std::sqrt(s) * (1 + 1e-12);
}

inline double norm_up(const float* a, std::size_t d) {
  double s = 0;
  for (std::size_t j = 0; j < d; ++j) s += static_cast<double>(a[j]) * a[j];
  return std::sqrt(s) * (1 + 1e-12);
}

// One list: its members in insertion order (dead ones stay until a rebuild), their keys, its radius.
struct List {
  std::vector<std::uint64_t> ids;
  std::vector<float> keys;
  std::vector<std::uint8_t> dead;
  std::uint32_t live = 0;
  double radius = 0;  // >= ||k - centroid|| for every member added since the build
};

// Where a live id sits.
struct Slot {
  std::uint32_t list;
  std::uint32_t position;
};

// A built index: centroids, lists and the id -> slot map.
struct Lists {
  std::size_t dim = 0;
  int shift = 0;                              // FAISS's copies are keys times 2^-shift
  std::size_t trained_rows = 0;               // rows at the build (a rebuild is due at 4x)
  std::size_t trained_lists = 0;              // lists at the build (lists of one far key are added up to 2x)
  std::vector<float> centroids;               // L x d, the rounded centroids the bounds are stated for
  Precision centroid_precision = Precision::i8;
  std::vector<std::byte> centroid_bytes;      // the same at centroid_precision, as the kernels score them
  std::vector<float> centroid_scales;         // i8: one scale per centroid
  std::vector<double> centroid_norm;          // ||mu_c||, rounded up
  std::vector<List> lists;
  // Per list, what bounds() reads for every query, side by side (a List is too large to stream):
  std::vector<std::uint32_t> live;            // live members
  std::vector<double> spread;                 // r_c (1 + gamma) + 2 gamma ||mu_c||: times f ||q'|| it bounds q'.(k - mu_c) plus rounding
  std::unordered_map<std::uint64_t, Slot> slot_of;
  std::unique_ptr<faiss::IndexFlatL2> quantizer;  // the centroids under shift, to assign new keys
  std::size_t dead = 0;

  [[nodiscard]] bool ready() const { return !lists.empty(); }

  // The float rounding of a d-term dot product in any summation order (FMA included), relative to
  // sum |q_j k_j|: (d + 2) u, with 1% to spare.
  [[nodiscard]] double gamma() const { return (static_cast<double>(dim) + 2) * kUnit * 1.01; }

  // Brings list c's entries of live and spread up to date (after its members or radius changed).
  void sync(std::size_t c) {
    if (live.size() < lists.size()) {
      live.resize(lists.size(), 0);
      spread.resize(lists.size(), 0);
    }
    live[c] = lists[c].live;
    spread[c] = lists[c].radius * (1 + gamma()) + 2 * gamma() * centroid_norm[c];
  }
  void sync_all() {
    for (std::size_t c = 0; c < lists.size(); ++c) sync(c);
  }

  // Rounds the centroids to the precision they are scored at (i8 with a scale per centroid; f32 if one
  // is not finite) and sets up
  // the quantizer; the bounds are then stated for the rounded centroids, so the rounding costs nothing.
  void set_centroids(std::vector<float> c) {
    const std::size_t count = c.size() / dim;
    float largest = 0;
    for (float v : c) largest = std::max(largest, std::fabs(v));
    // i8 rows decode to q * scale with a power-of-two scale: past 2^120 that could leave the float range.
    centroid_precision = largest < 0x1p120f ? Precision::i8 : Precision::f32;
    const std::size_t row = dim * RowSpan::bytes_of(centroid_precision);
    centroid_bytes.assign(count * row, std::byte{0});
    centroid_scales.assign(count, 1.0f);
    for (std::size_t i = 0; i < count; ++i) encode_centroid(i, c.data() + i * dim, c.data() + i * dim);
    centroids = std::move(c);
    centroid_norm.resize(count);
    for (std::size_t i = 0; i < count; ++i) centroid_norm[i] = norm_up(centroids.data() + i * dim, dim);
    lists.assign(count, List{});
    live.assign(count, 0);
    spread.assign(count, 0);
    sync_all();
    trained_lists = count;
    quantizer = std::make_unique<faiss::IndexFlatL2>(static_cast<faiss::Index::idx_t>(dim));
    const std::vector<float> safe = faiss_copy(centroids.data(), centroids.size(), shift);
    quantizer->add(static_cast<faiss::Index::idx_t>(count), safe.data());
  }

  void kill(std::uint64_t id) {
    const auto it = slot_of.find(id);
    if (it == slot_of.end()) return;
    List& l = lists[it->second.list];
    l.dead[it->second.position] = 1;
    --l.live;
    live[it->second.list] = l.live;
    ++dead;
    slot_of.erase(it);
  }

  // Whether x (dim floats) fits the centroids' precision (i8 takes any row below 2^120, with its own scale).
  [[nodiscard]] bool fits(const float* x) const {
    const float limit = centroid_precision == Precision::i8 ? 0x1p120f : std::numeric_limits<float>::max();
    return std::all_of(x, x + dim, [&](float v) { return std::fabs(v) < limit; });
  }

  // Stores centroid c's bytes (and i8 scale) from x, and writes the rounded centroid to out.
  void encode_centroid(std::size_t c, const float* x, float* out) {
    const std::size_t row = dim * RowSpan::bytes_of(centroid_precision);
    const float scale = centroid_precision == Precision::i8 ? i8_scale(x, dim) : 1.0f;
    centroid_scales[c] = scale;
    encode_row(centroid_precision, x, dim, scale, centroid_bytes.data() + c * row);
    decode_row(centroid_precision, centroid_bytes.data() + c * row, dim, scale, out);
  }

  // Sets centroid c (c == count: a new one, with an empty list) to x rounded to the centroids' precision.
  void set_centroid(std::size_t c, const float* x) {
    const std::size_t row = dim * RowSpan::bytes_of(centroid_precision);
    if (c == lists.size()) {
      centroid_bytes.resize((c + 1) * row);
      centroid_scales.push_back(1.0f);
      centroids.resize((c + 1) * dim);
      centroid_norm.push_back(0);
      lists.emplace_back();
    }
    encode_centroid(c, x, centroids.data() + c * dim);
    centroid_norm[c] = norm_up(centroids.data() + c * dim, dim);
    sync(c);
  }

  // A list of its own for a key far outside every list (its centroid is the key, rounded); false when
  // the key does not fit the centroids' precision.
  bool add_list(const float* key) {
    if (!fits(key)) return false;
    const std::size_t c = lists.size();
    set_centroid(c, key);
    const std::vector<float> safe = faiss_copy(centroids.data() + c * dim, dim, shift);
    quantizer->add(1, safe.data());
    return true;
  }

  // Splits lists whose radius is more than twice that of the list at the 10th percentile (k-means leaves
  // some lists holding several clusters: their radius, about half the clusters' distance, bounds nothing)
  // in two by 2-means, examining the halves again; at most quadruples the lists. Before any removal. The
  // 10th percentile, not the median: where clusters are smaller than a list (clusters of ~14 rows, lists of
  // 32), most lists hold two or more and the median is one of them — every query then scanned; lists of one
  // cluster are the tightest tenth still. Homogeneous data keeps radii within ~20% of each other: no split.
  // Only lists of a quarter of kRowsPerList members or more count (k-means on spread data leaves many lists of
  // a point or two, radius ~0: counted, they made every list "wide" and quadrupled 1M Gaussian keys' lists).
  void refine() {
    std::vector<double> radii;
    for (const List& l : lists)
      if (l.live >= kRowsPerList / 4) radii.push_back(l.radius);
    if (radii.empty())
      for (const List& l : lists)
        if (l.live > 0) radii.push_back(l.radius);
    if (radii.empty()) return;
    std::nth_element(radii.begin(), radii.begin() + static_cast<std::ptrdiff_t>(radii.size() / 10), radii.end());
    const double wide = 2 * radii[radii.size() / 10];
    const std::size_t most = 4 * lists.size();
    std::vector<float> mean(2 * dim);
    for (std::size_t c = 0; c < lists.size() && lists.size() < most;) {
      List& l = lists[c];
      const std::size_t n = l.ids.size();
      std::vector<std::uint8_t> side;
      if (l.live < 2 || l.live != n || !(l.radius > wide) || !two_means(l.keys.data(), n, mean, side) || !fits(mean.data()) || !fits(mean.data() + dim)) {
        ++c;
        continue;
      }
      // A wide list is always split: a mixture of many clusters splits into halves about as wide as the
      // whole (its clusters are all about equally far apart, and a half's centre moves off the whole's),
      // which split again until they are tight or hold one row.
      List whole = std::move(l);
      const std::size_t other = lists.size();
      set_centroid(c, mean.data());
      set_centroid(other, mean.data() + dim);
      lists[c] = List{};
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t to = side[i] == 0 ? c : other;
        List& dst = lists[to];
        dst.radius = std::max(dst.radius, distance_up(whole.keys.data() + i * dim, centroids.data() + to * dim, dim));
        slot_of[whole.ids[i]] = {static_cast<std::uint32_t>(to), static_cast<std::uint32_t>(dst.ids.size())};
        dst.ids.push_back(whole.ids[i]);
        dst.keys.insert(dst.keys.end(), whole.keys.begin() + static_cast<std::ptrdiff_t>(i * dim),
                        whole.keys.begin() + static_cast<std::ptrdiff_t>((i + 1) * dim));
        dst.dead.push_back(0);
        ++dst.live;
      }
    }
    trained_lists = lists.size();
    sync_all();
    quantizer = std::make_unique<faiss::IndexFlatL2>(static_cast<faiss::Index::idx_t>(dim));
    const std::vector<float> safe = faiss_copy(centroids.data(), centroids.size(), shift);
    quantizer->add(static_cast<faiss::Index::idx_t>(lists.size()), safe.data());
  }

  // 2-means of n keys in double, seeded with the point farthest from the first and the point farthest
  // from that; false when the keys do not split (all equal). mean gets the two centres, side each key's.
  [[nodiscard]] bool two_means(const float* keys, std::size_t n, std::vector<float>& mean, std::vector<std::uint8_t>& side) const {
    auto far_from = [&](const float* x) {
      std::size_t best = 0;
      double top = -1;
      for (std::size_t i = 0; i < n; ++i) {
        const double dd = distance_up(keys + i * dim, x, dim);
        if (dd > top) top = dd, best = i;
      }
      return best;
    };
    const std::size_t a = far_from(keys), b = far_from(keys + a * dim);
    if (distance_up(keys + a * dim, keys + b * dim, dim) == 0) return false;
    std::copy_n(keys + a * dim, dim, mean.begin());
    std::copy_n(keys + b * dim, dim, mean.begin() + static_cast<std::ptrdiff_t>(dim));
    side.assign(n, 0);
    std::vector<double> sum(2 * dim);
    for (int iteration = 0; iteration < 6; ++iteration) {
      std::fill(sum.begin(), sum.end(), 0.0);
      std::size_t count[2] = {0, 0};
      for (std::size_t i = 0; i < n; ++i) {
        const float* x = keys + i * dim;
        side[i] = distance_up(x, mean.data() + dim, dim) < distance_up(x, mean.data(), dim) ? 1 : 0;
        ++count[side[i]];
        for (std::size_t j = 0; j < dim; ++j) sum[side[i] * dim + j] += x[j];
      }
      if (count[0] == 0 || count[1] == 0) return false;
      for (int h = 0; h < 2; ++h)
        for (std::size_t j = 0; j < dim; ++j) mean[h * dim + j] = static_cast<float>(sum[h * dim + j] / static_cast<double>(count[h]));
    }
    return true;
  }

  // Appends n keys (ids[i] at keys + i * dim) to the lists of their nearest centroids. After the build
  // (grow), a key more than twice its list's radius away from its centroid (one added far from the data
  // the lists were trained on) starts a list of its own instead of widening that list's bound for every query.
  void append(const std::uint64_t* ids, const float* keys, std::size_t n, bool grow = true) {
    std::vector<std::uint32_t> to = nearest_centroid(*quantizer, keys, n, dim, shift);
    for (std::size_t i = 0; i < n; ++i) {
      kill(ids[i]);  // a replaced entry (or an id repeated in the batch) keeps only its newest key
      const float* key = keys + i * dim;
      double distance = distance_up(key, centroids.data() + to[i] * dim, dim);
      if (grow && lists[to[i]].live > 0 && distance > 2 * lists[to[i]].radius && lists.size() < 2 * trained_lists && add_list(key)) {
        to[i] = static_cast<std::uint32_t>(lists.size() - 1);
        distance = distance_up(key, centroids.data() + to[i] * dim, dim);
      }
      List& l = lists[to[i]];
      l.radius = std::max(l.radius, distance);
      slot_of[ids[i]] = {to[i], static_cast<std::uint32_t>(l.ids.size())};
      l.ids.push_back(ids[i]);
      l.keys.insert(l.keys.end(), key, key + dim);
      l.dead.push_back(0);
      ++l.live;
      sync(to[i]);
    }
  }
};

}  // namespace softkv::detail::certified
