// masks_bench: the cost of masked queries against the unmasked scan, as a Markdown table on stdout.
//
// N rows with tags laid out two ways: grouped (tag = row / (N / 100): each tag's rows stored together,
// as time stamps or a user's batch would be) and scattered (tag = row % 100: every run one row long).
// Masks keep 1% (one tag) or 50% (half the tags: a range when grouped, tags_any when scattered).
// Each figure is the fastest of --reps runs of a single soft (or hard) query. Not a test.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

double fastest_ms(int reps, const std::function<void()>& run) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"masked vs unmasked queries"};
  std::size_t n = 1000000, d = 64, dv = 64;
  int reps = 7;
  app.add_option("--rows", n, "rows")->capture_default_str();
  app.add_option("--dim", d, "key dimension")->capture_default_str();
  app.add_option("--value-dim", dv, "value dimension")->capture_default_str();
  app.add_option("--reps", reps, "runs per figure (the fastest is reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> keys(n * d), values(n * dv), query(d);
  for (float& x : keys) x = normal(rng);
  for (float& x : values) x = normal(rng);
  for (float& x : query) x = normal(rng);
  const std::size_t group = std::max<std::size_t>(1, n / 100);

  std::printf("N = %zu, d = %zu, dv = %zu, kernel path %s, fastest of %d runs, one query at a time (threads: default)\n\n", n, d,
              dv, std::string(softkv::simd_path()).c_str(), reps);
  std::printf("| layout | mask | kept | soft ms | unmasked / masked | hard ms | unmasked / masked |\n|---|---|---|---|---|---|---|\n");
  for (const bool grouped : {true, false}) {
    std::vector<std::uint64_t> tags(n);
    for (std::size_t r = 0; r < n; ++r) tags[r] = grouped ? std::min<std::size_t>(r / group, 99) : r % 100;
    softkv::Collection c({.dim = d, .value_dim = dv});
    c.set_coalescing(false);
    c.add_batch(keys, values, tags);
    softkv::QueryOptions none, one, half;
    one.tags_any = {42};
    if (grouped) {
      half.tag_range = softkv::TagRange{0, 49};
    } else {
      for (std::uint64_t t = 0; t < 100; t += 2) half.tags_any.push_back(t);
    }
    double soft_base = 0, hard_base = 0;
    for (const auto& [name, options] : {std::pair{"none", none}, std::pair{"1%", one}, std::pair{"50%", half}}) {
      std::size_t kept = 0;
      const double soft = fastest_ms(reps, [&] { kept = c.query_soft(query, options).candidates; });
      const double hard = fastest_ms(reps, [&] { (void)c.query_hard(query, options); });
      if (std::string(name) == "none") soft_base = soft, hard_base = hard;
      std::printf("| %s | %s | %zu | %.2f | %.1fx | %.2f | %.1fx |\n", grouped ? "grouped" : "scattered", name, kept, soft,
                  soft_base / soft, hard, hard_base / hard);
    }
  }
  return 0;
}
