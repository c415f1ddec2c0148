// heads_bench: a multi-head collection against h single-head collections of its slices and against one
// single-head scan over the same bytes, as a Markdown table on stdout. Not a test.
//
// Default: N = 250,000 rows, d = dv = 512, h = 8 (each head d/h = 64 key and value floats). The three
// ways to answer "8 heads" read the same N * (d + dv) * 4 bytes: one multi-head pass, 8 passes over 8
// collections of 64 + 64 floats a row, or (the bandwidth yardstick) one single-head pass over d = dv = 512.
// Goal (issue 15): multi-head within 1.1x of the single-head scan. Each figure: the fastest and the
// median of --reps runs of one soft (or hard) query, coalescing off.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <thread>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

struct Timing {
  double fastest = 0, median = 0;  // ms
};

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"multi-head vs single-head collections"};
  std::size_t n = 250000, d = 512, heads = 8;
  int reps = 15;
  std::size_t threads = 0;
  app.add_option("--rows", n, "rows")->capture_default_str();
  app.add_option("--dim", d, "key and value dimension")->capture_default_str();
  app.add_option("--heads", heads, "heads")->capture_default_str();
  app.add_option("--reps", reps, "runs per figure")->capture_default_str();
  app.add_option("--threads", threads, "threads per query (QueryOptions::threads; 0: the default)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const std::size_t dh = d / heads;

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> rows(n * d), query(d);
  for (float& x : rows) x = normal(rng);
  for (float& x : query) x = normal(rng);

  std::printf("CPU: %s, %u hardware threads, kernel path %s\n", cpu_model().c_str(), std::thread::hardware_concurrency(),
              std::string(softkv::simd_path()).c_str());
  std::printf("N = %zu, d = dv = %zu, h = %zu (d/h = %zu), %.0f MiB of keys and values per layout; one query at a time, "
              "threads %zu (0: default), coalescing off; layouts interleaved, fastest and median of %d runs\n\n",
              n, d, heads, dh, double(n) * 2 * d * 4 / (1 << 20), threads, reps);

  // All three layouts live at once and every round runs each once, in turn: on a shared machine the
  // others' load then falls on all three alike.
  softkv::QueryOptions o;
  o.threads = threads;
  softkv::Collection single({.dim = d, .value_dim = d});  // the yardstick: one head over all d floats
  single.add_batch(rows, rows);
  softkv::CollectionConfig config{.dim = d, .value_dim = d};
  config.heads = heads;
  softkv::Collection multi(config);
  multi.add_batch(rows, rows);
  std::vector<softkv::Collection> separate;
  {
    std::vector<float> slice(n * dh);
    for (std::size_t j = 0; j < heads; ++j) {
      for (std::size_t r = 0; r < n; ++r)
        std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(r * d + j * dh), dh, slice.begin() + static_cast<std::ptrdiff_t>(r * dh));
      separate.emplace_back(softkv::CollectionConfig{.dim = dh, .value_dim = dh});
      separate.back().add_batch(slice, slice);
    }
  }
  for (softkv::Collection* c : {&single, &multi}) c->set_coalescing(false);
  for (softkv::Collection& c : separate) c.set_coalescing(false);
  rows.clear();
  rows.shrink_to_fit();
  const std::function<void(bool)> layouts[3] = {
      [&](bool hard) { hard ? (void)single.query_hard(query, o) : (void)single.query_soft(query, o); },
      [&](bool hard) { hard ? (void)multi.query_hard(query, o) : (void)multi.query_soft(query, o); },
      [&](bool hard) {
        for (std::size_t j = 0; j < heads; ++j) {
          const std::span<const float> q(query.data() + j * dh, dh);
          hard ? (void)separate[j].query_hard(q, o) : (void)separate[j].query_soft(q, o);
        }
      }};
  const char* names[3] = {"single-head scan, d = dv = 512 (same bytes)", "multi-head, h = 8, one pass",
                          "8 single-head collections, d = dv = 64, 8 queries"};
  std::vector<double> samples[3][2];
  for (int r = 0; r < reps; ++r)
    for (int hard = 0; hard < 2; ++hard)
      for (int l = 0; l < 3; ++l) {
        const auto t0 = std::chrono::steady_clock::now();
        layouts[l](hard == 1);
        samples[l][hard].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
  struct Row {
    const char* what;
    Timing soft, hard;
  };
  std::vector<Row> out;
  for (int l = 0; l < 3; ++l) {
    Row row{names[l], {}, {}};
    for (int hard = 0; hard < 2; ++hard) {
      std::vector<double>& t = samples[l][hard];
      std::sort(t.begin(), t.end());
      (hard ? row.hard : row.soft) = Timing{t.front(), t[t.size() / 2]};
    }
    out.push_back(row);
  }

  std::printf("| layout | soft ms (fastest / median) | soft vs single-head scan | hard ms (fastest / median) | hard vs single-head scan |\n"
              "|---|---|---|---|---|\n");
  for (const Row& r : out)
    std::printf("| %s | %.1f / %.1f | %.2fx | %.1f / %.1f | %.2fx |\n", r.what, r.soft.fastest, r.soft.median,
                r.soft.fastest / out[0].soft.fastest, r.hard.fastest, r.hard.median, r.hard.fastest / out[0].hard.fastest);
  std::printf("\nGoal (issue 15): multi-head soft within 1.1x of the single-head scan: %s (%.2fx on the fastest runs).\n",
              out[1].soft.fastest <= 1.1 * out[0].soft.fastest ? "met" : "NOT met", out[1].soft.fastest / out[0].soft.fastest);
  return 0;
}
