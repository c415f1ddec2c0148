// Certified inverted lists: centroids from FAISS k-means; lists, bounds and search are softkv's.
//
// Each list keeps its members' keys contiguously (float32 copies of the keys as stored) and a radius r_c
// with ||k - mu_c|| <= r_c for every member ever added to it (writes only widen it until a rebuild), so
//   q.k <= q.mu_c + ||q|| r_c
// for every member; with the float rounding of both dot products added, ub_c bounds the kernel's score of
// every member. Visiting lists by decreasing ub_c, a query knows the best score any unvisited key can
// reach and the most mass the unvisited lists can hold: the exact top-k and a guaranteed tail bound.
#include "index/certified_lists.hpp"

#include <faiss/IndexFlat.h>
#include <faiss/impl/FaissException.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "codec/bytes.hpp"
#include "index/kmeans.hpp"
#include "precision.hpp"
#include "scan.hpp"
#include "thread_pool.hpp"
#include "top_scores.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kUnit = 1.0 / 16777216.0;  // float's unit roundoff, 2^-24
const double kTiny = std::ldexp(1.0, -149);  // float's smallest subnormal: the absolute error of an underflow

// Rows per list when ivf_nlist is 0 (before refine() splits lists that hold two groups): small lists
// keep the radii tight, and the centroid pass reads 1/128 of the bytes of float32 keys (i8 centroids).
constexpr std::size_t kRowsPerList = 32;

// ||a - b|| in double, rounded up a little so that it is an upper bound despite its own rounding.
double distance_up(const float* a, const float* b, std::size_t d) {
  double s = 0;
  for (std::size_t j = 0; j < d; ++j) {
    const double x = static_cast<double>(a[j]) - static_cast<double>(b[j]);
    s += x * x;
  }
  return std::sqrt(s) * (1 + 1e-12);
}

double norm_up(const float* a, std::size_t d) {
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

  // Splits lists whose radius is more than twice the median list's (k-means leaves some lists holding
  // several clusters: their radius, about half the clusters' distance, bounds nothing) in two by 2-means,
  // examining the halves again; at most doubles the lists. Before any removal.
  void refine() {
    std::vector<double> radii;
    for (const List& l : lists)
      if (l.live > 0) radii.push_back(l.radius);
    if (radii.empty()) return;
    std::nth_element(radii.begin(), radii.begin() + static_cast<std::ptrdiff_t>(radii.size() / 2), radii.end());
    const double wide = 2 * radii[radii.size() / 2];
    const std::size_t most = 2 * lists.size();
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

class CertifiedIndex;

// The rows copied for a build and the lists built from them without the collection's lock.
class ListsBuild final : public IndexBuild {
 public:
  ListsBuild(const CertifiedIndex& owner, const RowSpan& all)
      : owner_(owner), ids_(all.ids, all.ids + all.rows), keys_(all.rows * all.dim), dim_(all.dim) {
    for (std::size_t r = 0; r < all.rows; ++r) key_row(all, r, keys_.data() + r * all.dim);
  }
  void run() override;
  Lists built;

 private:
  const CertifiedIndex& owner_;
  std::vector<std::uint64_t> ids_;
  std::vector<float> keys_;
  std::size_t dim_;
};

// "CIVF" and format 1: certified lists (the FAISS IVF bytes of older snapshots fail it and are rebuilt).
constexpr std::uint64_t kHeader = std::uint64_t{0x46564943} << 32 | 1;

class CertifiedIndex final : public PruningIndex, public CertifiedLists {
 public:
  explicit CertifiedIndex(const CollectionConfig& config) : config_(config) {}

  [[nodiscard]] IndexKind kind() const override { return ready() ? IndexKind::ivf : IndexKind::exact; }
  [[nodiscard]] bool ready() const override { return current_.ready(); }
  [[nodiscard]] bool exact_top_k() const override { return true; }
  [[nodiscard]] const CertifiedLists* lists() const override { return ready() ? this : nullptr; }

  void put(std::span<const std::uint64_t> ids, const float* keys, const RowSpan& all) override {
    journal_.put(ids, keys, all.dim);
    if (current_.ready()) {
      OmpThreads threads(ids.size() >= 4096 ? index_build_threads() : 1);
      current_.append(ids.data(), keys, ids.size());
    }
    rows_ = all.rows;
  }

  void erase(std::uint64_t id, const RowSpan& all) override {
    journal_.erase(id);
    current_.kill(id);
    rows_ = all.rows;
  }

  [[nodiscard]] bool build_due() const override {
    if (journal_.active()) return false;  // one build at a time
    if (!current_.ready()) return rows_ >= train_threshold();
    if (config_.index.ivf_nlist == 0 && rows_ >= 4 * std::max<std::size_t>(1, current_.trained_rows)) return true;  // lists grew 4x
    if (current_.lists.size() >= 2 * current_.trained_lists) return true;  // many keys came far from the trained lists
    return static_cast<double>(current_.dead) > config_.index.rebuild_fraction * static_cast<double>(std::max<std::size_t>(1, rows_));
  }

  std::unique_ptr<IndexBuild> start_build(const RowSpan& all) override {
    rows_ = all.rows;
    if (!build_due()) return nullptr;
    journal_.start();
    return std::make_unique<ListsBuild>(*this, all);
  }

  void finish_build(std::unique_ptr<IndexBuild> build) override {
    auto* b = static_cast<ListsBuild*>(build.get());
    if (b == nullptr || !b->built.ready()) {  // the build failed: keep serving from the current lists
      journal_.stop();
      return;
    }
    OmpThreads threads(1);
    journal_.replay_into(b->built);
    current_ = std::move(b->built);
  }

  void build_now(const RowSpan& all) override {
    rows_ = all.rows;
    if (!build_due()) return;
    ListsBuild b(*this, all);
    b.run();
    if (b.built.ready()) current_ = std::move(b.built);
  }

  // Builds lists over n keys; empty while there are too few rows.
  [[nodiscard]] Lists build(const std::uint64_t* ids, const float* keys, std::size_t n, std::size_t d) const {
    Lists b;
    if (n < train_threshold() || n == 0) return b;
    OmpThreads threads(index_build_threads());
    b.dim = d;
    b.shift = faiss_shift(keys, n * d);
    b.trained_rows = n;
    b.set_centroids(train_centroids(keys, n, d, nlist_for(n), b.shift));
    b.append(ids, keys, n, false);
    b.refine();
    return b;
  }

  // ---- CertifiedLists ----
  [[nodiscard]] std::size_t list_count() const override { return current_.lists.size(); }

  void bounds(const float* query, float factor, std::vector<double>& ub, std::vector<std::uint32_t>& live) const override {
    const std::size_t count = current_.lists.size(), d = current_.dim;
    thread_local std::vector<float> buffer;  // reused: a fresh buffer per query would be page-faulted in
    buffer.resize(count);
    float* const score = buffer.data();  // (the parts below run on other threads: they get the pointer, not the name)
    const RowSpan centroids{current_.centroid_bytes.data(), nullptr, nullptr, count, d, 0, current_.centroid_precision,
                            Precision::f32, current_.centroid_precision == Precision::i8 ? current_.centroid_scales.data() : nullptr};
    // Split over the scan threads as a scan is (about 1 MiB of centroids a part).
    const std::size_t parts = choose_parts(count, d / 2, 0, ThreadPool::shared().concurrency());
    ThreadPool::shared().run(parts, [&](std::size_t p) {
      const std::size_t begin = count * p / parts, end = count * (p + 1) / parts;
      kernels().scores(query, factor, centroids.sub(begin, end - begin), score + begin);
    });
    // The kernel's score of a member k is f * fl(q.k) rounded once more; fl(q.k) <= fl(q.mu) + ||q|| r
    // + gamma ||q|| (2 ||mu|| + r) (Lists::spread), with gamma covering any order of summation (and FMA).
    // Underflow adds an absolute error of at most 2^-149 per product and per rounding of the score.
    const double f = factor, fq = f * norm_up(query, d) * (1 + 4 * kUnit), tiny = (f * 2 * static_cast<double>(d) + 2) * kTiny;
    ub.resize(count);
    live.assign(current_.live.begin(), current_.live.end());
    const double* spread = current_.spread.data();
    for (std::size_t c = 0; c < count; ++c) {
      const double s = score[c];  // f * fl(q.mu), rounded: within 2u |s| of it
      const double b = s + 2 * kUnit * std::fabs(s) + fq * spread[c] + tiny;
      ub[c] = live[c] == 0 ? -kInf : std::isfinite(b) ? b + 2 * kUnit * std::fabs(b) : kInf;
    }
  }

  double score_list(std::size_t c, const float* query, float factor, std::vector<std::uint64_t>& ids,
                    std::vector<float>& scores) const override {
    const List& l = current_.lists[c];
    const std::size_t d = current_.dim, first = scores.size();
    scores.resize(first + l.ids.size());
    const RowSpan rows{l.keys.data(), nullptr, l.ids.data(), l.ids.size(), d, 0};
    kernels().scores(query, factor, rows, scores.data() + first);
    std::size_t kept = first;  // drop the dead members in place
    for (std::size_t i = 0; i < l.ids.size(); ++i) {
      if (l.dead[i] != 0) continue;
      scores[kept++] = scores[first + i];
      ids.push_back(l.ids[i]);
    }
    scores.resize(kept);
    // |fl(q.k) - q.k| <= gamma ||q|| ||k||, ||k|| <= ||mu|| + r; the underflow terms as in bounds().
    const double f = factor;
    return f * norm_up(query, d) * current_.gamma() * (current_.centroid_norm[c] + l.radius) * (1 + 4 * kUnit) +
           (f * 2 * static_cast<double>(d) + 2) * kTiny;
  }

  // ---- search: the exact top-k, best first (higher score, then smaller id) ----
  [[nodiscard]] std::vector<std::vector<std::uint64_t>> search(const float* queries, const float* scales, std::size_t n,
                                                               const RowSpan& all, const IndexSearch& p) const override {
    std::vector<std::vector<std::uint64_t>> out(n);
    if (!ready() || p.k == 0) return out;
    std::vector<std::uint64_t> ids;
    std::vector<float> scores;
    for (std::size_t i = 0; i < n; ++i) {
      const float* q = queries + i * all.dim;
      ListWalk walk(*this, q, scales[i]);
      TopScores best(p.k, nullptr);
      // Stop once the k-th score beats every unvisited bound strictly: no unvisited key can tie it.
      while (!walk.done() && !(best.full() && static_cast<double>(best.worst().score) > walk.next_bound())) {
        ids.clear();
        scores.clear();
        score_list(walk.next(), q, scales[i], ids, scores);
        best.offer_ids(scores.data(), ids.data(), ids.size());
      }
      for (const TopScores::Item& item : best.sorted()) out[i].push_back(item.id);
    }
    return out;
  }

  // ---- persistence: centroids and membership; keys and radii are taken from the rows on load ----
  [[nodiscard]] std::vector<std::byte> save() const override {
    if (!ready()) return {};
    ByteWriter w;
    w.put(kHeader);
    w.put(std::uint64_t{current_.dim});
    w.put(static_cast<std::uint64_t>(current_.shift));
    w.put(std::uint64_t{current_.trained_rows});
    w.put(std::uint64_t{current_.lists.size()});
    w.put_array(std::span<const float>(current_.centroids));
    for (const List& l : current_.lists) {
      std::vector<std::uint64_t> live;
      for (std::size_t i = 0; i < l.ids.size(); ++i)
        if (l.dead[i] == 0) live.push_back(l.ids[i]);
      w.put(std::uint64_t{live.size()});
      w.put_array(std::span<const std::uint64_t>(live));
    }
    return std::move(w.bytes());
  }

  bool load(std::span<const std::byte> bytes, const RowSpan& all) override {
    try {
      ByteReader r(bytes);
      if (r.get<std::uint64_t>("index header") != kHeader) return false;
      Lists b;
      b.dim = r.get<std::uint64_t>("index dimension");
      const auto shift = r.get<std::uint64_t>("index key shift");
      if (shift > 255) return false;
      b.shift = static_cast<int>(shift);
      b.trained_rows = r.get<std::uint64_t>("index trained rows");
      const auto count = r.get<std::uint64_t>("list count");
      if (b.dim != all.dim || count == 0 || count > (std::uint64_t{1} << 32)) return false;
      b.set_centroids(to_vector<float>(r.take_array<float>(count * b.dim, "centroids")));
      std::unordered_map<std::uint64_t, std::size_t> row_of;
      row_of.reserve(all.rows);
      for (std::size_t i = 0; i < all.rows; ++i) row_of.emplace(all.ids[i], i);
      std::vector<float> key(all.dim);
      std::size_t members = 0;
      for (std::size_t c = 0; c < count; ++c) {
        const auto n = r.get<std::uint64_t>("list size");
        const auto ids = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(n, "list members"));
        List& l = b.lists[c];
        for (std::uint64_t id : ids) {
          const auto it = row_of.find(id);
          if (it == row_of.end() || b.slot_of.contains(id)) return false;  // the members must be exactly the rows
          key_row(all, it->second, key.data());
          l.radius = std::max(l.radius, distance_up(key.data(), b.centroids.data() + c * b.dim, b.dim));
          b.slot_of[id] = {static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(l.ids.size())};
          l.ids.push_back(id);
          l.keys.insert(l.keys.end(), key.begin(), key.end());
          l.dead.push_back(0);
          ++l.live;
          ++members;
        }
      }
      if (r.remaining() > 0 || members != all.rows) return false;
      b.sync_all();
      current_ = std::move(b);
      rows_ = all.rows;
      return true;
    } catch (const Error&) {
      return false;
    } catch (const faiss::FaissException&) {
      return false;
    }
  }

 private:
  [[nodiscard]] std::size_t train_threshold() const {
    std::size_t n = config_.index.ivf_train_size > 0 ? config_.index.ivf_train_size
                                                     : 39 * std::max<std::size_t>(config_.index.ivf_nlist, 16);
    if (config_.index.kind == IndexKind::automatic) n = std::max(n, config_.index.auto_threshold);
    return std::max<std::size_t>(n, 1);
  }

  [[nodiscard]] std::size_t nlist_for(std::size_t n) const {
    const std::size_t wanted = config_.index.ivf_nlist > 0 ? config_.index.ivf_nlist : n / kRowsPerList;
    return std::clamp<std::size_t>(wanted, 1, n);
  }

  friend class ListsBuild;
  CollectionConfig config_;
  Lists current_;
  std::size_t rows_ = 0;
  BuildJournal journal_;  // writes made while a build runs
};

void ListsBuild::run() {
  try {
    built = owner_.build(ids_.data(), keys_.data(), ids_.size(), dim_);
  } catch (const faiss::FaissException& e) {
    built = Lists{};  // the current index keeps serving (or the exact scan before the first build)
  }
}

}  // namespace

std::unique_ptr<PruningIndex> make_certified_index(const CollectionConfig& config) {
  return std::make_unique<CertifiedIndex>(config);
}

}  // namespace softkv::detail
