#include <cstdio>
#include <softkv/softkv.hpp>

int main() {
  softkv::Collection memory({.dim = 3, .value_dim = 2});  // keys in R^3, values in R^2
  memory.add(std::vector<float>{1, 0, 0}, std::vector<float>{1, 0});           // id 0
  memory.add(std::vector<float>{0, 1, 0}, std::vector<float>{0, 1});           // id 1
  memory.add(std::vector<float>{0.9f, 0.1f, 0}, std::vector<float>{0.5f, 0.5f});  // id 2

  const std::vector<float> query = {1, 0.2f, 0};
  const auto soft = memory.query_soft(query, {.temperature = 0.5f, .top_m = 1});
  const auto hard = memory.query_hard(query);
  std::printf("soft (%.3f, %.3f): %.0f%% of the weight on id %llu\n", soft.value[0], soft.value[1],
              100 * soft.top[0].weight, static_cast<unsigned long long>(soft.top[0].id));
  std::printf("hard (%.1f, %.1f): id %llu\n", hard.value[0], hard.value[1], static_cast<unsigned long long>(hard.id));
  return hard.id == 0 ? 0 : 1;
}
