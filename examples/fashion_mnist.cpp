// fashion_mnist: hard vs soft retrieval as a classifier on real data (Debian's dataset-fashion-mnist).
//
// Keys are the 60,000 training images (784 pixels, cosine), values their one-hot labels (10-d). A test
// image's hard answer is its nearest neighbour's label; its soft answer is the softmax-weighted label
// distribution, whose argmax is the prediction (a soft nearest-neighbour / kernel classifier). The
// scale (Hopfield's beta) is chosen on a validation split carved out of the training set.
// Usage: fashion_mnist [--data DIR] [--pruned-queries N (default 1000; 10000 for the whole test set)]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_data.hpp"
#include "softkv/softkv.hpp"

namespace {

using softkv::fashion_mnist::kClasses;
using softkv::fashion_mnist::kPixels;
using softkv::fashion_mnist::load;
using softkv::fashion_mnist::Split;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }


std::size_t argmax(const float* v) { return static_cast<std::size_t>(std::max_element(v, v + kClasses) - v); }

// Accuracy of soft retrieval (argmax of the blended label distribution) for queries[first, first + n).
double soft_accuracy(const softkv::Collection& store, const Split& queries, std::size_t first, std::size_t n, float scale) {
  const softkv::SoftBatchResult r = store.query_soft_batch(
      std::span<const float>(queries.images.data() + first * kPixels, n * kPixels), {.scale = scale});
  std::size_t right = 0;
  for (std::size_t i = 0; i < n; ++i) right += argmax(r.values.data() + i * kClasses) == queries.labels[first + i];
  return static_cast<double>(right) / static_cast<double>(n);
}

softkv::Collection make_store(const Split& train, std::size_t n, softkv::IndexKind kind,
                              softkv::Precision keys = softkv::Precision::f32, softkv::Precision values = softkv::Precision::f32) {
  softkv::CollectionConfig config{kPixels, kClasses, softkv::Metric::cosine, {}, {}};
  config.index.kind = kind;
  config.key_precision = keys;
  config.value_precision = values;
  softkv::Collection store(config);
  store.add_batch(std::span<const float>(train.images.data(), n * kPixels), std::span<const float>(train.one_hot.data(), n * kClasses));
  store.wait_until_indexed();  // indexes build in the background; time the queries against the built one
  return store;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = softkv::fashion_mnist::kDefaultDir;
  std::size_t pruned_queries = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--data") == 0) dir = argv[i + 1];
    else if (std::strcmp(argv[i], "--pruned-queries") == 0) pruned_queries = std::stoul(argv[i + 1]);
  }
  Split train, test;
  try {
    train = load(dir, "train", 60000);
    test = load(dir, "t10k", 10000);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\nInstall the data set with: sudo apt-get install dataset-fashion-mnist\n"
                         "(or pass --data DIR holding the four *-idx?-ubyte.gz files)\n", e.what());
    return 1;
  }
  pruned_queries = std::min(pruned_queries, test.size());
  std::printf("Fashion-MNIST: %zu training and %zu test images of %zu pixels, %zu classes; kernel path %s\n\n", train.size(),
              test.size(), kPixels, kClasses, std::string(softkv::simd_path()).c_str());

  // 1. Choose the scale on a validation split: the last 5,000 training images query the first 55,000.
  const std::size_t fit = 55000, validation = train.size() - fit;
  const softkv::Collection fit_store = make_store(train, fit, softkv::IndexKind::exact);
  float best_scale = 0;
  double best_accuracy = -1;
  std::printf("scale (beta) chosen on %zu validation images (never the test set):\n", validation);
  for (const float scale : {10.0f, 40.0f, 160.0f, 320.0f, 640.0f, 1280.0f, 2560.0f}) {
    const double acc = soft_accuracy(fit_store, train, fit, validation, scale);
    std::printf("  beta %6.0f: validation accuracy %.2f%%\n", scale, 100 * acc);
    if (acc > best_accuracy) best_accuracy = acc, best_scale = scale;
  }
  std::printf("  -> beta = %.0f\n\n", best_scale);

  // 2. The full training set, each method on the test set.
  std::printf("%-40s %9s %13s %11s %11s\n", "method", "accuracy", "ms per query", "mean tail", "true tail");
  const softkv::Collection exact = make_store(train, train.size(), softkv::IndexKind::exact);
  const std::span<const float> all_tests(test.images.data(), test.size() * kPixels);
  auto t0 = Clock::now();
  const softkv::HardBatchResult hard = exact.query_hard_batch(all_tests);
  const double t_hard = seconds_since(t0);
  std::size_t right = 0;
  for (std::size_t i = 0; i < test.size(); ++i) right += train.labels[hard.ids[i]] == test.labels[i];
  const double hard_acc = static_cast<double>(right) / static_cast<double>(test.size());
  std::printf("-- all %zu test images, batched --\n", test.size());
  std::printf("%-40s %8.2f%% %13.3f\n", "hard, 1-nearest neighbour", 100 * hard_acc, 1e3 * t_hard / test.size());
  t0 = Clock::now();
  const double soft_acc = soft_accuracy(exact, test, 0, test.size(), best_scale);
  const double t_soft = seconds_since(t0);
  std::printf("%-40s %8.2f%% %13.3f\n", "exact soft", 100 * soft_acc, 1e3 * t_soft / test.size());
  // Compact storage (docs/PRECISION.md, "Compact storage"): the same batched query over keys stored in fewer
  // bytes (the one-hot values are exact at any precision).
  const struct { const char* label; softkv::Precision keys; } compact[] = {
      {"exact soft, f16 keys, f16 values", softkv::Precision::f16}, {"exact soft, bf16 keys, f16 values", softkv::Precision::bf16},
      {"exact soft, i8 keys, f16 values", softkv::Precision::i8}};
  for (const auto& c : compact) {
    const softkv::Collection small = make_store(train, train.size(), softkv::IndexKind::exact, c.keys, softkv::Precision::f16);
    t0 = Clock::now();
    const double acc = soft_accuracy(small, test, 0, test.size(), best_scale);
    std::printf("%-40s %8.2f%% %13.3f\n", c.label, 100 * acc, 1e3 * seconds_since(t0) / test.size());
  }

  // Single queries, as a server would see them: exact soft, then each pruning index at k = 32. The
  // true omitted mass 1 - exp(lse_k - lse_all) is measured against the exact scan.
  const std::size_t nq = pruned_queries;
  struct Row { double accuracy, ms; };
  auto single = [&](const std::string& name, const softkv::Collection& store, const softkv::QueryOptions& options) {
    std::size_t ok = 0;
    double ms = 0, tail = 0, true_tail = 0;
    for (std::size_t i = 0; i < nq; ++i) {
      const std::span<const float> q(test.images.data() + i * kPixels, kPixels);
      const auto start = Clock::now();
      const softkv::SoftResult r = store.query_soft(q, options);
      ms += 1e3 * seconds_since(start);
      ok += argmax(r.value.data()) == test.labels[i];
      tail += r.tail_bound;
      if (options.top_k) true_tail += 1.0 - std::exp(r.lse - exact.query_soft(q, {.scale = best_scale}).lse);
    }
    const Row row{static_cast<double>(ok) / static_cast<double>(nq), ms / static_cast<double>(nq)};
    if (options.top_k)
      std::printf("%-40s %8.2f%% %13.3f %11.3f %11.3f\n", name.c_str(), 100 * row.accuracy, row.ms, tail / nq, true_tail / nq);
    else
      std::printf("%-40s %8.2f%% %13.3f\n", name.c_str(), 100 * row.accuracy, row.ms);
    return row;
  };
  std::printf("-- single queries, the first %zu test images --\n", nq);
  const Row exact_single = single("exact soft", exact, {.scale = best_scale});
  Row best_pruned{0, 1e30};
  std::string best_name;
  for (const softkv::IndexKind kind : {softkv::IndexKind::flat, softkv::IndexKind::ivf, softkv::IndexKind::hnsw}) {
    const char* name = kind == softkv::IndexKind::flat ? "flat" : kind == softkv::IndexKind::ivf ? "ivf" : "hnsw";
    t0 = Clock::now();
    const softkv::Collection store = make_store(train, train.size(), kind);
    const double build = seconds_since(t0);
    char label[64];
    std::snprintf(label, sizeof label, "pruned soft, %s, k = 32 (built in %.0f s)", name, build);
    const Row r = single(label, store, {.scale = best_scale, .top_k = 32});
    if (r.ms < best_pruned.ms) best_pruned = r, best_name = name;
  }

  std::printf("\nOn this data soft retrieval beats hard by %.2f points: it votes with every neighbour in proportion\n"
              "to its similarity instead of trusting the single nearest image. The fastest pruned index (%s) answers\n"
              "in %.3f ms instead of %.3f ms (%.1fx) with accuracy %+.2f points from the exact soft scan on the same\n"
              "queries. The tail bound is a worst case -- it assumes every omitted image scores like the 32nd --\n"
              "so with 60,000 images of similar cosine it stays large; the true omitted mass beside it is what\n"
              "pruning actually dropped, and the accuracy shows how little of that mattered for the label.\n",
              100 * (soft_acc - hard_acc), best_name.c_str(), best_pruned.ms, exact_single.ms,
              exact_single.ms / best_pruned.ms, 100 * (best_pruned.accuracy - exact_single.accuracy));
  return 0;
}
