// Compact storage side by side: time, bytes per row and GB/s of single and batched queries at each
// precision next to float32, and the error of each against a float64 answer (bench/results/PRECISION.md).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common.hpp"
#include "softkv/softkv.hpp"

namespace {

struct Setting {
  const char* name;
  softkv::Precision key, value;
};

const Setting kSettings[] = {
    {"f32/f32", softkv::Precision::f32, softkv::Precision::f32},   {"f16/f16", softkv::Precision::f16, softkv::Precision::f16},
    {"bf16/bf16", softkv::Precision::bf16, softkv::Precision::bf16}, {"i8/f16", softkv::Precision::i8, softkv::Precision::f16},
    {"i8/bf16", softkv::Precision::i8, softkv::Precision::bf16},
};

double row_bytes(const Setting& s, std::size_t d, std::size_t dv) {
  auto eb = [](softkv::Precision p) { return p == softkv::Precision::f32 ? 4.0 : p == softkv::Precision::i8 ? 1.0 : 2.0; };
  return d * eb(s.key) + (s.key == softkv::Precision::i8 ? 4.0 : 0.0) + dv * eb(s.value);
}

// The exact answer in float64 on the given (unrounded) rows: max |value error| and |lse error| of a result.
void float64_answer(const std::vector<float>& q, const std::vector<float>& keys, const std::vector<float>& values, std::size_t n,
                    std::size_t d, std::size_t dv, double scale, std::vector<double>& out, double& lse) {
  std::vector<double> s(n);
  double m = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    double t = 0;
    for (std::size_t j = 0; j < d; ++j) t += double(q[j]) * keys[i * d + j];
    s[i] = scale * t;
    m = std::max(m, s[i]);
  }
  double z = 0;
  out.assign(dv, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    const double w = std::exp(s[i] - m);
    z += w;
    for (std::size_t j = 0; j < dv; ++j) out[j] += w * values[i * dv + j];
  }
  for (double& x : out) x /= z;
  lse = m + std::log(z);
}

// Resident set size of this process, in MiB (VmRSS).
double rss_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"softkv compact storage benchmark"};
  std::size_t n = 1'000'000, d = 128, dv = 128, batch = 64, error_rows = 100'000;
  int reps = 5;
  std::size_t threads = 0;
  app.add_option("-n,--rows", n, "entries");
  app.add_option("-d,--dim", d, "key dimension");
  app.add_option("--value-dim", dv, "value dimension");
  app.add_option("--batch", batch, "queries in the batched run");
  app.add_option("--reps", reps, "timed rounds, each setting once per round, interleaved (medians reported)");
  app.add_option("--error-rows", error_rows, "entries of the error measurement against float64");
  app.add_option("--threads", threads, "threads per query (0: softkv's choice)");
  bool tune = false;
  app.add_flag("--tune-scans", tune, "measure the scans' prefetch settings first (softkv::tune_scans, as softkv-server --tune-scans)");
  CLI11_PARSE(app, argc, argv);

  std::string cpu = "unknown CPU";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  std::printf("%s; simd path: %s; N = %zu, d = %zu, dv = %zu, batch %zu (median of %d runs), threads %zu (0: auto)\n\n", cpu.c_str(),
              std::string(softkv::simd_path()).c_str(), n, d, dv, batch, reps, threads);
  if (tune) std::printf("tune_scans: %s\n\n", softkv::tune_scans().c_str());
  std::printf("%-10s %9s %9s %11s %9s %9s %13s %9s\n", "precision", "bytes/row", "RSS MiB", "single ms", "GB/s", "speedup",
              "batch ms/query", "speedup");
  const std::vector<float> keys = softkv::bench::uniform_floats(n * d, 1), values = softkv::bench::uniform_floats(n * dv, 2);
  const std::vector<float> queries = softkv::bench::uniform_floats(batch * d, 3);
  // Every collection is built first and the timings interleave (one run of each setting per round),
  // so a change in the machine's load during the run touches every setting alike; the speed-ups are
  // the medians of the per-round ratios to float32 in the same round.
  struct Built {
    const Setting* setting;
    std::unique_ptr<softkv::Collection> col;
    double rss = 0;
    std::vector<double> single, batched;
  };
  std::vector<Built> built;
  for (const Setting& s : kSettings) {
    softkv::CollectionConfig config{d, dv, softkv::Metric::dot, std::nullopt, {}};
    config.key_precision = s.key;
    config.value_precision = s.value;
    const double rss_before = rss_mib();
    auto col = std::make_unique<softkv::Collection>(config);
    col->set_coalescing(false);
    for (std::size_t start = 0; start < n; start += 65536) {  // in slices: prepare() copies its input
      const std::size_t m = std::min<std::size_t>(65536, n - start);
      col->add_batch(std::span(keys).subspan(start * d, m * d), std::span(values).subspan(start * dv, m * dv));
    }
    built.push_back({&s, std::move(col), rss_mib() - rss_before, {}, {}});  // the collection's rows (inputs were resident before)
  }
  const std::span<const float> one(queries.data(), d);
  softkv::QueryOptions timed;
  timed.threads = threads;
  auto ms = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  for (Built& b : built) (void)b.col->query_soft(one, timed), (void)b.col->query_soft_batch(queries, timed);  // warm up
  for (int round = 0; round < std::max(1, reps); ++round)
    for (Built& b : built) {
      b.single.push_back(ms([&] { (void)b.col->query_soft(one, timed); }));
      b.batched.push_back(ms([&] { (void)b.col->query_soft_batch(queries, timed); }) / double(batch));
    }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto ratio = [&](const std::vector<double>& base, const std::vector<double>& x) {
    std::vector<double> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) r[i] = base[i] / x[i];
    return median(r);
  };
  for (const Built& b : built) {
    const double single = median(b.single), batched = median(b.batched), bytes = row_bytes(*b.setting, d, dv);
    std::printf("%-10s %9.0f %9.0f %11.2f %9.1f %8.2fx %13.3f %8.2fx\n", b.setting->name, bytes, b.rss, single,
                bytes * double(n) / single / 1e6, ratio(built[0].single, b.single), batched, ratio(built[0].batched, b.batched));
  }
  built.clear();

  // Error against float64 on random normal-ish data (uniform [-1, 1) here), at T = 1 and T = 0.1.
  std::printf("\nmax error against float64 (N = %zu, d = %zu, dv = %zu, 8 queries; scale 1/(sqrt(d) T)):\n", error_rows, d, dv);
  std::printf("%-10s %5s %14s %14s\n", "precision", "T", "max |value|", "max |lse|");
  const std::size_t en = std::min(error_rows, n);
  for (const Setting& s : kSettings) {
    softkv::CollectionConfig config{d, dv, softkv::Metric::dot, std::nullopt, {}};
    config.key_precision = s.key;
    config.value_precision = s.value;
    softkv::Collection col(config);
    col.add_batch(std::span(keys).first(en * d), std::span(values).first(en * dv));
    for (const float t : {1.0f, 0.1f}) {
      softkv::QueryOptions o;
      o.temperature = t;
      const double scale = 1.0 / (std::sqrt(double(d)) * t);
      double value_err = 0, lse_err = 0;
      for (std::size_t b = 0; b < 8; ++b) {
        const std::vector<float> q(queries.begin() + long(b * d), queries.begin() + long((b + 1) * d));
        std::vector<double> exact;
        double lse = 0;
        float64_answer(q, keys, values, en, d, dv, scale, exact, lse);
        const softkv::SoftResult r = col.query_soft(q, o);
        for (std::size_t j = 0; j < dv; ++j) value_err = std::max(value_err, std::fabs(r.value[j] - exact[j]));
        lse_err = std::max(lse_err, std::fabs(r.lse - lse));
      }
      std::printf("%-10s %5.1f %14.3e %14.3e\n", s.name, double(t), value_err, lse_err);
    }
  }
  return 0;
}
