// Links the installed library and checks one soft and one hard answer; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <softkv/softkv.hpp>

int main() {
  softkv::Collection c({2, 1, softkv::Metric::dot, {}});
  c.add(std::vector<float>{1, 0}, std::vector<float>{10});
  c.add(std::vector<float>{0, 1}, std::vector<float>{20});
  const auto soft = c.query_soft(std::vector<float>{1, 1});  // equal scores: the plain average
  const auto hard = c.query_hard(std::vector<float>{0, 2});
  const bool ok = std::fabs(soft.value[0] - 15.0f) < 1e-5f && hard.id == 1 && hard.value[0] == 20.0f;
  std::printf("softkv %s on %s: soft %.3f, hard id %llu -> %s\n", softkv::kVersion, std::string(softkv::simd_path()).c_str(),
              soft.value[0], static_cast<unsigned long long>(hard.id), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
