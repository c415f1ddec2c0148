// pruning_bench: pruned soft retrieval (flat, IVF, HNSW) against the exact scan on clustered data,
// and the crossover size from which IVF beats the scan (the default of IndexConfig::auto_threshold).
//
// Usage: pruning_bench [--n 1000000] [--hnsw-n 100000] [--d 128] [--queries 200] [--nlist 0] [--nprobe 8] [--kinds ivf flat hnsw exact] [--crossover]
//        pruning_bench --violations [--n 100000 --d 64 --queries 400 --check-sample 256]
//        pruning_bench --estimate-batch [--n 1000000 --d 128 --queries 16]
//        pruning_bench --pareto DIR [--n 200000 --hnsw-n 20000 --queries 10 --kinds ivf flat hnsw exact]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "common.hpp"
#include "../examples/fashion_mnist_data.hpp"
#include "softkv/softkv.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using softkv::bench::Xorshift;

// n keys in clusters of `per_cluster` around uniform centres, with noise 0.1 per coordinate.
std::vector<float> clustered(std::size_t n, std::size_t d, std::size_t per_cluster, std::uint64_t seed) {
  Xorshift rng{seed * 0x9E3779B97F4A7C15ull + 7};
  const std::size_t clusters = std::max<std::size_t>(1, n / per_cluster);
  std::vector<float> centres(clusters * d);
  for (float& c : centres) c = rng.next();
  std::vector<float> keys(n * d);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) keys[i * d + j] = centres[(i % clusters) * d + j] + 0.1f * rng.next();
  return keys;
}

// Resident memory of this process in MiB (from /proc/self/status).
double rss_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * double(a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

// The query workload: stored keys plus a little noise (attention peaked on a cluster).
std::vector<std::vector<float>> make_queries(const std::vector<float>& keys, std::size_t d, std::size_t nq) {
  Xorshift rng{99};
  const std::size_t n = keys.size() / d;
  std::vector<std::vector<float>> qs(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    const std::size_t at = (i * 7919) % n;
    qs[i].assign(keys.begin() + static_cast<std::ptrdiff_t>(at * d), keys.begin() + static_cast<std::ptrdiff_t>((at + 1) * d));
    for (float& x : qs[i]) x += 0.05f * rng.next();
  }
  return qs;
}

// Median latency (ms) and answers of one option set over the queries.
struct Run {
  double ms = 0;
  std::vector<softkv::SoftResult> results;
};

Run run(const softkv::Collection& c, const std::vector<std::vector<float>>& qs, const softkv::QueryOptions& o) {
  Run r;
  std::vector<double> t;
  for (const auto& q : qs) {
    const auto t0 = Clock::now();
    r.results.push_back(c.query_soft(q, o));
    t.push_back(1e3 * seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  r.ms = t[t.size() / 2];
  return r;
}

void pruned_table(const char* name, softkv::IndexKind kind, std::size_t n, std::size_t d, std::size_t nq, float temperature,
                  std::size_t nlist, std::size_t nprobe) {
  const auto keys = clustered(n, d, 20, 1);
  const auto values = clustered(n, d, 1, 2);  // unstructured values
  softkv::CollectionConfig config{d, d, softkv::Metric::dot, {}, {}};
  config.index.kind = kind;
  config.index.ivf_nlist = nlist;
  const double rss0 = rss_mib();
  softkv::Collection c(config);
  const auto t0 = Clock::now();
  c.add_batch(keys, values);
  c.wait_until_indexed();  // the index builds in the background
  const double build = seconds_since(t0);
  const double grown = rss_mib() - rss0;
  const double stored = static_cast<double>(n) * (2 * d * 4 + 8) / (1 << 20);
  const auto qs = make_queries(keys, d, nq);
  const Run exact = run(c, qs, {.temperature = temperature});
  std::printf("\n%s, N = %zu, d = dv = %zu, T = %.2f: built in %.1f s; exact scan %.2f ms per query (median of %zu)\n", name, n, d,
              temperature, build, exact.ms, nq);
  std::printf("  memory: RSS grew %.0f MiB while adding and indexing, of which %.0f MiB are the stored keys, values and ids;\n"
              "  the index takes about the rest (%.0f MiB; flat adds none: it searches the stored keys)\n",
              grown, stored, std::max(0.0, grown - stored));
  // The true omitted mass, in double: the full log-sum-exp from a double scan, the candidates' from
  // their reported scores (a float lse over 1M terms is only good to ~1e-5, too coarse to check a bound).
  const double scale = c.resolve_scale({.temperature = temperature});
  std::vector<double> lse_all(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    std::vector<double> s(n);
    double m = -INFINITY, z = 0;
    for (std::size_t r = 0; r < n; ++r) {
      double dot = 0;
      for (std::size_t j = 0; j < d; ++j) dot += double(qs[i][j]) * keys[r * d + j];
      s[r] = scale * dot;
      m = std::max(m, s[r]);
    }
    for (double x : s) z += std::exp(x - m);
    lse_all[i] = m + std::log(z);
  }
  std::printf("  %8s %10s %9s %14s %16s %16s %12s\n", "k", "ms", "speed-up", "rel. L2 error", "mean tail bound",
              "mean true tail", "bound holds");
  // top_k 16 to 128, then epsilon 1e-3 (k = 0 below: every candidate is reported, top_m covers them).
  for (const std::size_t k : {16u, 32u, 64u, 128u, 0u}) {
    softkv::QueryOptions o{.temperature = temperature, .top_m = k, .top_k = k, .ef_search = std::max<std::size_t>(128, k), .nprobe = nprobe};
    if (k == 0) o.top_m = std::numeric_limits<std::size_t>::max(), o.top_k.reset(), o.epsilon = 1e-3f;
    const Run pruned = run(c, qs, o);
    double err = 0, tail = 0, true_tail_sum = 0;
    std::size_t holds = 0;
    for (std::size_t i = 0; i < nq; ++i) {
      const softkv::SoftResult& r = pruned.results[i];
      err += rel_l2(r.value, exact.results[i].value);
      tail += r.tail_bound;
      // Candidates' scores in double (ids are row numbers: entries were added in order from 0).
      std::vector<double> cand;
      for (const auto& t : r.top) {
        double dot = 0;
        for (std::size_t j = 0; j < d; ++j) dot += double(qs[i][j]) * keys[t.id * d + j];
        cand.push_back(scale * dot);
      }
      double m = -INFINITY, z = 0;
      for (double x : cand) m = std::max(m, x);
      for (double x : cand) z += std::exp(x - m);
      const double true_tail = r.candidates >= n ? 0.0 : -std::expm1(m + std::log(z) - lse_all[i]);
      true_tail_sum += true_tail;
      holds += true_tail <= r.tail_bound * (1 + 1e-6) + 1e-12;
    }
    const std::string label = k == 0 ? "eps 1e-3" : std::to_string(k);
    std::printf("  %8s %10.3f %8.1fx %14.2e %16.2e %16.2e %11zu%%\n", label.c_str(), pruned.ms, exact.ms / pruned.ms, err / nq,
                tail / nq, true_tail_sum / nq, 100 * holds / nq);
  }
}

// How often the tail bound of an approximate index is violated (true omitted mass above it), with and
// without the sampled check, on clustered data with queries near stored keys; and what the check costs.
void violations(std::size_t n, std::size_t d, std::size_t nq, float temperature, std::size_t sample) {
  const auto keys = clustered(n, d, 20, 5);
  const auto values = clustered(n, d, 1, 6);
  const auto qs = make_queries(keys, d, nq);
  std::printf("\nviolations: N = %zu, d = dv = %zu, T = %.2f, %zu queries; checked = sampled check of %zu rows (95%%)\n", n, d,
              temperature, nq, sample);
  std::printf("  %-22s %-10s %9s %9s %11s %11s %9s %9s\n", "index, effort", "query", "ms", "checked", "violations",
              "checked", "worst", "worst chk");
  for (const softkv::IndexKind kind : {softkv::IndexKind::hnsw, softkv::IndexKind::ivf}) {
    softkv::CollectionConfig config{d, d, softkv::Metric::dot, {}, {}};
    config.index.kind = kind;
    softkv::Collection c(config);
    const auto t0 = Clock::now();
    c.add_batch(keys, values);
    c.wait_until_indexed();
    const double build = seconds_since(t0);
    const double scale = c.resolve_scale({.temperature = temperature});
    std::vector<double> lse_all(nq);  // in double: a float lse is too coarse to check a bound
    for (std::size_t i = 0; i < nq; ++i) {
      std::vector<double> s(n);
      double m = -INFINITY, z = 0;
      for (std::size_t r = 0; r < n; ++r) {
        double dot = 0;
        for (std::size_t j = 0; j < d; ++j) dot += double(qs[i][j]) * keys[r * d + j];
        s[r] = scale * dot;
        m = std::max(m, s[r]);
      }
      for (double x : s) z += std::exp(x - m);
      lse_all[i] = m + std::log(z);
    }
    // The true mass outside a result's candidates (all reported: top_m is clamped to them).
    auto true_tail = [&](std::size_t i, const softkv::SoftResult& r) {
      if (r.candidates >= n) return 0.0;
      double m = -INFINITY, z = 0;
      std::vector<double> cand;
      for (const auto& t : r.top) {
        double dot = 0;
        for (std::size_t j = 0; j < d; ++j) dot += double(qs[i][j]) * keys[t.id * d + j];
        cand.push_back(scale * dot);
        m = std::max(m, cand.back());
      }
      for (double x : cand) z += std::exp(x - m);
      return -std::expm1(m + std::log(z) - lse_all[i]);
    };
    const bool hnsw = kind == softkv::IndexKind::hnsw;
    std::printf("  %s built in %.1f s\n", hnsw ? "hnsw (M 32, efConstruction 80)" : "ivf (default nlist)", build);
    for (const std::size_t effort : hnsw ? std::vector<std::size_t>{16, 64, 256} : std::vector<std::size_t>{1, 4, 16}) {
      const std::string label = std::string(hnsw ? "hnsw ef_search " : "ivf nprobe ") + std::to_string(effort);
      for (const bool adaptive : {false, true}) {
        softkv::QueryOptions o{.temperature = temperature, .top_m = std::numeric_limits<std::size_t>::max()};
        if (adaptive) o.epsilon = 0.01f;
        else o.top_k = 32;
        o.ef_search = effort;
        o.nprobe = effort;
        softkv::QueryOptions checked = o;
        checked.check_sample = sample;
        const Run plain = run(c, qs, o), chk = run(c, qs, checked);
        std::size_t bad = 0, bad_checked = 0;
        double worst = 0, worst_checked = 0;
        for (std::size_t i = 0; i < nq; ++i) {
          const double limit = adaptive ? 0.01 : plain.results[i].tail_bound;
          const double limit_checked = adaptive ? 0.01 : chk.results[i].tail_bound;
          const double t = true_tail(i, plain.results[i]), tc = true_tail(i, chk.results[i]);
          if (t > limit * (1 + 1e-6) + 1e-12) bad++, worst = std::max(worst, t - limit);
          if (tc > limit_checked * (1 + 1e-6) + 1e-12) bad_checked++, worst_checked = std::max(worst_checked, tc - limit_checked);
        }
        std::printf("  %-22s %-10s %9.3f %9.3f %10.1f%% %10.1f%% %9.2e %9.2e\n", label.c_str(),
                    adaptive ? "eps 0.01" : "top_k 32", plain.ms, chk.ms, 100.0 * bad / nq, 100.0 * bad_checked / nq, worst,
                    worst_checked);
      }
    }
  }
}

// ---- data regimes (issue "pruned soft retrieval never slower than the exact scan") ----

// The error_target the regimes measure (docs/PRUNING.md, "Estimated answers").
constexpr float kErrorTarget = 1e-2f;

struct Regime {
  std::string name;
  float temperature;
  std::vector<float> keys, values, queries;  // n x d, n x dv, nq x d
  std::size_t d = 0, dv = 0;                 // 0: the bench's d for both
};

// Fashion-MNIST (Debian's dataset-fashion-mnist): the 60,000 training images as keys (unit length, as a
// cosine collection stores them), their one-hot labels as values, and test images with their lower half
// blanked as queries (renormalised): real data, queries unlike any stored key. None when the files are missing.
std::optional<Regime> fashion_mnist_regime(std::size_t nq) {
  namespace fm = softkv::fashion_mnist;
  try {
    const fm::Split train = fm::load(fm::kDefaultDir, "train", 60000), test = fm::load(fm::kDefaultDir, "t10k", 10000);
    const auto unit = [](float* x) {
      double s = 0;
      for (std::size_t j = 0; j < fm::kPixels; ++j) s += double(x[j]) * x[j];
      const float inv = s > 0 ? static_cast<float>(1 / std::sqrt(s)) : 0.0f;
      for (std::size_t j = 0; j < fm::kPixels; ++j) x[j] *= inv;
    };
    Regime r{"Fashion-MNIST, half-blanked test images (T = 0.002: s = cosine x 17.9)", 0.002f, train.images, train.one_hot, {},
             fm::kPixels, fm::kClasses};
    for (std::size_t i = 0; i < 60000; ++i) unit(r.keys.data() + i * fm::kPixels);
    for (std::size_t b = 0; b < nq; ++b) {
      std::vector<float> q(test.images.begin() + static_cast<std::ptrdiff_t>(b * 97 % 10000 * fm::kPixels),
                           test.images.begin() + static_cast<std::ptrdiff_t>((b * 97 % 10000 + 1) * fm::kPixels));
      std::fill(q.begin() + fm::kPixels / 2, q.end(), 0.0f);
      unit(q.data());
      r.queries.insert(r.queries.end(), q.begin(), q.end());
    }
    return r;
  } catch (const std::exception& e) {
    std::printf(" (Fashion-MNIST regime skipped: %s)\n", e.what());
    return std::nullopt;
  }
}

// Gaussian keys with a shared offset and three massive channels (as transformer keys have).
std::vector<float> heavy_tailed(std::size_t n, std::size_t d, std::uint64_t seed) {
  std::vector<float> k = softkv::bench::gaussian_floats(n * d, seed);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < d; ++j) k[i * d + j] += 2.0f;
    for (std::size_t j = 0; j < 3 && j < d; ++j) k[i * d + j] *= 25.0f;
  }
  return k;
}

// Queries between two stored keys of different clusters with wide noise: no stored key is near them.
std::vector<float> out_of_distribution(const std::vector<float>& keys, std::size_t d, std::size_t nq) {
  Xorshift rng{123};
  const std::size_t n = keys.size() / d;
  std::vector<float> q(nq * d);
  for (std::size_t b = 0; b < nq; ++b) {
    const std::size_t a = (b * 7919) % n, c = (b * 104729 + 17) % n;
    for (std::size_t j = 0; j < d; ++j) q[b * d + j] = 0.5f * (keys[a * d + j] + keys[c * d + j]) + 0.3f * rng.next();
  }
  return q;
}

std::vector<Regime> make_regimes(std::size_t n, std::size_t d, std::size_t nq) {
  std::vector<Regime> out;
  const auto clustered_keys = clustered(n, d, 20, 1);
  const auto values = clustered(n, d, 1, 2);
  std::vector<float> near;
  for (const auto& q : make_queries(clustered_keys, d, nq)) near.insert(near.end(), q.begin(), q.end());
  out.push_back({"peaked, queries near keys (clusters of 20, T = 0.1)", 0.1f, clustered_keys, values, near});
  out.push_back({"peaked, out-of-distribution queries (T = 0.1)", 0.1f, clustered_keys, values, out_of_distribution(clustered_keys, d, nq)});
  const auto gaussian = softkv::bench::gaussian_floats(n * d, 3), gq = softkv::bench::gaussian_floats(nq * d, 4);
  // Gaussian values with the Gaussian keys (the other regimes' values are uniform in [-1, 1]): an estimate's
  // rows depend on the values' spread relative to their largest magnitude (docs/PRUNING.md).
  const auto gv = softkv::bench::gaussian_floats(n * d, 6);
  out.push_back({"spread, Gaussian keys, queries and values (T = 1)", 1.0f, gaussian, gv, gq});
  out.push_back({"Gaussian keys, queries and values (T = 0.3)", 0.3f, gaussian, gv, gq});
  out.push_back({"heavy-tailed keys, Gaussian queries (T = 1)", 1.0f, heavy_tailed(n, d, 5), values, gq});
  if (auto fm = fashion_mnist_regime(nq)) out.push_back(std::move(*fm));
  return out;
}

// A collection of the regime's first rows rows with this index, built.
softkv::Collection regime_collection(softkv::IndexKind kind, const std::vector<float>& keys, const std::vector<float>& values,
                                     std::size_t rows, std::size_t d, std::size_t dv) {
  softkv::CollectionConfig config{d, dv, softkv::Metric::dot, {}, {}};
  config.index.kind = kind;
  softkv::Collection c(config);
  c.add_batch(keys, std::span(values).first(rows * dv));
  c.wait_until_indexed();
  return c;
}

// log sum_i e^{s_i} over all rows and the scores, in double.
double lse_of(const std::vector<float>& keys, const float* q, std::size_t d, double scale, std::vector<double>& s) {
  const std::size_t n = keys.size() / d;
  s.resize(n);
  double m = -INFINITY, z = 0;
  for (std::size_t r = 0; r < n; ++r) {
    double dot = 0;
    for (std::size_t j = 0; j < d; ++j) dot += double(q[j]) * keys[r * d + j];
    s[r] = scale * dot;
    m = std::max(m, s[r]);
  }
  for (double x : s) z += std::exp(x - m);
  return m + std::log(z);
}

// Each regime: exact, flat, ivf (certified) and hnsw (on the first hnsw_n rows), top_k 32 and epsilon 1e-3:
// median ms, speed-up over the exact scan of the same collection, median candidates, and how many answers'
// true omitted mass exceeded their reported bound (guaranteed bounds never may).
void regimes(std::size_t n_all, std::size_t hnsw_n, std::size_t d_all, std::size_t nq, const std::vector<std::string>& kinds,
             const std::string& only) {
  std::printf("\nregimes: N = %zu (hnsw: %zu), d = dv = %zu, %zu queries each; speed-up = exact scan ms / pruned ms, same collection\n",
              n_all, hnsw_n, d_all, nq);
  std::printf("  %-10s %-12s %9s %9s %9s %11s %11s %6s\n", "index", "query", "ms", "exact ms", "speed-up", "candidates",
              "bound < true", "guar.");
  for (const Regime& g : make_regimes(n_all, d_all, nq)) {
    if (g.name.find(only) == std::string::npos) continue;
    const std::size_t d = g.d != 0 ? g.d : d_all, dv = g.dv != 0 ? g.dv : d_all, n = g.keys.size() / d;
    std::printf(" %s%s\n", g.name.c_str(), g.d != 0 ? (" (N = " + std::to_string(n) + ", d = " + std::to_string(d) + ", dv = " + std::to_string(dv) + ")").c_str() : "");
    std::size_t lse_rows = 0;  // the double-precision references, shared by the indexes over the same rows
    std::vector<double> lse_all(nq);
    std::vector<std::vector<double>> scores(nq);
    for (const softkv::IndexKind kind : {softkv::IndexKind::ivf, softkv::IndexKind::flat, softkv::IndexKind::hnsw, softkv::IndexKind::exact}) {
      const char* name = kind == softkv::IndexKind::ivf    ? "ivf"
                         : kind == softkv::IndexKind::flat ? "flat"
                         : kind == softkv::IndexKind::hnsw ? "hnsw"
                                                           : "exact";
      const bool pruning = kind != softkv::IndexKind::exact;  // top_k and epsilon need an index; error_target does not
      if (std::find(kinds.begin(), kinds.end(), name) == kinds.end()) continue;
      const std::size_t rows = kind == softkv::IndexKind::hnsw ? std::min(n, hnsw_n) : n;
      const std::vector<float> keys(g.keys.begin(), g.keys.begin() + static_cast<std::ptrdiff_t>(rows * d));
      const softkv::Collection c = regime_collection(kind, keys, g.values, rows, d, dv);
      const double scale = c.resolve_scale({.temperature = g.temperature});
      std::vector<std::vector<float>> qs;
      for (std::size_t b = 0; b < nq; ++b) qs.emplace_back(g.queries.begin() + static_cast<std::ptrdiff_t>(b * d), g.queries.begin() + static_cast<std::ptrdiff_t>((b + 1) * d));
      if (lse_rows != rows)
        for (std::size_t b = 0; b < nq; ++b) lse_all[b] = lse_of(keys, qs[b].data(), d, scale, scores[b]);
      lse_rows = rows;
      // The exact scan and both pruned forms query by query in turn (twice), so that a change in the
      // machine's load (a shared VM) hits all three alike; medians over 2 x nq calls each.
      softkv::QueryOptions top{.temperature = g.temperature}, eps{.temperature = g.temperature}, est{.temperature = g.temperature};
      top.top_k = 32;
      eps.epsilon = 1e-3f;
      est.error_target = kErrorTarget;
      const softkv::QueryOptions forms[4] = {{.temperature = g.temperature, .exact = true}, top, eps, est};
      Run runs[4];
      std::vector<double> times[4];
      for (int rep = 0; rep < 2; ++rep)
        for (std::size_t b = 0; b < nq; ++b)
          for (int f = 0; f < 4; ++f) {
            if (!pruning && (f == 1 || f == 2)) continue;
            const auto t0 = Clock::now();
            softkv::SoftResult r = c.query_soft(qs[b], forms[f]);
            times[f].push_back(1e3 * seconds_since(t0));
            if (rep == 0) runs[f].results.push_back(std::move(r));
          }
      for (int f = 0; f < 4; ++f) {
        if (times[f].empty()) continue;
        std::sort(times[f].begin(), times[f].end());
        runs[f].ms = times[f][times[f].size() / 2];
      }
      const Run& exact = runs[0];
      // error_target: the true error of each answer against the double reference, relative to max |v|.
      {
        double value_max = 0;
        for (std::size_t i = 0; i < rows * dv; ++i) value_max = std::max(value_max, std::fabs(double(g.values[i])));
        std::size_t over = 0, below = 0;
        std::vector<double> share;
        for (std::size_t b = 0; b < nq; ++b) {
          const softkv::SoftResult& r = runs[3].results[b];
          std::vector<double> ref(dv, 0.0);
          for (std::size_t i = 0; i < rows; ++i) {
            const double w = std::exp(scores[b][i] - lse_all[b]);
            for (std::size_t j = 0; j < dv; ++j) ref[j] += w * g.values[i * dv + j];
          }
          double err = 0;
          for (std::size_t j = 0; j < dv; ++j) err = std::max(err, std::fabs(double(r.value[j]) - ref[j]));
          err /= value_max;
          over += err > kErrorTarget;
          below += err > r.error_estimate + 1e-5;  // float rounding is outside the estimate (docs/PRECISION.md)
          share.push_back(100.0 * double(r.rows_scored) / double(rows));
        }
        std::sort(share.begin(), share.end());
        std::printf("  %-10s %-12s %9.3f %9.3f %8.2fx %10.2f%% rows   over target %zu/%zu  estimate < true %zu/%zu\n", name, "est 1e-2",
                    runs[3].ms, exact.ms, exact.ms / runs[3].ms, share[nq / 2], over, nq, below, nq);
      }
      if (!pruning) continue;
      for (const bool adaptive : {false, true}) {
        const softkv::QueryOptions& o = adaptive ? eps : top;
        const Run& pruned = runs[adaptive ? 2 : 1];
        std::size_t violations = 0;
        std::vector<std::size_t> candidates;
        for (std::size_t b = 0; b < nq; ++b) {
          const softkv::SoftResult& r = pruned.results[b];
          candidates.push_back(r.candidates);
          if (r.candidates >= rows) continue;  // the exact scan: nothing omitted
          softkv::QueryOptions listed = o;
          listed.top_m = std::numeric_limits<std::size_t>::max();  // the candidates themselves, not timed
          const softkv::SoftResult full = c.query_soft(qs[b], listed);
          double m = -INFINITY, z = 0;
          for (const auto& t : full.top) m = std::max(m, scores[b][t.id]);
          for (const auto& t : full.top) z += std::exp(scores[b][t.id] - m);
          const double omitted = -std::expm1(m + std::log(z) - lse_all[b]);
          violations += omitted > r.tail_bound * (1 + 1e-6) + 1e-12;
        }
        std::sort(candidates.begin(), candidates.end());
        std::printf("  %-10s %-12s %9.3f %9.3f %8.2fx %11zu %10zu/%zu %6s\n", name, adaptive ? "eps 1e-3" : "top_k 32", pruned.ms, exact.ms, exact.ms / pruned.ms, candidates[nq / 2], violations, nq,
                    pruned.results[0].tail_bound_guaranteed ? "yes" : "no");
      }
    }
  }
}

// ---- Pareto fronts (issue 25): per regime, each index's time against the answer's true error ----

// One operating point: an index and a query form, medians over the regime's queries.
struct ParetoPoint {
  std::string index, family;  // family: "top_k", "epsilon" or "error_target"
  double setting = 0;         // k, epsilon or the target
  double time_ratio = 0;      // median ms of the form / median ms of the exact scan, queried in turn
  double rows_share = 0;      // median rows scored / N
  double error = 0;           // median max_j |v_j - v_ref_j| / max |v| against the float64 reference
  double broken = 0;          // share of answers whose error exceeded what they reported (2 tail_bound, or error_estimate)
};

// An SVG plot of the points: time relative to the exact scan (log, x) against the true error (log, y),
// one line per index and family; the dashed line is the exact scan (x = 1).
void write_pareto_svg(const std::string& path, const std::string& title, const std::vector<ParetoPoint>& pts) {
  constexpr double W = 720, H = 440, L = 70, R = 200, T = 40, B = 50;
  constexpr double x_lo = -3, x_hi = 0.5, y_lo = -8, y_hi = 0;  // log10 ranges
  auto X = [&](double ratio) { return L + (std::clamp(std::log10(std::max(ratio, 1e-9)), x_lo, x_hi) - x_lo) / (x_hi - x_lo) * (W - L - R); };
  auto Y = [&](double err) { return T + (y_hi - std::clamp(std::log10(std::max(err, 1e-9)), y_lo, y_hi)) / (y_hi - y_lo) * (H - T - B); };
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::printf("  (cannot write %s)\n", path.c_str());
    return;
  }
  std::fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" font-family=\"sans-serif\" font-size=\"11\">\n", W, H);
  std::fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<text x=\"%g\" y=\"20\" font-size=\"13\">%s</text>\n", L, title.c_str());
  for (int e = static_cast<int>(x_lo); e <= 0; ++e)
    std::fprintf(f, "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#eee\"/><text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">1e%d</text>\n",
                 X(std::pow(10, e)), T, X(std::pow(10, e)), H - B, X(std::pow(10, e)), H - B + 14, e);
  for (int e = static_cast<int>(y_lo); e <= 0; e += 2)
    std::fprintf(f, "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#eee\"/><text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">1e%d</text>\n", L,
                 Y(std::pow(10, e)), W - R, Y(std::pow(10, e)), L - 4, Y(std::pow(10, e)) + 4, e);
  std::fprintf(f, "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\n", X(1), T, X(1), H - B);
  std::fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">time / exact scan (log)</text>\n", L + (W - L - R) / 2, H - 12);
  std::fprintf(f, "<text transform=\"translate(16 %g) rotate(-90)\" text-anchor=\"middle\">error / max|v| (log; 0 drawn at 1e-8)</text>\n", T + (H - T - B) / 2);
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd"};
  std::vector<std::string> lines;  // "index family", in order of appearance
  for (const ParetoPoint& p : pts)
    if (std::find(lines.begin(), lines.end(), p.index + " " + p.family) == lines.end()) lines.push_back(p.index + " " + p.family);
  std::vector<std::string> indexes;
  for (const ParetoPoint& p : pts)
    if (std::find(indexes.begin(), indexes.end(), p.index) == indexes.end()) indexes.push_back(p.index);
  for (std::size_t l = 0; l < lines.size(); ++l) {
    std::string points;
    const ParetoPoint* first = nullptr;
    for (const ParetoPoint& p : pts)
      if (p.index + " " + p.family == lines[l]) {
        if (first == nullptr) first = &p;
        points += std::to_string(X(p.time_ratio)) + "," + std::to_string(Y(p.error)) + " ";
      }
    const std::size_t c = static_cast<std::size_t>(std::find(indexes.begin(), indexes.end(), first->index) - indexes.begin()) % 4;
    const char* dash = first->family == "top_k" ? "" : first->family == "epsilon" ? "6 3" : "2 2";
    std::fprintf(f, "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" stroke-dasharray=\"%s\"/>\n", points.c_str(), colors[c], dash);
    for (const ParetoPoint& p : pts)
      if (p.index + " " + p.family == lines[l])
        std::fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%g\" fill=\"%s\"><title>%s %s %g: %.3gx, error %.2g, %.2f%% rows, promise broken in %.0f%%</title></circle>\n",
                     X(p.time_ratio), Y(p.error), p.broken > 0 ? 5.0 : 3.0, p.broken > 0 ? "black" : colors[c], p.index.c_str(),
                     p.family.c_str(), p.setting, p.time_ratio, p.error, 100 * p.rows_share, 100 * p.broken);
    std::fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" stroke-width=\"1.6\" stroke-dasharray=\"%s\"/><text x=\"%g\" y=\"%g\">%s</text>\n",
                 W - R + 12, T + 14 + 16 * static_cast<double>(l), W - R + 40, T + 14 + 16 * static_cast<double>(l), colors[c], dash, W - R + 46,
                 T + 18 + 16 * static_cast<double>(l), lines[l].c_str());
  }
  std::fprintf(f, "<text x=\"%g\" y=\"%g\">black dot: a promise broken</text>\n</svg>\n", W - R + 12, T + 30 + 16 * static_cast<double>(lines.size()));
  std::fclose(f);
}

// Per regime and index: top_k 8 .. 2048, epsilon 1e-1 .. 1e-4 and error_target 1e-1 .. 3e-3, each
// query timed in turn with the exact scan; a table line per point and an SVG per regime in dir.
void pareto(std::size_t n_all, std::size_t hnsw_n, std::size_t d_all, std::size_t nq, const std::vector<std::string>& kinds,
            const std::string& dir) {
  std::printf("\npareto: N = %zu (hnsw: %zu), d = dv = %zu, %zu queries per point; time = median form ms / median exact ms\n"
              "(each query 3 times in turn with the exact scan);\n"
              "error = median max|v - v_ref| / max|v| (float64 reference); broken = answers whose error exceeded 2 x tail_bound\n"
              "(top_k, epsilon) or error_estimate (error_target), float rounding (1e-5) aside\n",
              n_all, hnsw_n, d_all, nq);
  std::printf("  %-6s %-13s %9s %9s %9s %10s %8s\n", "index", "form", "setting", "time", "rows", "error", "broken");
  int regime_no = 0;
  for (const Regime& g : make_regimes(n_all, d_all, nq)) {
    ++regime_no;
    const std::size_t d = g.d != 0 ? g.d : d_all, dv = g.dv != 0 ? g.dv : d_all, n = g.keys.size() / d;
    std::printf(" %s\n", g.name.c_str());
    std::vector<ParetoPoint> points;
    for (const std::string& name : kinds) {
      const softkv::IndexKind kind = name == "ivf" ? softkv::IndexKind::ivf : name == "flat" ? softkv::IndexKind::flat
                                     : name == "hnsw" ? softkv::IndexKind::hnsw : softkv::IndexKind::exact;
      const std::size_t rows = kind == softkv::IndexKind::hnsw ? std::min(n, hnsw_n) : n;
      const std::vector<float> keys(g.keys.begin(), g.keys.begin() + static_cast<std::ptrdiff_t>(rows * d));
      const softkv::Collection c = regime_collection(kind, keys, g.values, rows, d, dv);
      const double scale = c.resolve_scale({.temperature = g.temperature});
      double value_max = 0;
      for (std::size_t i = 0; i < rows * dv; ++i) value_max = std::max(value_max, std::fabs(double(g.values[i])));
      std::vector<std::vector<float>> qs;
      std::vector<std::vector<double>> refs;
      for (std::size_t b = 0; b < nq; ++b) {
        qs.emplace_back(g.queries.begin() + static_cast<std::ptrdiff_t>(b * d), g.queries.begin() + static_cast<std::ptrdiff_t>((b + 1) * d));
        std::vector<double> s;
        const double lse = lse_of(keys, qs[b].data(), d, scale, s);
        std::vector<double> ref(dv, 0.0);
        for (std::size_t i = 0; i < rows; ++i) {
          const double w = std::exp(s[i] - lse);
          for (std::size_t j = 0; j < dv; ++j) ref[j] += w * g.values[i * dv + j];
        }
        refs.push_back(std::move(ref));
      }
      std::vector<std::pair<std::string, double>> forms;
      if (kind != softkv::IndexKind::exact) {
        for (double k : {8.0, 32.0, 128.0, 512.0, 2048.0}) forms.emplace_back("top_k", k);
        for (double e : {1e-1, 1e-2, 1e-3, 1e-4}) forms.emplace_back("epsilon", e);
      }
      for (double t : {1e-1, 3e-2, 1e-2, 3e-3}) forms.emplace_back("error_target", t);
      const softkv::QueryOptions exact{.temperature = g.temperature, .exact = true};
      for (const auto& [family, setting] : forms) {
        softkv::QueryOptions o{.temperature = g.temperature};
        if (family == "top_k") o.top_k = static_cast<std::size_t>(setting);
        if (family == "epsilon") o.epsilon = static_cast<float>(setting);
        if (family == "error_target") o.error_target = static_cast<float>(setting);
        std::vector<double> t_form, t_exact, errors, shares;
        std::size_t broken = 0;
        // Every query kPasses times in turn with the exact scan (a scan of 20,000 rows takes ~0.2 ms: one
        // pass's medians would move with the VM's jitter); the answers are checked on the first pass.
        constexpr int kPasses = 3;
        for (std::size_t i = 0; i < kPasses * nq; ++i) {
          const std::size_t b = i % nq;
          auto t0 = Clock::now();
          (void)c.query_soft(qs[b], exact);
          t_exact.push_back(seconds_since(t0));
          t0 = Clock::now();
          const softkv::SoftResult r = c.query_soft(qs[b], o);
          t_form.push_back(seconds_since(t0));
          if (i >= nq) continue;
          double err = 0;
          for (std::size_t j = 0; j < dv; ++j) err = std::max(err, std::fabs(double(r.value[j]) - refs[b][j]));
          err /= value_max;
          errors.push_back(err);
          shares.push_back(double(r.rows_scored) / double(rows));
          const double promised = family == "error_target" ? r.error_estimate : 2 * r.tail_bound;
          broken += err > promised + 1e-5;
        }
        auto median = [](std::vector<double> v) {
          std::sort(v.begin(), v.end());
          return v[v.size() / 2];
        };
        const ParetoPoint p{name, family, setting, median(t_form) / median(t_exact), median(shares), median(errors), double(broken) / double(nq)};
        std::printf("  %-6s %-13s %9g %8.3fx %8.2f%% %10.2e %7.0f%%\n", name.c_str(), family.c_str(), setting, p.time_ratio, 100 * p.rows_share,
                    p.error, 100 * p.broken);
        points.push_back(p);
      }
    }
    if (!dir.empty()) {
      const std::string path = dir + "/pareto_" + std::to_string(regime_no) + ".svg";
      write_pareto_svg(path, g.name + " (N = " + std::to_string(n) + ", d = " + std::to_string(d) + ")", points);
      std::printf("  plot: %s\n", path.c_str());
    }
  }
}

// ---- a batch of estimates (issue 26: batches share their reads) ----
// One row of the table: nq queries with these options as one batch (one shared sample; with certified lists
// also one pass over the centroids for a group's walks), the same queries one by one, and the exact fused
// batch; best of 3 of each. The exact batch runs before the batch and again before the queries one by
// one, so that both start from the caches a scan leaves (the queries alone would otherwise find the lists
// the batch just read).
void compare_batch(const softkv::Collection& c, const char* index, const char* queries, const std::vector<float>& qs, std::size_t nq,
                   std::size_t d, std::size_t n, const softkv::QueryOptions& options) {
  double best[3] = {1e300, 1e300, 1e300};
  std::vector<std::size_t> batch_rows, alone_rows;
  softkv::QueryOptions exact = options;
  exact.error_target.reset();
  const auto exact_batch = [&] {
    const auto t0 = Clock::now();
    (void)c.query(qs, softkv::Retrieval::soft, exact);
    best[2] = std::min(best[2], seconds_since(t0));
  };
  for (int rep = 0; rep < 3; ++rep) {
    exact_batch();
    auto t0 = Clock::now();
    const softkv::QueryResults b = c.query(qs, softkv::Retrieval::soft, options);
    best[0] = std::min(best[0], seconds_since(t0));
    exact_batch();
    t0 = Clock::now();
    std::vector<softkv::SoftResult> alone;
    for (std::size_t i = 0; i < nq; ++i) alone.push_back(c.query_soft(std::span(qs).subspan(i * d, d), options));
    best[1] = std::min(best[1], seconds_since(t0));
    batch_rows.clear();
    alone_rows.clear();
    for (const auto& r : b.soft) batch_rows.push_back(r.rows_scored);
    for (const auto& r : alone) alone_rows.push_back(r.rows_scored);
  }
  std::sort(batch_rows.begin(), batch_rows.end());
  std::sort(alone_rows.begin(), alone_rows.end());
  std::printf("  %-6s %-12s %-8g %12.1f %9.2f%% %14.1f %9.2f%% %14.1f %8.2fx %8.1fx\n", index, queries, double(*options.error_target),
              1e3 * best[0], 100.0 * double(batch_rows[nq / 2]) / double(n), 1e3 * best[1], 100.0 * double(alone_rows[nq / 2]) / double(n),
              1e3 * best[2], best[0] / best[1], best[2] / best[0]);
}

void print_batch_header() {
  std::printf("  %-6s %-12s %-8s %12s %10s %14s %10s %14s %9s %9s\n", "index", "queries", "target", "batch ms", "rows/q", "one by one ms",
              "rows/q", "exact batch ms", "ratio", "vs exact");
}

// Spread: Gaussian keys, values and queries at T = 1, without an index and with ivf. Peaked: the regimes'
// clustered keys (clusters of 20) with queries near stored keys at T = 0.1, ivf, where every query's walk
// answers it (a batch must not cost more a query than the same queries alone).
void estimate_batch(std::size_t n, std::size_t d, std::size_t nq) {
  const std::vector<float> keys = softkv::bench::gaussian_floats(n * d, 31), values = softkv::bench::gaussian_floats(n * d, 32);
  const std::vector<float> independent = softkv::bench::gaussian_floats(nq * d, 33);
  // Similar queries (as a sequence's consecutive queries are): one Gaussian query plus noise of a third of
  // its size each (cosine ~0.95 between them), whose walks visit many of the same lists.
  std::vector<float> similar = softkv::bench::gaussian_floats(nq * d, 34);
  for (std::size_t i = 0; i < nq * d; ++i) similar[i] = independent[i % d] + similar[i] / 3;
  std::printf("\nestimate batch: N = %zu, d = dv = %zu, %zu Gaussian queries (independent, or similar: one query plus noise a third its size), "
              "T = 1; best of 3 runs each\n", n, d, nq);
  print_batch_header();
  for (const softkv::IndexKind kind : {softkv::IndexKind::exact, softkv::IndexKind::ivf}) {
    softkv::CollectionConfig config{d, d, softkv::Metric::dot, {}, {}};
    config.index.kind = kind;
    softkv::Collection c(config);
    c.add_batch(keys, values);
    c.wait_until_indexed();
    for (const bool alike : {false, true})
      for (const float target : {1e-2f, 3e-2f})
        compare_batch(c, kind == softkv::IndexKind::ivf ? "ivf" : "none", alike ? "similar" : "independent", alike ? similar : independent,
                      nq, d, n, {.error_target = target});
  }
  const std::size_t peaked_nq = std::max<std::size_t>(nq, 32);
  std::printf("\nestimate batch, peaked: N = %zu, d = dv = %zu, clustered keys (clusters of 20), %zu queries near stored keys, T = 0.1; "
              "best of 3 runs each\n", n, d, peaked_nq);
  print_batch_header();
  const auto clustered_keys = clustered(n, d, 20, 1);
  const auto clustered_values = clustered(n, d, 1, 2);
  std::vector<float> near;
  for (const auto& q : make_queries(clustered_keys, d, peaked_nq)) near.insert(near.end(), q.begin(), q.end());
  softkv::CollectionConfig config{d, d, softkv::Metric::dot, {}, {}};
  config.index.kind = softkv::IndexKind::ivf;
  softkv::Collection c(config);
  c.add_batch(clustered_keys, clustered_values);
  c.wait_until_indexed();
  for (const float target : {1e-2f, 1e-3f}) compare_batch(c, "ivf", "near keys", near, peaked_nq, d, n, {.temperature = 0.1f, .error_target = target});
}

// Smallest of several sizes at which IVF (k = 32) answers faster than the exact scan.
void crossover(std::size_t d, std::size_t nq) {
  std::printf("\ncrossover: exact scan vs IVF (k = 32, nprobe 16, default nlist), clustered data, d = dv = %zu\n", d);
  std::printf("  %9s %10s %10s\n", "N", "exact ms", "ivf ms");
  for (const std::size_t n : {2000u, 5000u, 10000u, 20000u, 50000u, 100000u}) {
    const auto keys = clustered(n, d, 20, 3);
    softkv::CollectionConfig config{d, d, softkv::Metric::dot, {}, {}};
    config.index.kind = softkv::IndexKind::ivf;
    softkv::Collection c(config);
    c.add_batch(keys, keys);
    c.wait_until_indexed();
    const auto qs = make_queries(keys, d, nq);
    const double exact = run(c, qs, {}).ms, ivf = run(c, qs, {.top_k = 32}).ms;
    std::printf("  %9zu %10.3f %10.3f %s\n", n, exact, ivf, ivf < exact ? "<- IVF faster" : "");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"softkv pruning benchmark: pruned soft retrieval vs the exact scan"};
  std::size_t n = 1000000, hnsw_n = 100000, d = 128, nq = 200;
  float temperature = 0.1f;
  // nlist 0: the certified lists' own count (one list per 32 rows, wide ones split, so that a list's bound is
  // tight); a fixed 4,096 at 1M rows (FAISS's IVF's setting, before the certified lists) puts ~12
  // clusters in a list, whose bound then proves nothing and every query falls back to the scan.
  std::size_t nlist = 0, nprobe = 8;
  bool only_crossover = false, only_violations = false, only_regimes = false;
  std::string pareto_dir;
  bool only_estimate_batch = false;
  std::size_t sample = 256;
  std::vector<std::string> kinds{"ivf", "flat", "hnsw"};
  std::string only_regime;
  app.add_option("--regime", only_regime, "with --regimes: only the regimes whose name contains this text (default: every regime)");
  app.add_option("--n", n, "entries for the exact, flat and IVF tables");
  app.add_option("--hnsw-n", hnsw_n, "entries for the HNSW table (HNSW builds slowly on 2 cores)");
  app.add_option("--d", d, "key and value dimension");
  app.add_option("--queries", nq, "queries per measurement");
  app.add_option("--temperature", temperature, "softmax temperature");
  app.add_option("--nlist", nlist, "IVF lists (0: the certified lists' default for N)")->capture_default_str();
  app.add_option("--nprobe", nprobe, "IVF lists probed per query");
  app.add_flag("--crossover", only_crossover, "only measure the exact-vs-IVF crossover");
  app.add_flag("--violations", only_violations, "only measure how often hnsw/ivf tail bounds are violated, with and without the sampled check");
  app.add_flag("--regimes", only_regimes, "only the data regimes: exact, flat, ivf and hnsw on peaked, out-of-distribution, spread and heavy-tailed data");
  app.add_option("--pareto", pareto_dir, "only the Pareto fronts of the data regimes (time against true error per index and form); SVGs go to this directory");
  app.add_flag("--estimate-batch", only_estimate_batch, "only a batch of error_target queries (one shared sample) against the same queries one by one");
  app.add_option("--check-sample", sample, "rows the sampled check scores (with --violations)");
  app.add_option("--kinds", kinds, "index kinds to measure (exact: no index, error_target only, in --regimes)")
      ->check(CLI::IsMember({"ivf", "flat", "hnsw", "exact"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each table line as it is measured (runs take minutes)
  std::printf("softkv %s pruning bench, kernel path %s; clustered keys (clusters of 20), queries near stored keys\n",
              softkv::kVersion, std::string(softkv::simd_path()).c_str());
  if (only_estimate_batch) {
    estimate_batch(n, d, nq);
    return 0;
  }
  if (!pareto_dir.empty()) {
    pareto(n, hnsw_n, d, nq, kinds, pareto_dir);
    return 0;
  }
  if (only_regimes) {
    regimes(n, hnsw_n, d, nq, kinds, only_regime);
    return 0;
  }
  if (only_violations) {
    violations(n, d, nq, temperature, sample);
    return 0;
  }
  auto wanted = [&](const char* kind) { return std::find(kinds.begin(), kinds.end(), kind) != kinds.end(); };
  if (!only_crossover) {
    const std::string ivf = nlist == 0 ? std::string("ivf (certified lists, default nlist)") : "ivf (certified lists, nlist " + std::to_string(nlist) + ")";
    if (wanted("ivf")) pruned_table(ivf.c_str(), softkv::IndexKind::ivf, n, d, nq, temperature, nlist, nprobe);
    if (wanted("flat"))
      pruned_table("flat (softkv's fused score + top-k pass)", softkv::IndexKind::flat, n, d, std::min<std::size_t>(nq, 50), temperature, nlist, nprobe);
    if (wanted("hnsw"))
      pruned_table("hnsw (M 32, efConstruction 80, efSearch max(128, k))", softkv::IndexKind::hnsw, hnsw_n, d, nq, temperature,
                   nlist, nprobe);
  }
  if (only_crossover || kinds.size() == 3) crossover(d, 100);
  return 0;
}
