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
#include <optional>
#include <unordered_map>

#include "codec/bytes.hpp"
#include "index/kmeans.hpp"
#include "index/list_store.hpp"
#include "precision.hpp"
#include "scan.hpp"
#include "simd/int_dots.hpp"
#include "thread_pool.hpp"
#include "top_scores.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {

namespace {

using namespace certified;  // the lists' storage: index/list_store.hpp

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

// Centroids a batch's bounds pass scores for all its queries at a time (their scores, 64 a query, stay
// in L1 until they are bounds).
constexpr std::size_t kTileRows = 64;

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
    ++writes_;
  }

  void erase(std::uint64_t id, const RowSpan& all) override {
    journal_.erase(id);
    current_.kill(id);
    rows_ = all.rows;
    ++writes_;
  }

  [[nodiscard]] bool build_due() const override {
    if (journal_.active()) return false;  // one build at a time
    if (writes_ == failed_at_) return false;  // the last build failed: not again before the next write
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
      if (journal_.active()) failed_at_ = writes_;  // (a build that ran and failed, not a stop of an idle journal)
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

  void bounds(const float* query, float factor, std::vector<double>& ub, BoundsSummary& summary) const override {
    ub.resize(current_.lists.size());
    bounds_into(query, &factor, 1, ub.data(), &summary);
  }

  [[nodiscard]] const std::uint32_t* live_counts() const override { return current_.live.data(); }

  void bounds_batch(const float* queries, const float* factors, std::size_t n, std::size_t dim, std::vector<double>& ub,
                    std::vector<BoundsSummary>& summaries) const override {
    (void)dim;  // (the lists' own)
    ub.resize(n * current_.lists.size());
    summaries.assign(n, BoundsSummary{});
    bounds_into(queries, factors, n, ub.data(), summaries.data());
  }

  // A query quantised for the integer centroid pass: q = scale * q16 + delta exactly, |q16[j]| within
  // int_query_limit(d), scale a power of two; delta_norm >= ||delta||.
  struct IntQuery {
    std::vector<std::int16_t> q16;
    double scale = 1;
    double delta_norm = 0;
  };

  // q quantised (IntQuery), or nullopt where the integer pass cannot serve: float centroids (an i8
  // scale would leave the float range), or d too large for int32 sums of int16 x int8 products at a
  // useful resolution (d > 2^31 / (128 * 256), about 65,000).
  [[nodiscard]] std::optional<IntQuery> quantised(const float* q) const {
    const std::size_t d = current_.dim;
    const std::int32_t limit = int_query_limit(d);
    if (current_.centroid_precision != Precision::i8 || limit < 256) return std::nullopt;
    float largest = 0;
    for (std::size_t j = 0; j < d; ++j) largest = std::max(largest, std::fabs(q[j]));
    IntQuery iq;
    iq.q16.assign(d, 0);
    if (!(largest > 0)) return iq;  // (a zero query: every product 0)
    // The smallest power of two with largest / scale <= limit (then every |q[j] / scale| rounds to at most limit).
    int e = 0;
    std::frexp(static_cast<double>(largest) / limit, &e);  // largest / limit < 2^e
    iq.scale = std::ldexp(1.0, e);
    double sum = 0;
    for (std::size_t j = 0; j < d; ++j) {
      const double x = static_cast<double>(q[j]) / iq.scale;  // exact: a power of two
      const double k = std::nearbyint(x);
      iq.q16[j] = static_cast<std::int16_t>(k);
      const double delta = static_cast<double>(q[j]) - k * iq.scale;  // exact in double (a float and a 15-bit multiple of scale)
      sum += delta * delta;
    }
    // The sum of d squares and the root, each within (d + 2) 2^-53 relatively: rounded up past both.
    iq.delta_norm = std::sqrt(sum) * (1 + static_cast<double>(d + 8) * 0x1p-52);
    return iq;
  }

  // Every list's bound for n queries (query i split with factors[i]): ub[i * count + c]. The centroids are
  // scored as a scan is split over the scan threads (about 1 MiB of centroids a part); each part takes
  // its centroids chunk by chunk (256 KiB, within L2), scores the chunk for every query in turn and turns
  // each query's scores into bounds at once, while they are in L1: a batch reads the centroids from
  // memory once, and the bounds' arithmetic runs on every scan thread. i8 centroids (the rule) are scored
  // exactly in integers against each query quantised to int16 (int_dots: a third of the float pass's
  // instructions), the quantisation's error added to the bounds (bounds_from_ints); a batch takes each
  // kTileRows of a chunk for every query while they are in L1, the same integers as each query's own
  // pass. Float centroids go through the kernels' float scores (scores_multi's register tiles for a batch,
  // the same bits as each query's own). With summaries (n of them), each part also gathers each query's
  // walk start over its lists while their bounds are in L1 (BoundsSummary), merged here.
  void bounds_into(const float* queries, const float* factors, std::size_t n, double* ub, BoundsSummary* summaries = nullptr) const {
    const std::size_t count = current_.lists.size(), d = current_.dim;
    if (n == 0) return;
    const RowSpan centroids{current_.centroid_bytes.data(), nullptr, nullptr, count, d, 0, current_.centroid_precision,
                            Precision::f32, current_.centroid_precision == Precision::i8 ? current_.centroid_scales.data() : nullptr};
    const std::size_t chunk = std::max<std::size_t>(64, (std::size_t{256} << 10) / std::max<std::size_t>(1, centroids.key_row_bytes()));
    const std::size_t parts = choose_parts(count, d / 2, 0, ThreadPool::shared().concurrency());
    std::vector<double> fq(n);  // each query's f ||q|| rounded up (bounds_from)
    for (std::size_t i = 0; i < n; ++i) fq[i] = static_cast<double>(factors[i]) * norm_up(queries + i * d, d) * (1 + 4 * kUnit);
    std::vector<IntQuery> ints;  // each query quantised, when the pass is in integers
    for (std::size_t i = 0; i < n; ++i) {
      std::optional<IntQuery> iq = quantised(queries + i * d);
      if (!iq) break;
      ints.push_back(std::move(*iq));
    }
    if (ints.size() < n) ints.clear();
    const IntDots dots = int_dots();
    std::vector<BoundsSummary> gathered(summaries != nullptr ? parts * n : 0);  // part p, query i: [p * n + i]
    for (std::size_t j = 0; j < gathered.size(); ++j) gathered[j].bin_cold = summaries[j % n].bin_cold;
    ThreadPool::shared().run(parts, [&](std::size_t p) {
      thread_local std::vector<float> scores;  // one chunk's scores, or kTileRows rows' for every query (reused)
      thread_local std::vector<std::int32_t> products;  // kTileRows rows' integer products for one query
      const std::size_t begin = count * p / parts, end = count * (p + 1) / parts;
      const auto* rows = reinterpret_cast<const std::int8_t*>(current_.centroid_bytes.data());
      if (!ints.empty()) products.resize(kTileRows);
      else scores.resize(n > 1 ? n * kTileRows : chunk);
      for (std::size_t a = begin; a < end; a += chunk) {
        const std::size_t m = std::min(chunk, end - a);
        if (!ints.empty()) {
          for (std::size_t w = a; w < a + m; w += kTileRows) {
            const std::size_t tile = std::min(kTileRows, a + m - w);
            for (std::size_t i = 0; i < n; ++i) {
              dots(ints[i].q16.data(), rows + w * d, tile, d, products.data());
              bounds_from_ints(factors[i], fq[i], ints[i], products.data(), w, tile, ub + i * count + w);
            }
          }
        } else if (n > 1) {
          for (std::size_t w = a; w < a + m; w += kTileRows) {
            const std::size_t tile = std::min(kTileRows, a + m - w);
            kernels().scores_multi(queries, n, factors, centroids.sub(w, tile), scores.data(), tile);
            for (std::size_t i = 0; i < n; ++i) bounds_from(factors[i], fq[i], scores.data() + i * tile, w, tile, ub + i * count + w);
          }
        } else {
          kernels().scores(queries, factors[0], centroids.sub(a, m), scores.data());
          bounds_from(factors[0], fq[0], scores.data(), a, m, ub + a);
        }
        if (summaries != nullptr)
          for (std::size_t i = 0; i < n; ++i) gathered[p * n + i].add(ub + i * count, current_.live.data(), a, m);
      }
    });
    if (summaries == nullptr) return;
    for (std::size_t i = 0; i < n; ++i) {
      summaries[i] = BoundsSummary{};  // (its bin_cold comes back from the parts, which took it: merge ANDs it)
      for (std::size_t p = 0; p < parts; ++p) summaries[i].merge(gathered[p * n + i]);
      summaries[i].finish(ub + i * count, current_.live.data());
    }
  }

  // The bounds of lists [first, first + m) for one query from their centroid scores (score[j] = the
  // kernel's f * fl(q.mu_c), c = first + j; fq = f ||q|| rounded up). The kernel's score of a member k is
  // f * fl(q.k) rounded once more; fl(q.k) <= fl(q.mu) + ||q|| r + gamma ||q|| (2 ||mu|| + r)
  // (Lists::spread), with gamma covering any order of summation (and FMA). Underflow adds an absolute
  // error of at most 2^-149 per product and per rounding of the score.
  void bounds_from(float factor, double fq, const float* score, std::size_t first, std::size_t m, double* ub) const {
    const double f = factor, tiny = (f * 2 * static_cast<double>(current_.dim) + 2) * kTiny;
    const std::uint32_t* live = current_.live.data() + first;
    const double* spread = current_.spread.data() + first;
    for (std::size_t j = 0; j < m; ++j) {
      const double s = score[j];  // f * fl(q.mu), rounded: within 2u |s| of it
      const double b = s + 2 * kUnit * std::fabs(s) + fq * spread[j] + tiny;
      ub[j] = live[j] == 0 ? -kInf : std::isfinite(b) ? b + 2 * kUnit * std::fabs(b) : kInf;
    }
  }

  // The same from exact integer products (dot[j] = q16 . c8 of centroid c = first + j, whose decoded
  // centroid is mu_c = s_c c8 exactly: s_c is a power of two). q.mu = scale s_c dot + delta.mu, and
  // |delta.mu| <= ||delta|| ||mu||: f q.mu lies within f ||delta|| ||mu_c|| (plus 2^-52 of itself for
  // the one rounding of f times the exact rest) of f scale s_c dot. The rest as bounds_from, whose
  // spread already holds a gamma ||mu|| for the centroid score's own rounding, here none.
  void bounds_from_ints(float factor, double fq, const IntQuery& q, const std::int32_t* dot, std::size_t first, std::size_t m,
                        double* ub) const {
    const double f = factor, tiny = (f * 2 * static_cast<double>(current_.dim) + 2) * kTiny;
    const double f_delta = f * q.delta_norm * (1 + 4 * kUnit);
    const std::uint32_t* live = current_.live.data() + first;
    const double* spread = current_.spread.data() + first;
    const double* norm = current_.centroid_norm.data() + first;
    const float* scale = current_.centroid_scales.data() + first;
    for (std::size_t j = 0; j < m; ++j) {
      const double s = f * (q.scale * static_cast<double>(scale[j]) * static_cast<double>(dot[j]));  // (the inner product exact)
      const double b = s + 0x1p-51 * std::fabs(s) + f_delta * norm[j] + fq * spread[j] + tiny;
      ub[j] = live[j] == 0 ? -kInf : std::isfinite(b) ? b + 2 * kUnit * std::fabs(b) : kInf;
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
      ListWalk walk(*this, q, scales[i], false);  // (a top-k walk: no mass asked)
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
  std::uint64_t writes_ = 0;                                       // puts and erases so far
  std::uint64_t failed_at_ = std::numeric_limits<std::uint64_t>::max();  // writes_ when a build last failed
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

void CertifiedLists::bounds_batch(const float* queries, const float* factors, std::size_t n, std::size_t dim, std::vector<double>& ub,
                                  std::vector<BoundsSummary>& summaries) const {
  const std::size_t count = list_count();
  ub.resize(n * count);
  summaries.assign(n, BoundsSummary{});
  std::vector<double> one;
  for (std::size_t i = 0; i < n; ++i) {
    bounds(queries + i * dim, factors[i], one, summaries[i]);
    std::copy(one.begin(), one.end(), ub.begin() + static_cast<std::ptrdiff_t>(i * count));
  }
}

std::unique_ptr<PruningIndex> make_certified_index(const CollectionConfig& config) {
  return std::make_unique<CertifiedIndex>(config);
}

}  // namespace softkv::detail
