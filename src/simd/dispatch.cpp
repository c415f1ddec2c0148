// Chooses the kernel path once (widest the CPU runs, or SOFTKV_SIMD), and lets tests force another.
#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include <xsimd/xsimd.hpp>

#include "softkv/error.hpp"
#include "softkv/simd.hpp"
#include "kernel_table.hpp"

namespace softkv::detail {
namespace {

// Widest first.
struct PathInfo {
  std::string_view name;
  const KernelTable& (*table)();
  bool (*supported)();
};

// F16C from CPUID leaf 1, ECX bit 29 (clang 14's __builtin_cpu_supports does not know "f16c").
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & (1u << 29)) != 0;
}

const PathInfo kPaths[] = {
    {"avx512", &avx512_kernels, [] { auto a = xsimd::available_architectures(); return a.avx512f && a.avx512dq; }},  // xsimd 8.1 uses DQ in avx512f code
    // F16C widens f16 rows on this path; every AVX2 CPU has it, but it is a separate CPUID bit.
    {"avx2", &avx2_kernels, [] { return xsimd::available_architectures().fma3_avx2 != 0 && has_f16c(); }},
    {"sse2", &sse2_kernels, [] { return xsimd::available_architectures().sse2 != 0; }},
    {"scalar", &scalar_kernels, [] { return true; }},
};

const KernelTable* initial_table() {
  if (const char* forced = std::getenv("SOFTKV_SIMD"); forced != nullptr && *forced != '\0') {
    if (const KernelTable* t = kernels_named(forced)) return t;
    // An impossible request is a configuration error worth failing loudly on, not silently ignoring.
    throw Error(ErrorCode::unsupported,
                "SOFTKV_SIMD=" + std::string(forced) + " is not a kernel path this CPU can run");
  }
  for (const PathInfo& p : kPaths)
    if (p.supported()) return &p.table();
  return &scalar_kernels();
}

std::atomic<const KernelTable*>& active() {
  static std::atomic<const KernelTable*> table{initial_table()};
  return table;
}

}  // namespace

const KernelTable* kernels_named(std::string_view name) {
  for (const PathInfo& p : kPaths)
    if (p.name == name) return p.supported() ? &p.table() : nullptr;
  return nullptr;
}

const KernelTable& kernels() { return *active().load(std::memory_order_acquire); }

const KernelTable& native_kernels() {
  for (const PathInfo& p : kPaths)
    if (p.supported()) return p.table();
  return scalar_kernels();
}

}  // namespace softkv::detail

namespace softkv {

std::string_view simd_path() { return detail::kernels().name; }

std::vector<std::string_view> available_simd_paths() {
  std::vector<std::string_view> names;
  for (auto it = std::rbegin(detail::kPaths); it != std::rend(detail::kPaths); ++it)
    if (it->supported()) names.push_back(it->name);
  return names;
}

void force_simd_path(std::string_view name) {
  const detail::KernelTable* t = detail::kernels_named(name);
  if (t == nullptr)
    throw Error(ErrorCode::unsupported, "kernel path '" + std::string(name) + "' is unknown or not supported by this CPU");
  detail::active().store(t, std::memory_order_release);
}

}  // namespace softkv
