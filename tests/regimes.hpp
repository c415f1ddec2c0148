// The data regimes of the pruning bench, small, for tests: keys and queries drawn from a seed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "reference.hpp"

namespace softkv::test {

// The data regimes of the pruning bench, small: keys and queries.
struct Regime {
  std::string name;
  std::vector<float> keys;
  std::vector<float> queries;
};

inline Regime make_regime(int kind, std::size_t n, std::size_t d, std::size_t nq, std::uint64_t seed) {
  Regime r;
  switch (kind) {
    case 0: {  // spread: Gaussian keys and queries
      r.name = "gaussian";
      r.keys = normal_floats(n * d, seed);
      r.queries = normal_floats(nq * d, seed + 1);
      break;
    }
    case 1:
    case 2: {  // clustered keys; queries near keys (1) or out of distribution (2: between two clusters, wide noise)
      r.name = kind == 1 ? "clustered, queries near keys" : "clustered, out-of-distribution queries";
      const std::size_t clusters = std::max<std::size_t>(1, n / 20);
      const auto centres = normal_floats(clusters * d, seed, 3.0f);
      r.keys = normal_floats(n * d, seed + 1, 0.3f);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < d; ++j) r.keys[i * d + j] += centres[(i * 7 % clusters) * d + j];
      const auto noise = normal_floats(nq * d, seed + 2, kind == 1 ? 0.1f : 2.0f);
      r.queries.resize(nq * d);
      for (std::size_t b = 0; b < nq; ++b)
        for (std::size_t j = 0; j < d; ++j) {
          const std::size_t a = (b * 13) % n, c = (b * 29 + 5) % n;
          r.queries[b * d + j] = noise[b * d + j] + (kind == 1 ? r.keys[a * d + j] : 0.5f * (r.keys[a * d + j] + r.keys[c * d + j]));
        }
      break;
    }
    default: {  // heavy-tailed, as transformer keys: a shared offset and a few massive channels
      r.name = "heavy-tailed keys";
      r.keys = normal_floats(n * d, seed);
      for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t j = 0; j < d; ++j) r.keys[i * d + j] += 2.0f;
        for (std::size_t j = 0; j < 3 && j < d; ++j) r.keys[i * d + j] *= 25.0f;
      }
      r.queries = normal_floats(nq * d, seed + 3);
      break;
    }
  }
  return r;
}

}  // namespace softkv::test
