// hard_vs_soft: one query against a small store, answered softly at several temperatures and hard.
//
// Soft retrieval returns a blend of values weighted by softmax(q . k / (sqrt(d) T)) -- "proportional
// retrieval". Hard retrieval returns the single best value -- a one-hot lookup. As T -> 0 the
// softmax turns one-hot and soft converges to hard; this program prints that convergence.
// `hard_vs_soft --svg FILE` also draws it: each key's weight against T (the README's picture).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

struct Animal {
  const char* name;
  std::vector<float> key;    // features: size, furriness, domestic, aquatic
  std::vector<float> value;  // what we want back: weight (kg), lifespan (years)
};

const std::vector<Animal> kAnimals = {
    {"cat", {0.2f, 0.9f, 1.0f, 0.0f}, {4.5f, 15.0f}},     {"dog", {0.4f, 0.8f, 1.0f, 0.0f}, {30.0f, 12.0f}},
    {"wolf", {0.5f, 0.9f, 0.0f, 0.0f}, {40.0f, 7.0f}},    {"horse", {1.0f, 0.4f, 0.8f, 0.0f}, {500.0f, 28.0f}},
    {"goldfish", {0.05f, 0.0f, 0.9f, 1.0f}, {0.1f, 10.0f}}, {"dolphin", {0.7f, 0.0f, 0.0f, 1.0f}, {150.0f, 40.0f}},
};

// Draws each animal's attention weight against log10 T (T from 1e-3 to 1e2) as an SVG line plot.
bool write_svg(const softkv::Collection& store, const std::vector<float>& query, const char* path) {
  constexpr int kPoints = 121, kW = 640, kH = 300, kLeft = 50, kRight = 110, kTop = 30, kBottom = 40;
  constexpr double kLo = -3, kHi = 2;  // log10 T
  const char* colours[] = {"#d62728", "#1f77b4", "#7f7f7f", "#8c564b", "#ff7f0e", "#2ca02c"};
  const auto x = [&](double log_t) { return kLeft + (log_t - kLo) / (kHi - kLo) * (kW - kLeft - kRight); };
  const auto y = [&](double w) { return kTop + (1 - w) * (kH - kTop - kBottom); };
  std::vector<std::string> lines(kAnimals.size());
  for (int i = 0; i < kPoints; ++i) {
    const double log_t = kLo + (kHi - kLo) * i / (kPoints - 1);
    const softkv::SoftResult r =
        store.query_soft(query, {.temperature = static_cast<float>(std::pow(10.0, log_t)), .top_m = kAnimals.size()});
    for (const softkv::Contributor& c : r.top) {
      char point[40];
      std::snprintf(point, sizeof point, "%.1f,%.1f ", x(log_t), y(c.weight));
      lines[c.id] += point;
    }
  }
  std::ofstream out(path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW << "\" height=\"" << kH
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kLeft << "\" y=\"18\">attention weight of each key for \"a small, furry, domestic animal\"</text>\n";
  for (int e = static_cast<int>(kLo); e <= static_cast<int>(kHi); ++e)  // grid and labels at each power of ten
    out << "<line x1=\"" << x(e) << "\" y1=\"" << kTop << "\" x2=\"" << x(e) << "\" y2=\"" << y(0)
        << "\" stroke=\"#ddd\"/><text x=\"" << x(e) - 12 << "\" y=\"" << y(0) + 16 << "\">1e" << e << "</text>\n";
  out << "<text x=\"" << x(kLo) << "\" y=\"" << kH - 6 << "\">T: hard (one-hot) at the left, soft (near uniform) at the right</text>\n";
  for (double w : {0.0, 0.5, 1.0})
    out << "<text x=\"" << kLeft - 30 << "\" y=\"" << y(w) + 4 << "\">" << w << "</text>\n";
  out << "<polyline points=\"" << x(kLo) << "," << kTop << " " << x(kLo) << "," << y(0) << " " << x(kHi) << "," << y(0)
      << "\" fill=\"none\" stroke=\"black\"/>\n";
  for (std::size_t a = 0; a < kAnimals.size(); ++a)
    out << "<polyline points=\"" << lines[a] << "\" fill=\"none\" stroke-width=\"2\" stroke=\"" << colours[a]
        << "\"/>\n<text x=\"" << kW - kRight + 8 << "\" y=\"" << kTop + 16 * (a + 1) << "\" fill=\"" << colours[a] << "\">"
        << kAnimals[a].name << "</text>\n";
  out << "</svg>\n";
  return static_cast<bool>(out.flush());
}

}  // namespace

int main(int argc, char** argv) {
  softkv::Collection store({.dim = 4, .value_dim = 2});
  for (const Animal& a : kAnimals) store.add(a.key, a.value);  // ids 0..5 in this order

  const std::vector<float> query = {0.3f, 0.9f, 1.0f, 0.0f};  // "a small, furry, domestic animal"
  if (argc == 3 && std::string_view(argv[1]) == "--svg") {
    if (!write_svg(store, query, argv[2])) {
      std::fprintf(stderr, "hard_vs_soft: cannot write %s\n", argv[2]);
      return 1;
    }
    std::printf("wrote %s\n", argv[2]);
    return 0;
  }
  if (argc != 1) {
    std::fprintf(stderr, "usage: hard_vs_soft [--svg FILE]\n");
    return 2;
  }
  std::printf("softkv %s, kernel path %s\n", softkv::kVersion, std::string(softkv::simd_path()).c_str());
  std::printf("store: 6 animals; key = (size, furriness, domestic, aquatic), value = (weight kg, lifespan y)\n");
  std::printf("query: (0.3, 0.9, 1.0, 0.0) -- a small, furry, domestic animal\n\n");

  std::printf("%-6s", "T");
  for (const Animal& a : kAnimals) std::printf("%9s", a.name);
  std::printf("  | soft answer: weight kg  lifespan y | effective entries\n");
  std::vector<float> last_soft;
  for (const float t : {10.0f, 1.0f, 0.3f, 0.1f, 0.03f, 0.01f, 0.003f, 0.001f}) {
    const softkv::SoftResult r = store.query_soft(query, {.temperature = t, .top_m = kAnimals.size()});
    std::vector<float> weight(kAnimals.size());
    double entropy = 0;
    for (const softkv::Contributor& c : r.top) {
      weight[c.id] = c.weight;
      if (c.weight > 0) entropy -= c.weight * std::log(static_cast<double>(c.weight));
    }
    std::printf("%-6g", t);
    last_soft = r.value;
    for (float w : weight) std::printf("%8.1f%%", 100 * w);
    // exp(entropy): how many entries the answer effectively averages over (6 = uniform, 1 = one-hot).
    std::printf("  |        %8.2f  %10.2f   | %6.2f\n", r.value[0], r.value[1], std::exp(entropy));
  }

  const softkv::HardResult hard = store.query_hard(query);
  std::printf("\nhard answer: %s -> weight %.2f kg, lifespan %.2f y (score %.3f)\n", kAnimals[hard.id].name,
              hard.value[0], hard.value[1], hard.score);
  const double gap = std::fmax(std::fabs(last_soft[0] - hard.value[0]), std::fabs(last_soft[1] - hard.value[1]));
  std::printf("soft at T = 0.001 differs from the hard answer by %.2g\n", gap);
  std::printf("\nRead it like this:\n"
              " - at high T the weights are nearly uniform: the soft answer is close to the mean of all values;\n"
              " - as T falls the weight moves to the keys most like the query (cat, then dog): proportional\n"
              "   retrieval, a blend no single entry holds;\n"
              " - as T -> 0 the weights turn one-hot and soft retrieval becomes the hard lookup (%s).\n",
              kAnimals[hard.id].name);
  return 0;
}
