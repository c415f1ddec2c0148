// The tile products of the batch passes: softkv's own register tiles or libxsmm's JIT GEMMs, chosen by
// measurement on the CPU at hand (tile_gemm.hpp).
#include "simd/tile_gemm.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <vector>

#ifdef SOFTKV_WITH_LIBXSMM
#include <libxsmm.h>
#endif

#include "softkv/error.hpp"
#include "softkv/simd.hpp"

namespace softkv::detail {
namespace {

#ifdef SOFTKV_WITH_LIBXSMM
// One JIT kernel's shape (column-major, as libxsmm states a GEMM: C(m x n) = beta C + A(m x k) op(B)).
struct Shape {
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, flags = 0, beta = 0;
  bool operator==(const Shape&) const = default;
};

// libxsmm's dispatch is a lookup in its own registry (generating the code on the first request of a
// shape); the shapes of one pass repeat block after block, so each thread remembers its last few.
libxsmm_smmfunction kernel_for(const Shape& s) {
  struct Entry {
    Shape shape;
    libxsmm_smmfunction fn = nullptr;
  };
  thread_local std::array<Entry, 8> cache{};
  thread_local std::size_t next = 0;
  for (const Entry& e : cache)
    if (e.fn != nullptr && e.shape == s) return e.fn;
  const float alpha = 1.0f, beta = static_cast<float>(s.beta);
  const libxsmm_smmfunction fn = libxsmm_smmdispatch(s.m, s.n, s.k, &s.lda, &s.ldb, &s.ldc, &alpha, &beta, &s.flags, nullptr);
  if (fn != nullptr) cache[next++ % cache.size()] = {s, fn};
  return fn;
}

bool fits(std::size_t a, std::size_t b, std::size_t c) { return std::max({a, b, c}) <= static_cast<std::size_t>(INT_MAX); }

// scores (row-major rows x lanes) = K (row-major rows x d) . QT (row-major d x lanes): in column-major
// terms S^T (lanes x rows) = QT^T (lanes x d) . K^T (d x rows), every operand in place.
void jit_scores(const float* qt, std::size_t lanes, const float* k, std::size_t rows, std::size_t d, float* s) {
  if (fits(lanes, rows, d)) {
    const int m = static_cast<int>(lanes), n = static_cast<int>(rows), kk = static_cast<int>(d);
    if (const auto fn = kernel_for({m, n, kk, m, kk, m, LIBXSMM_GEMM_FLAG_NONE, 0})) return fn(qt, k, s);
  }
  kernels().tiles.scores(qt, lanes, k, rows, d, s);  // a shape libxsmm does not generate
}

// acc (row-major nq x dv) += W^T V, W row-major rows x lanes, V row-major rows x dv: in column-major
// terms acc^T (dv x nq) += V^T (dv x rows) . op(B), B = W^T stored (nq x rows, ld lanes), op = transpose.
void jit_blend(const float* w, std::size_t lanes, std::size_t nq, const float* v, std::size_t rows, std::size_t dv,
               float* acc) {
  if (fits(dv, lanes, rows)) {
    const int m = static_cast<int>(dv), n = static_cast<int>(nq), kk = static_cast<int>(rows);
    if (const auto fn = kernel_for({m, n, kk, m, static_cast<int>(lanes), m, LIBXSMM_GEMM_FLAG_TRANS_B, 1})) return fn(v, w, acc);
  }
  kernels().tiles.blend(w, lanes, nq, v, rows, dv, acc);
}

void start_libxsmm() {
  static std::once_flag once;
  std::call_once(once, [] { libxsmm_init(); });
}

// Whether libxsmm's code may stand in for path k's own tiles: only where it uses no instruction set
// beyond k's (its target is the CPU's widest unless LIBXSMM_TARGET narrows it), so that a path forced
// for a test or a comparison (SOFTKV_SIMD=sse2, scalar) runs what it names.
bool jit_allowed(const KernelTable& k) {
  start_libxsmm();
  const int target = libxsmm_get_target_archid();
  const int limit = k.name == "avx512" ? LIBXSMM_X86_AVX512_CPX : k.name == "avx2" ? LIBXSMM_X86_AVX2 : 0;
  return target >= LIBXSMM_X86_AVX && target <= limit;
}
#endif

// A choice: per product, whether libxsmm's stands in for the path's own tiles.
struct Choice {
  bool scores = false, blend = false;
  std::string measured;  // the rates behind an automatic choice
};

// The process's choice. The flags are atomic: tiles_for reads them on every batch pass while
// force_tiles may change them; the text and the first decision are under the mutex.
struct Current {
  std::mutex mutex;
  std::atomic<bool> decided{false}, scores{false}, blend{false};
  std::string measured;

  void set(Choice&& c) {  // with the mutex held
    scores.store(c.scores, std::memory_order_relaxed);
    blend.store(c.blend, std::memory_order_relaxed);
    measured = std::move(c.measured);
    decided.store(true, std::memory_order_release);
  }
};

Current& current_state() {
  static Current c;
  return c;
}

// The best of several timings of fn (seconds): the machine is shared, the minimum is the kernel's own speed.
template <class Fn>
double best_seconds(int reps, Fn&& fn) {
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Times both tile products of the active path against libxsmm's on the shape of a full batch block
// (256 rows, 64 lanes, d = dv = 128: what a batch of 64 queries runs block after block, in L2) and
// keeps libxsmm's where it is at least 5% faster: a tie keeps softkv's own.
Choice measure() {
  Choice c;
#ifdef SOFTKV_WITH_LIBXSMM
  if (!jit_allowed(kernels())) return c;
  const TileProducts own = kernels().tiles, jit{&jit_scores, &jit_blend};
  constexpr std::size_t rows = kScanBlockRows, lanes = 64, d = 128, dv = 128;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> qt(d * lanes), k(rows * d), v(rows * dv), s(rows * lanes), w(rows * lanes), acc(lanes * dv, 0.0f);
  for (auto* x : {&qt, &k, &v, &w})
    for (float& f : *x) f = u(gen);
  const int reps = 20;
  const double flops = 2.0 * rows * lanes * d * reps;
  const double own_s = best_seconds(reps, [&] { own.scores(qt.data(), lanes, k.data(), rows, d, s.data()); });
  const double jit_s = best_seconds(reps, [&] { jit.scores(qt.data(), lanes, k.data(), rows, d, s.data()); });
  const double own_b = best_seconds(reps, [&] { own.blend(w.data(), lanes, lanes, v.data(), rows, dv, acc.data()); });
  const double jit_b = best_seconds(reps, [&] { jit.blend(w.data(), lanes, lanes, v.data(), rows, dv, acc.data()); });
  c.scores = jit_s * 1.05 < own_s;
  c.blend = jit_b * 1.05 < own_b;
  char text[200];
  std::snprintf(text, sizeof text, " (measured on one core, GFLOP/s: scores softkv %.0f, libxsmm %.0f; blend softkv %.0f, libxsmm %.0f)",
                flops / own_s / 1e9, flops / jit_s / 1e9, flops / own_b / 1e9, flops / jit_b / 1e9);
  c.measured = text;
#endif
  return c;
}

Choice named(std::string_view name) {
  Choice c;
  if (name == "softkv") return c;
  if (name == "libxsmm") {
    if (!have_libxsmm()) throw Error(ErrorCode::unsupported, "tile products 'libxsmm': this build has no libxsmm");
#ifdef SOFTKV_WITH_LIBXSMM
    start_libxsmm();
#endif
    c.scores = c.blend = true;
    return c;
  }
  if (name == "auto") return measure();
  throw Error(ErrorCode::unsupported, "tile products '" + std::string(name) + "' are not softkv, libxsmm or auto");
}

// The process's choice, decided on first use (SOFTKV_TILES, or a measurement).
Current& current() {
  Current& c = current_state();
  if (!c.decided.load(std::memory_order_acquire)) {
    const std::lock_guard lock(c.mutex);
    if (!c.decided.load(std::memory_order_relaxed)) {
      const char* env = std::getenv("SOFTKV_TILES");
      c.set(named(env != nullptr && *env != '\0' ? std::string_view(env) : std::string_view("auto")));
    }
  }
  return c;
}

}  // namespace

bool have_libxsmm() noexcept {
#ifdef SOFTKV_WITH_LIBXSMM
  return true;
#else
  return false;
#endif
}

TileProducts tiles_for(const KernelTable& k) {
  TileProducts tiles = k.tiles;
#ifdef SOFTKV_WITH_LIBXSMM
  if (!jit_allowed(k)) return tiles;
  const Current& c = current();
  if (c.scores.load(std::memory_order_relaxed)) tiles.scores = &jit_scores;
  if (c.blend.load(std::memory_order_relaxed)) tiles.blend = &jit_blend;
#endif
  return tiles;
}

std::string tiles_report() {
  Current& c = current();
  const std::lock_guard lock(c.mutex);
  return std::string("scores ") + (c.scores ? "libxsmm" : "softkv") + ", blend " + (c.blend ? "libxsmm" : "softkv") + c.measured;
}

void force_tiles(std::string_view name) {
  Choice choice = named(name);  // measuring ("auto") outside the lock
  Current& c = current_state();
  const std::lock_guard lock(c.mutex);
  c.set(std::move(choice));
}

}  // namespace softkv::detail

namespace softkv {

std::string tile_products() { return detail::tiles_report(); }

void force_tile_products(std::string_view name) { detail::force_tiles(name); }

}  // namespace softkv
