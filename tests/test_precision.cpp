// Compact storage (f16, bf16, i8 keys): conversions, every kernel path x precision, the error bound, range errors, persistence.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>

#include "errors.hpp"
#include "precision.hpp"
#include "reference.hpp"
#include "scan.hpp"
#include "simd/kernel_table.hpp"
#include "simd/tile_gemm.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"
#include "wire/protocol.hpp"

using namespace softkv;
using namespace softkv::detail;

namespace {

std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The value of binary16 bits h, computed independently of from_f16 (in double).
double f16_value(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  const double v = exp == 0 ? std::ldexp(man, -24) : exp == 31 ? std::numeric_limits<double>::infinity()
                                                               : std::ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

struct Case {
  Precision key, value;
};
const Case kCases[] = {{Precision::f32, Precision::f32}, {Precision::f16, Precision::f16},   {Precision::bf16, Precision::bf16},
                       {Precision::i8, Precision::f16},  {Precision::i8, Precision::bf16},   {Precision::f16, Precision::f32},
                       {Precision::i8, Precision::f32},  {Precision::f32, Precision::bf16}};

std::string name_of(const Case& c) {
  return std::string(precision_name(c.key)) + "/" + std::string(precision_name(c.value));
}

// Rows stored at a precision (bytes + i8 scales) next to their float32 widening.
struct Stored {
  Precision precision;
  std::size_t width;
  std::vector<std::byte> bytes;
  std::vector<float> scales, widened;
  Stored(Precision p, const std::vector<float>& x, std::size_t n, std::size_t w)
      : precision(p), width(w), bytes(n * w * element_bytes(p)), scales(n, 1.0f), widened(n * w) {
    for (std::size_t r = 0; r < n; ++r) {
      if (p == Precision::i8) scales[r] = i8_scale(x.data() + r * w, w);
      encode_row(p, x.data() + r * w, w, scales[r], bytes.data() + r * w * element_bytes(p));
      decode_row(p, bytes.data() + r * w * element_bytes(p), w, scales[r], widened.data() + r * w);
    }
  }
};

// A compact span and the float32 span of the same (widened) rows.
struct Slice {
  std::size_t n, d, dv;
  Stored keys, values;
  std::vector<std::uint64_t> ids;
  Slice(const Case& c, std::size_t n_, std::size_t d_, std::size_t dv_, std::uint64_t seed, float key_stddev = 1.0f)
      : n(n_), d(d_), dv(dv_), keys(c.key, test::normal_floats(n_ * d_, seed, key_stddev), n_, d_),
        values(c.value, test::normal_floats(n_ * dv_, seed + 1), n_, dv_), ids(n_) {
    std::iota(ids.begin(), ids.end(), 0);
  }
  [[nodiscard]] RowSpan compact() const {
    return {keys.bytes.data(), values.bytes.data(), ids.data(), n, d, dv, keys.precision, values.precision,
            keys.precision == Precision::i8 ? keys.scales.data() : nullptr};
  }
  [[nodiscard]] RowSpan widened() const { return {keys.widened.data(), values.widened.data(), ids.data(), n, d, dv}; }
};

std::vector<const KernelTable*> all_paths() {
  std::vector<const KernelTable*> tables;
  for (std::string_view name : available_simd_paths()) tables.push_back(kernels_named(name));
  return tables;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);  // (memcmp of null: UB)
}

// Collects every score a scan offers.
struct AllScores final : ScoreSink {
  std::vector<float> scores;
  explicit AllScores(std::size_t n) : scores(n) {}
  void offer(const float* s, std::size_t first, std::size_t count) override { std::copy_n(s, count, scores.begin() + first); }
};

}  // namespace

TEST_CASE("f16 conversion: every binary16 value decodes exactly and encodes back, ties round to even", "[precision]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    if ((h & 0x7C00) == 0x7C00) continue;  // infinities and NaNs are never stored
    const float f = from_f16(h16);
    REQUIRE(static_cast<double>(f) == f16_value(h16));
    REQUIRE(to_f16(f) == h16);
    // Halfway to the next magnitude: rounds to the even neighbour; a hair either side rounds to the nearer.
    if ((h & 0x7FFF) == 0x7BFF) continue;
    const float next = from_f16(static_cast<std::uint16_t>(h + 1));
    const double mid_d = (static_cast<double>(f) + next) / 2;
    const float mid = static_cast<float>(mid_d);
    REQUIRE(static_cast<double>(mid) == mid_d);
    const std::uint16_t even = (h & 1) == 0 ? h16 : static_cast<std::uint16_t>(h + 1);
    REQUIRE(to_f16(mid) == even);
    REQUIRE(to_f16(std::nextafter(mid, f)) == h16);
    REQUIRE(to_f16(std::nextafter(mid, next)) == static_cast<std::uint16_t>(h + 1));
  }
  CHECK(to_f16(65519.0f) == 0x7BFF);  // below the halfway point to 65536: the largest finite value
  CHECK(to_f16(1e-9f) == 0);          // below half the smallest subnormal
  CHECK(max_magnitude(Precision::f16) == 65504.0f);
}

TEST_CASE("bf16 conversion: decodes by a shift, encodes to nearest even", "[precision]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    if ((h & 0x7F80) == 0x7F80) continue;
    const float f = from_bf16(h16);
    REQUIRE(bits(f) == h << 16);
    REQUIRE(to_bf16(f) == h16);
    if ((h & 0x7FFF) == 0x7F7F) continue;
    const std::uint32_t mid_bits = (h << 16) | 0x8000u;  // halfway to the next magnitude
    float mid;
    std::memcpy(&mid, &mid_bits, 4);
    REQUIRE(to_bf16(mid) == ((h & 1) == 0 ? h16 : static_cast<std::uint16_t>(h + 1)));
  }
  CHECK(std::isinf(from_bf16(to_bf16(std::numeric_limits<float>::max()))));  // why FLT_MAX is refused for bf16
  CHECK(std::isfinite(from_bf16(to_bf16(max_magnitude(Precision::bf16)))));
}

TEST_CASE("i8 scale: the smallest power of two that fits the largest magnitude in 127 steps, and quantising is idempotent", "[precision]") {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<std::vector<float>> rows = {{0, 0, 0},    {1, -1, 0.5f}, {127, 3, -5},   {127.5f, 0, 1},  {-128, 1, 2},
                                                {max_magnitude(Precision::i8), -1e38f, 1}, {tiny, 0, -tiny}, {1e-30f, 3e-31f, 0}, {63.5f, 1, 2},
                                                {0.1f, -0.37f, 0.99f}};
  for (const auto& row : rows) {
    const float s = i8_scale(row.data(), row.size());
    int e = 0;
    CHECK(std::frexp(s, &e) == 0.5f);  // a power of two
    double m = 0;
    for (float x : row) m = std::max(m, std::fabs(static_cast<double>(x)));
    CHECK(m <= 127.0 * s);
    if (m > 0 && s > tiny) CHECK(m > 127.0 * s / 2);  // the next smaller power of two would not fit
    std::vector<std::byte> q(row.size()), q2(row.size());
    std::vector<float> back(row.size());
    encode_row(Precision::i8, row.data(), row.size(), s, q.data());
    decode_row(Precision::i8, q.data(), row.size(), s, back.data());
    for (std::size_t i = 0; i < row.size(); ++i) CHECK(std::fabs(back[i] - static_cast<double>(row[i])) <= s / 2.0);
    const float s2 = i8_scale(back.data(), back.size());
    CHECK(s2 == s);
    encode_row(Precision::i8, back.data(), back.size(), s2, q2.data());
    CHECK(q == q2);
  }
}

// The tile products a batch over path k can run: its own, and libxsmm's where tiles_for hands them out.
static std::vector<TileProducts> tiles_of(const KernelTable& k) {
  std::vector<TileProducts> all = {k.tiles};
  if (have_libxsmm()) {
    force_tile_products("libxsmm");
    const TileProducts jit = tiles_for(k);
    force_tile_products("auto");
    if (jit.scores != k.tiles.scores || jit.blend != k.tiles.blend) all.push_back(jit);
  }
  return all;
}

TEST_CASE("every kernel path at every precision equals the float32 kernel on the stored rows, bit for bit", "[precision][kernels]") {
  const std::vector<std::size_t> dims = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129, 300, 512, 768};
  for (const KernelTable* k : all_paths()) {
    const std::vector<TileProducts> tile_sets = tiles_of(*k);
    for (const Case& c : kCases) {
      for (std::size_t d : dims) {
        const std::size_t n = d >= 300 ? 300 : 517, dv = d == 768 ? 129 : d;  // two and a bit blocks; d = 300/768 widen in chunks
        INFO(k->name << " " << name_of(c) << " d=" << d);
        const Slice s(c, n, d, dv, 100 + d);
        const RowSpan cs = s.compact(), fs = s.widened();
        const std::vector<float> q = test::normal_floats(d, 7 + d);
        const float scale = 0.37f;

        std::vector<float> sc(n), sf(n);
        k->scores(q.data(), scale, cs, sc.data());
        k->scores(q.data(), scale, fs, sf.data());
        REQUIRE(same_bits(sc, sf));

        float mc = -INFINITY, sumc = 0, mf = -INFINITY, sumf = 0;
        std::vector<float> accc(dv, 0.0f), accf(dv, 0.0f);
        AllScores sinkc(n), sinkf(n);
        k->soft_scan(q.data(), scale, cs, mc, sumc, accc.data(), &sinkc);
        k->soft_scan(q.data(), scale, fs, mf, sumf, accf.data(), &sinkf);
        REQUIRE(bits(mc) == bits(mf));
        REQUIRE(bits(sumc) == bits(sumf));
        REQUIRE(same_bits(accc, accf));
        REQUIRE(same_bits(sinkc.scores, sf));

        AllScores topc(n);
        k->top_scan(q.data(), scale, cs, topc);
        REQUIRE(same_bits(topc.scores, sf));

        ArgMax hc, hf;
        k->hard_scan(q.data(), scale, cs, hc);
        k->hard_scan(q.data(), scale, fs, hf);
        REQUIRE(hc.row == hf.row);
        REQUIRE(bits(hc.score) == bits(hf.score));

        // Multi-head scans convert in registers too: the same bits as on the widened rows.
        for (std::size_t heads : {std::size_t{2}, std::size_t{3}, std::size_t{8}}) {  // d = 128, 512: 8 slices of 16, 64
          if (d % heads != 0 || dv % heads != 0) continue;
          const std::vector<float> hs(heads, scale);
          std::vector<float> hmc(heads, -INFINITY), hsc(heads, 0.0f), hac(dv, 0.0f);
          std::vector<float> hmf(heads, -INFINITY), hsf(heads, 0.0f), haf(dv, 0.0f);
          k->soft_scan_heads(q.data(), hs.data(), heads, cs, hmc.data(), hsc.data(), hac.data(), nullptr);
          k->soft_scan_heads(q.data(), hs.data(), heads, fs, hmf.data(), hsf.data(), haf.data(), nullptr);
          REQUIRE(same_bits(hmc, hmf));
          REQUIRE(same_bits(hsc, hsf));
          REQUIRE(same_bits(hac, haf));
          std::vector<ArgMax> hbc(heads), hbf(heads);
          k->hard_scan_heads(q.data(), hs.data(), heads, cs, hbc.data());
          k->hard_scan_heads(q.data(), hs.data(), heads, fs, hbf.data());
          for (std::size_t j = 0; j < heads; ++j) {
            REQUIRE(hbc[j].row == hbf[j].row);
            REQUIRE(bits(hbc[j].score) == bits(hbf[j].score));
          }
        }

        // The stored rows against a double reference: the kernel is exact for what is stored.
        const test::SoftReference ref = test::soft_reference(q.data(), s.keys.widened.data(), s.values.widened.data(), n, d, dv, scale);
        CHECK(std::fabs(mc + std::log(static_cast<double>(sumc)) - ref.lse) <= 1e-4 * std::max(1.0, std::fabs(ref.lse)));
        double err = 0;
        for (std::size_t j = 0; j < dv; ++j) err = std::max(err, std::fabs(accc[j] / sumc - ref.value[j]));
        CHECK(err <= 1e-4 * 4);

        // Batches of 3 and 19 queries (padding lanes, more than one lane vector), through the path's own
        // tiles and through libxsmm's where this build and path have them: a GEMM's sums can depend on the
        // rows a call gets, so compact and float32 rows must reach the tiles in the same chunks.
        for (const TileProducts& tiles : tile_sets)
        for (std::size_t nq : {std::size_t{3}, std::size_t{19}}) {
          const std::vector<float> qs = test::normal_floats(nq * d, 11 + d + nq);
          const std::vector<float> scales(nq, scale);
          std::vector<float> scratch(batch_scratch_floats(nq, d));
          std::vector<float> maxc(nq, -INFINITY), sumbc(nq, 0.0f), acbc(nq * dv, 0.0f);
          std::vector<float> maxf(nq, -INFINITY), sumbf(nq, 0.0f), acbf(nq * dv, 0.0f);
          k->soft_scan_batch(qs.data(), nq, scales.data(), cs, maxc.data(), sumbc.data(), acbc.data(), scratch.data(), tiles);
          k->soft_scan_batch(qs.data(), nq, scales.data(), fs, maxf.data(), sumbf.data(), acbf.data(), scratch.data(), tiles);
          REQUIRE(same_bits(maxc, maxf));
          REQUIRE(same_bits(sumbc, sumbf));
          REQUIRE(same_bits(acbc, acbf));
          std::vector<ArgMax> bc(nq), bf(nq);
          k->hard_scan_batch(qs.data(), nq, scales.data(), cs, bc.data(), scratch.data(), tiles);
          k->hard_scan_batch(qs.data(), nq, scales.data(), fs, bf.data(), scratch.data(), tiles);
          for (std::size_t b = 0; b < nq; ++b) {
            REQUIRE(bc[b].row == bf[b].row);
            REQUIRE(bits(bc[b].score) == bits(bf[b].score));
          }
        }
      }
    }
  }
}

TEST_CASE("a long scan blends values with a common offset within float32's rounding of the blocks, on every kernel path", "[precision][kernels]") {
  // Values 1000 + N(0, 1) over 120,000 rows: one float accumulator chained over every row rounded ~N times
  // (1.5e-5 of max|v| here, 6.6e-4 at 1M in a probe); each block's blend summed on its own and then
  // added chains ~256 + N / 256 roundings (scan_algorithms.hpp, BlockSums). Single, multi-head and batched
  // scans, each against the float64 blend of the same rows.
  const std::size_t n = 120000, d = 8, dv = 4, heads = 2, nq = 3;
  const std::vector<float> keys = test::normal_floats(n * d, 61), queries = test::normal_floats(nq * d, 62);
  std::vector<float> values = test::normal_floats(n * dv, 63);
  for (float& v : values) v += 1000.0f;
  std::vector<std::uint64_t> ids(n);
  std::iota(ids.begin(), ids.end(), std::uint64_t{0});
  const RowSpan span{keys.data(), values.data(), ids.data(), n, d, dv};
  const double value_max = test::max_abs(values), bound = 4e-6;
  const float scale = static_cast<float>(1 / (std::sqrt(static_cast<double>(d)) * 0.5));
  for (const KernelTable* k : all_paths()) {
    INFO(k->name);
    double worst = 0;
    for (std::size_t b = 0; b < nq; ++b) {
      const float* q = queries.data() + b * d;
      const test::SoftReference ref = test::soft_reference(q, keys.data(), values.data(), n, d, dv, scale);
      float m = -INFINITY, sum = 0;
      std::vector<float> acc(dv, 0.0f);
      k->soft_scan(q, scale, span, m, sum, acc.data(), nullptr);
      for (std::size_t c = 0; c < dv; ++c) worst = std::max(worst, std::fabs(acc[c] / sum - ref.value[c]) / value_max);
    }
    CHECK(worst <= bound);
    // Multi-head: each head's slice of the query and values, at its own scale.
    const std::vector<float> hs(heads, scale);
    std::vector<float> hm(heads, -INFINITY), hsum(heads, 0.0f), hacc(dv, 0.0f);
    k->soft_scan_heads(queries.data(), hs.data(), heads, span, hm.data(), hsum.data(), hacc.data(), nullptr);
    worst = 0;
    for (std::size_t j = 0; j < heads; ++j) {
      const std::size_t dh = d / heads, dvh = dv / heads;
      std::vector<float> hk(n * dh), hv(n * dvh);
      for (std::size_t r = 0; r < n; ++r) {
        std::copy_n(keys.begin() + static_cast<std::ptrdiff_t>(r * d + j * dh), dh, hk.begin() + static_cast<std::ptrdiff_t>(r * dh));
        std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(r * dv + j * dvh), dvh, hv.begin() + static_cast<std::ptrdiff_t>(r * dvh));
      }
      const test::SoftReference ref = test::soft_reference(queries.data() + j * dh, hk.data(), hv.data(), n, dh, dvh, scale);
      for (std::size_t c = 0; c < dvh; ++c) worst = std::max(worst, std::fabs(hacc[j * dvh + c] / hsum[j] - ref.value[c]) / value_max);
    }
    CHECK(worst <= bound);
    // A batch, through the path's own tiles and libxsmm's where it has them.
    for (const TileProducts& tiles : tiles_of(*k)) {
      const std::vector<float> scales(nq, scale);
      std::vector<float> bm(nq, -INFINITY), bsum(nq, 0.0f), bacc(nq * dv, 0.0f), scratch(batch_scratch_floats(nq, d));
      k->soft_scan_batch(queries.data(), nq, scales.data(), span, bm.data(), bsum.data(), bacc.data(), scratch.data(), tiles);
      worst = 0;
      for (std::size_t b = 0; b < nq; ++b) {
        const test::SoftReference ref = test::soft_reference(queries.data() + b * d, keys.data(), values.data(), n, d, dv, scale);
        for (std::size_t c = 0; c < dv; ++c) worst = std::max(worst, std::fabs(bacc[b * dv + c] / bsum[b] - ref.value[c]) / value_max);
      }
      CHECK(worst <= bound);
    }
  }
}

TEST_CASE("a compact collection answers within the documented bound of the float32 answer", "[precision]") {
  // docs/PRECISION.md, "Compact storage": per element, f16 rounds to 2^-11 relative, bf16 to 2^-8, i8 to
  // s/2 <= max|k|/127 absolute. Scores move by at most delta = scale * sum_j |q_j| |dk_j|; weights by a
  // factor within e^{+-2 delta}; the value by (e^{2 delta} - 1) max|v| plus the values' own rounding.
  const std::size_t n = 2000, d = 128, dv = 64;
  for (const Case& c : kCases) {
    for (const Metric metric : {Metric::dot, Metric::cosine}) {
      for (const float temperature : {1.0f, 0.1f}) {
        for (const bool adversarial : {false, true}) {
          INFO(name_of(c) << " cosine=" << (metric == Metric::cosine) << " T=" << temperature << " adversarial=" << adversarial);
          std::vector<float> keys = test::normal_floats(n * d, 5), values = test::normal_floats(n * dv, 6);
          if (adversarial) {  // magnitudes near the f16 limit, mixed signs, one huge element per i8 row
            for (std::size_t i = 0; i < keys.size(); ++i) keys[i] *= (i % 7 == 0) ? 4000.0f : 1.0f;
            for (std::size_t i = 0; i < values.size(); ++i) values[i] = (i % 2 ? -1.0f : 1.0f) * 60000.0f * std::tanh(values[i]);
          }
          CollectionConfig base{d, dv, metric, std::nullopt, {}};
          base.scale = adversarial && metric == Metric::dot ? 1e-4f / temperature : 1.0f / (std::sqrt(float(d)) * temperature);
          CollectionConfig compact = base;
          compact.key_precision = c.key;
          compact.value_precision = c.value;
          Collection exact(base), small(compact);
          exact.add_batch(keys, values);
          small.add_batch(keys, values);
          const float scale = *base.scale;
          for (std::uint64_t seed = 0; seed < 3; ++seed) {
            std::vector<float> q = test::normal_floats(d, 50 + seed);
            const SoftResult a = exact.query_soft(q), b = small.query_soft(q);
            if (metric == Metric::cosine) {
              double norm = 0;
              for (float x : q) norm += double(x) * x;
              for (float& x : q) x = static_cast<float>(x / std::sqrt(norm));
            }
            // delta from the stored keys, computed in double from the rows as the collection holds them.
            double delta = 0, vmax = 0, vround = 0;
            for (std::uint64_t id = 0; id < n; ++id) {
              const Entry ea = exact.get(id), eb = small.get(id);
              double dk = 0;
              for (std::size_t j = 0; j < d; ++j) dk += std::fabs(double(q[j])) * std::fabs(double(ea.key[j]) - eb.key[j]);
              delta = std::max(delta, scale * dk);
              for (std::size_t j = 0; j < dv; ++j) {
                vmax = std::max(vmax, std::fabs(double(ea.value[j])));
                vround = std::max(vround, std::fabs(double(ea.value[j]) - eb.value[j]));
              }
            }
            const double bound = std::expm1(2 * delta) * vmax + vround;
            const double float_noise = 1e-5 * vmax + 1e-30;  // both answers' own float32 rounding
            CHECK(test::max_abs_diff(a.value, b.value) <= bound + float_noise);
            CHECK(std::fabs(a.lse - b.lse) <= delta + 1e-5 * std::max(1.0, std::fabs(a.lse)));
            const HardResult ha = exact.query_hard(q), hb = small.query_hard(q);
            CHECK(std::fabs(double(ha.score) - hb.score) <= 2 * delta + 1e-5 * std::max(1.0f, std::fabs(ha.score)));
          }
        }
      }
    }
  }
}

TEST_CASE("compact collections: get returns the stored rows, every query path runs, cosine keys are normalised first", "[precision]") {
  const std::size_t n = 700, d = 33, dv = 17;
  const std::vector<float> keys = test::normal_floats(n * d, 1), values = test::normal_floats(n * dv, 2);
  for (const Case& c : kCases) {
    for (const IndexKind kind : {IndexKind::exact, IndexKind::flat, IndexKind::ivf}) {
      INFO(name_of(c) << " index " << int(kind));
      CollectionConfig config{d, dv, Metric::cosine, std::nullopt, {}};
      config.index.kind = kind;
      config.index.ivf_nlist = 8;
      config.key_precision = c.key;
      config.value_precision = c.value;
      Collection col(config);
      col.add_batch(keys, values);
      col.wait_until_indexed();
      for (std::uint64_t id : {0ull, 350ull, 699ull}) {
        const Entry e = col.get(id);
        // Normalise, then round: the stored key is the rounding of the unit key.
        std::vector<float> unit(keys.begin() + long(id * d), keys.begin() + long((id + 1) * d));
        double norm = 0;
        for (float x : unit) norm += double(x) * x;
        for (float& x : unit) x = static_cast<float>(x / std::sqrt(norm));
        const Stored sk(c.key, unit, 1, d);
        const Stored sv(c.value, std::vector<float>(values.begin() + long(id * dv), values.begin() + long((id + 1) * dv)), 1, dv);
        for (std::size_t j = 0; j < d; ++j) CHECK(std::fabs(e.key[j] - sk.widened[j]) <= 1e-7f);  // normalise may differ by an ulp
        CHECK(same_bits(e.value, sv.widened));
      }
      const std::vector<float> q = test::normal_floats(2 * d, 9);
      QueryOptions pruned;
      if (kind != IndexKind::exact) pruned.top_k = n;  // every row: equals the exact answer
      const SoftResult exact = col.query_soft(std::span(q.data(), d));
      if (kind != IndexKind::exact) {
        const SoftResult p = col.query_soft(std::span(q.data(), d), pruned);
        CHECK(test::max_abs_diff(p.value, exact.value) <= 1e-5);
        QueryOptions eps;
        eps.epsilon = 0.5f;
        CHECK_NOTHROW(col.query_soft(std::span(q.data(), d), eps));
      }
      const HardResult h = col.query_hard(std::span(q.data(), d));
      CHECK(same_bits(h.value, col.get(h.id).value));
      const SoftBatchResult sb = col.query_soft_batch(q);
      CHECK(test::max_abs_diff(std::vector<float>(sb.values.begin(), sb.values.begin() + long(dv)), exact.value) <= 1e-5);
      const HardBatchResult hb = col.query_hard_batch(q);
      CHECK(hb.ids[0] == h.id);
      col.remove(350);
      CHECK_FALSE(col.contains(350));
      CHECK(same_bits(col.get(699).value, Stored(c.value, std::vector<float>(values.end() - long(dv), values.end()), 1, dv).widened));
    }
  }
}

TEST_CASE("compact storage: out-of-range writes and bad precisions are typed errors that store nothing", "[precision][errors]") {
  CollectionConfig f16{4, 2, Metric::dot, std::nullopt, {}};
  f16.key_precision = f16.value_precision = Precision::f16;
  Collection col(f16);
  col.add(std::vector<float>{65504, -65504, 1, 0}, std::vector<float>{-65504, 6e-8f});  // the extremes are fine
  CHECK(col.get(0).key[0] == 65504.0f);
  CHECK(col.get(0).value[1] == from_f16(1));  // 6e-8 rounds to the smallest subnormal
  CHECK(test::error_of([&] { col.add(std::vector<float>{65505, 0, 0, 0}, std::vector<float>{0, 0}); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { col.add(std::vector<float>{0, 0, 0, 0}, std::vector<float>{0, -1e5f}); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { col.upsert(0, std::vector<float>{0, 0, 0, 0}, std::vector<float>{0, 70000}); }) == ErrorCode::invalid_argument);
  // A batch with one bad row stores none of it.
  const std::vector<float> keys = {1, 2, 3, 4, 5, 6, 7, 1e6f}, values = {1, 2, 3, 4};
  CHECK(test::error_of([&] { col.add_batch(keys, values); }) == ErrorCode::invalid_argument);
  CHECK(col.size() == 1);
  CHECK(col.get(0).value[0] == -65504.0f);

  CollectionConfig bf16{2, 2, Metric::dot, std::nullopt, {}};
  bf16.key_precision = bf16.value_precision = Precision::bf16;
  Collection b(bf16);
  b.add(std::vector<float>{3.38e38f, -1e-38f}, std::vector<float>{1e38f, 0});
  CHECK(test::error_of([&] { b.add(std::vector<float>{std::numeric_limits<float>::max(), 0}, std::vector<float>{0, 0}); }) ==
        ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { b.add(std::vector<float>{0, 0}, std::vector<float>{0, -3.4e38f}); }) == ErrorCode::invalid_argument);
  CHECK(b.size() == 1);

  CollectionConfig i8{2, 2, Metric::dot, std::nullopt, {}};
  i8.key_precision = Precision::i8;
  Collection k(i8);
  const float i8_max = std::ldexp(127.0f, 121);
  k.add(std::vector<float>{i8_max, -1}, std::vector<float>{std::numeric_limits<float>::max(), 0});
  CHECK(k.get(0).key[0] == i8_max);  // the largest i8 key is exact
  CHECK(k.get(0).key[1] == 0.0f);    // -1 is far below one step (2^121)
  CHECK(test::error_of([&] { k.add(std::vector<float>{std::nextafter(i8_max, INFINITY), 0}, std::vector<float>{0, 0}); }) ==
        ErrorCode::invalid_argument);
  CHECK(k.size() == 1);

  CollectionConfig bad{2, 2, Metric::dot, std::nullopt, {}};
  bad.value_precision = Precision::i8;
  CHECK(test::error_of([&] { check_config(bad); }) == ErrorCode::invalid_argument);
  CHECK(test::error_of([&] { Collection x(bad); }) == ErrorCode::invalid_argument);
  bad.value_precision = static_cast<Precision>(4);
  CHECK(test::error_of([&] { check_config(bad); }) == ErrorCode::invalid_argument);
  bad.value_precision = Precision::f32;
  bad.key_precision = static_cast<Precision>(200);
  CHECK(test::error_of([&] { check_config(bad); }) == ErrorCode::invalid_argument);
}

TEST_CASE("compact collections survive image/restore, snapshots and log replay bit for bit", "[precision][persistence]") {
  const std::size_t n = 300, d = 16, dv = 8;
  std::vector<float> keys = test::normal_floats(n * d, 3), values = test::normal_floats(n * dv, 4);
  keys[5] = 1e-40f;  // a subnormal input
  values[7] = 65504.0f;
  for (const Case& c : kCases) {
    INFO(name_of(c));
    CollectionConfig config{d, dv, Metric::dot, 0.5f, {}};
    config.key_precision = c.key;
    config.value_precision = c.value;
    Collection col(config);
    col.add_batch(keys, values);
    const Collection back = Collection::restore(col.image());
    CHECK(back.config().key_precision == c.key);
    CHECK(back.config().value_precision == c.value);
    for (std::uint64_t id = 0; id < n; ++id) {
      REQUIRE(same_bits(back.get(id).key, col.get(id).key));
      REQUIRE(same_bits(back.get(id).value, col.get(id).value));
    }
    for (const bool snapshot : {false, true}) {
      test::TempDir dir;
      DatabaseOptions quiet;
      quiet.fsync = FsyncPolicy::never;
      quiet.snapshot_after_bytes = 0;
      quiet.log = [](std::string_view) {};
      {
        Database db(dir.path, quiet);
        db.create_collection("c", config);
        db.add("c", std::span(keys).first(n / 2 * d), std::span(values).first(n / 2 * dv));
        if (snapshot) db.snapshot();
        db.add("c", std::span(keys).subspan(n / 2 * d), std::span(values).subspan(n / 2 * dv));
      }
      Database db(dir.path, quiet);
      const auto reopened = db.collection("c");
      CHECK(reopened->config().key_precision == c.key);
      CHECK(reopened->config().value_precision == c.value);
      REQUIRE(reopened->size() == n);
      for (std::uint64_t id = 0; id < n; ++id) {
        REQUIRE(same_bits(reopened->get(id).key, col.get(id).key));
        REQUIRE(same_bits(reopened->get(id).value, col.get(id).value));
      }
      const std::vector<float> q = test::normal_floats(d, 77);
      const SoftResult a = reopened->query_soft(q), b = col.query_soft(q);
      CHECK(same_bits(a.value, b.value));
    }
  }
}

TEST_CASE("wire: create and describe carry the precisions in protocol version 2 only", "[precision][wire]") {
  using namespace softkv::wire;
  auto frame_of = [](const std::vector<std::byte>& bytes) {
    const FrameScan scan = scan_frame(bytes, kDefaultMaxFrame);
    REQUIRE(scan.status == FrameScan::Status::complete);
    return scan.frame;
  };
  for (const Case& c : kCases) {
    CollectionConfig config{3, 2, Metric::cosine, 0.5f, {}};
    config.key_precision = c.key;
    config.value_precision = c.value;
    CollectionConfig f32 = config;
    f32.key_precision = f32.value_precision = Precision::f32;
    const std::vector<std::byte> v1 = encode_request(Create{"c", f32}, 7, 1), v2 = encode_request(Create{"c", config}, 7, 2);
    CHECK(v2.size() == v1.size() + 6);  // two precision bytes and the u32 heads (issue 15) appended, nothing else moved
    CHECK(std::equal(v1.begin() + 4, v1.end(), v2.begin() + 4));
    const auto back2 = std::get<Create>(decode_request(frame_of(v2), 2));
    CHECK(back2.config.key_precision == c.key);
    CHECK(back2.config.value_precision == c.value);
    const auto back1 = std::get<Create>(decode_request(frame_of(v1), 1));
    CHECK(back1.config.key_precision == Precision::f32);  // a version-1 frame has no precision: float32
    CHECK(back1.config.value_precision == Precision::f32);
    CHECK_THROWS_AS(decode_request(frame_of(v1), 2), Error);  // a version-2 create without the fields is malformed
    if (c.key != Precision::f32 || c.value != Precision::f32)  // version 1 cannot carry them: refused, not dropped
      CHECK(test::error_of([&] { (void)encode_request(Create{"c", config}, 7, 1); }) == ErrorCode::unsupported);

    CollectionStats stats;
    stats.name = "c";
    stats.key_precision = c.key;
    stats.value_precision = c.value;
    const auto r2 = std::get<DescribeReply>(decode_reply(Opcode::describe, frame_of(encode_reply(Opcode::describe, 1, DescribeReply{stats}, 2)),
                                                         QueryKind::soft, 2));
    CHECK(r2.stats.key_precision == c.key);
    CHECK(r2.stats.value_precision == c.value);
    const auto r1 = std::get<DescribeReply>(decode_reply(Opcode::describe, frame_of(encode_reply(Opcode::describe, 1, DescribeReply{stats}, 1)),
                                                         QueryKind::soft, 1));
    CHECK(r1.stats.key_precision == Precision::f32);
  }
}

TEST_CASE("scores_multi: each query's scores are its own scores call's, bit for bit, on every path, precision and shape", "[precision][kernels]") {
  // d: below a vector, odd tails, groups of four blocks with and without leftover blocks (80, 144: on avx512
  // too), one block short of a group.
  const std::vector<std::size_t> dims = {1, 3, 8, 15, 16, 17, 31, 33, 48, 64, 80, 96, 127, 128, 129, 136, 144, 300};
  const std::vector<std::size_t> counts = {0, 1, 2, 3, 4, 5, 7, 9, 17};  // tiles of 4 x 4 / 4 x 2 and their leftovers
  for (const KernelTable* k : all_paths()) {
    for (const Case& c : kCases) {
      for (std::size_t d : dims) {
        const std::size_t n = 23;
        const Slice s(c, n, d, 1, 300 + d, d % 3 == 0 ? 40.0f : 1.0f);  // (large keys too: sums far from 1)
        const std::vector<float> qs = test::normal_floats(17 * d, 17 + d);
        std::vector<float> scales(17);
        for (std::size_t i = 0; i < scales.size(); ++i) scales[i] = std::ldexp(0.3f + 0.05f * static_cast<float>(i), static_cast<int>(i % 5) - 2);
        for (std::size_t nq : counts)
          for (std::size_t rows : counts) {
            INFO(k->name << " " << name_of(c) << " d=" << d << " queries=" << nq << " rows=" << rows);
            const RowSpan span = s.compact().sub(n - rows, rows);  // (a span that starts mid-slice)
            const std::size_t stride = rows + 3;
            std::vector<float> multi(nq * stride, -1.0f), own(nq * stride, -1.0f);
            k->scores_multi(qs.data(), nq, scales.data(), span, multi.data(), stride);
            for (std::size_t i = 0; i < nq; ++i) k->scores(qs.data() + i * d, scales[i], span, own.data() + i * stride);
            REQUIRE(same_bits(multi, own));  // (the padding between queries' rows untouched too)
          }
      }
    }
    // A batch's shape (32 queries x 64 rows), and a span large enough that scores takes one row at a time
    // (rows of more than 256 bytes in a span of more than 512 KiB) rather than two.
    for (const auto& [d, n, nq] : {std::tuple<std::size_t, std::size_t, std::size_t>{128, 64, 32}, {320, 450, 5}}) {
      INFO(k->name << " d=" << d << " rows=" << n << " queries=" << nq);
      const Slice s(kCases[0], n, d, 1, 900 + d);
      const std::vector<float> qs = test::normal_floats(nq * d, 31 + d);
      const std::vector<float> scales(nq, 0.125f);
      std::vector<float> multi(nq * n), own(nq * n);
      k->scores_multi(qs.data(), nq, scales.data(), s.compact(), multi.data(), n);
      for (std::size_t i = 0; i < nq; ++i) k->scores(qs.data() + i * d, scales[i], s.compact(), own.data() + i * n);
      REQUIRE(same_bits(multi, own));
    }
  }
}

TEST_CASE("a row scores the same bits whether the key pass takes it eight, two or one at a time", "[precision][kernels]") {
  // Rows of 320 elements (over 256 bytes at every precision): a span of 1,700 of them (over 512 KiB) is
  // scored one row at a time; sub-spans of 37 rows eight at a time (eight sums reduced together), then
  // two, then one.
  const std::size_t d = 320, n = 1700;
  for (const KernelTable* k : all_paths()) {
    for (const Case& c : kCases) {
      INFO(k->name << " " << name_of(c));
      const Slice s(c, n, d, 1, 77, 3.0f);
      const std::vector<float> q = test::normal_floats(d, 5);
      const float scale = 0.3f;
      std::vector<float> whole(n), pieces(n);
      k->scores(q.data(), scale, s.compact(), whole.data());
      for (std::size_t a = 0; a < n; a += 37) k->scores(q.data(), scale, s.compact().sub(a, std::min<std::size_t>(37, n - a)), pieces.data() + a);
      REQUIRE(same_bits(whole, pieces));
    }
  }
}

TEST_CASE("i8 keys score as their float32 widening, bit for bit, at the ends of the float range", "[precision][kernels]") {
  // The kernels sum q . k over the stored integers and apply the row's power-of-two scale to the sums
  // (exact); keys and queries from 1e-37 to 1e36 test that no product or sum leaves the normal float range
  // on one side and not on the other (overflow, or rounding among subnormals).
  const std::vector<float> key_sizes = {1e-37f, 1e-30f, 1e-10f, 1.0f, 1e10f, 1e30f, 1e36f};
  const std::vector<float> query_sizes = {1e-38f, 1e-36f, 1e-20f, 1.0f, 1e20f, 1e34f, 1e36f, 1e37f};
  for (const KernelTable* k : all_paths()) {
    for (std::size_t d : {std::size_t{16}, std::size_t{33}, std::size_t{128}}) {
      for (float ks : key_sizes) {
        const Slice s(Case{Precision::i8, Precision::f32}, 40, d, 3, 11 + d, ks);
        for (float qsz : query_sizes) {
          INFO(k->name << " d=" << d << " keys ~" << ks << " query ~" << qsz);
          std::vector<float> q = test::normal_floats(d, 3 + d, qsz);
          std::vector<float> sc(s.n), sf(s.n);
          k->scores(q.data(), 0.25f, s.compact(), sc.data());
          k->scores(q.data(), 0.25f, s.widened(), sf.data());
          REQUIRE(same_bits(sc, sf));
          ArgMax hc, hf;
          k->hard_scan(q.data(), 0.25f, s.compact(), hc);
          k->hard_scan(q.data(), 0.25f, s.widened(), hf);
          REQUIRE(hc.row == hf.row);
          REQUIRE(bits(hc.score) == bits(hf.score));
          const std::vector<float> qs2(2, 0.25f);
          std::vector<float> q2(q);
          q2.insert(q2.end(), q.begin(), q.end());
          std::vector<float> mc(2 * s.n), mf(2 * s.n);
          k->scores_multi(q2.data(), 2, qs2.data(), s.compact(), mc.data(), s.n);
          k->scores_multi(q2.data(), 2, qs2.data(), s.widened(), mf.data(), s.n);
          REQUIRE(same_bits(mc, mf));
        }
      }
    }
  }
}

TEST_CASE("i8 keys score as their float32 widening at the edges of the kernels' unscaled-sum window", "[precision][kernels]") {
  // The kernels sum an i8 row's products unscaled only for row scales inside a window computed from the
  // query; just outside it, scaling once would round differently (a sum cancelling to a subnormal) or
  // overflow (a sum above FLT_MAX before the scale brings it back). Rows at the window's edge and one and
  // two powers of two beyond it must all score as their widening.
  std::mt19937_64 rng(5);
  const std::size_t d = 128, n = 8;  // (d = 128: chains of two or more blocks on every path, so sums round)
  std::vector<std::uint64_t> ids(n);
  const auto check = [&](const KernelTable* k, const std::vector<float>& q, float s, float key_sign_bias) {
    std::vector<float> keys(n * d);
    for (auto& x : keys) x = 127.0f * s * ((rng() % 100) < 50 + key_sign_bias ? 1.0f : -1.0f);
    const Stored st(Precision::i8, keys, n, d);
    REQUIRE(st.scales[0] == s);
    const RowSpan cs{st.bytes.data(), nullptr, ids.data(), n, d, 0, Precision::i8, Precision::f32, st.scales.data()};
    const RowSpan fs{st.widened.data(), nullptr, ids.data(), n, d, 0};
    std::vector<float> sc(n), sf(n);
    k->scores(q.data(), 1.0f, cs, sc.data());
    k->scores(q.data(), 1.0f, fs, sf.data());
    REQUIRE(same_bits(sc, sf));
  };
  for (const KernelTable* k : all_paths()) {
    for (int beyond : {0, 1, 2}) {
      INFO(k->name << ", " << beyond << " powers of two beyond the window");
      for (int trial = 0; trial < 300; ++trial) {
        // Low edge: |q| in [2^-10, 2^-9) with full mantissas, keys +-127 s: sums that cancel land among
        // the subnormals once scaled; the window starts at s = 2^-116 for this query.
        std::vector<float> q(d);
        for (auto& x : q) x = std::ldexp(1.0f + std::ldexp(static_cast<float>(rng() % (1u << 23)), -23), -10) * ((rng() & 1) ? 1.0f : -1.0f);
        check(k, q, std::ldexp(1.0f, -116 - beyond), 0);
      }
      // High edge: q from 2^118 to 2^121, keys +127 s with s = 2^-10: the products' sums overflow a
      // vector lane unscaled (8 terms of 127 * 2^120 on avx512), not scaled; the window (bound 127 * 128 *
      // max|q| <= 2^126, conservative by the lane count) leaves these rows scaled element by element. (This
      // catches a window without an upper edge, not one a few powers of two too wide: the bound is
      // conservative by the lane count, so no query within a few powers of two of it overflows a lane.)
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<float> q(d);
        for (auto& x : q) x = std::ldexp(1.0f + std::ldexp(static_cast<float>(rng() % (1u << 23)), -23), 120 - beyond);
        check(k, q, std::ldexp(1.0f, -10), 50);
      }
    }
  }
}
