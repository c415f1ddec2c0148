// A growable float array aligned to cache lines, the storage of keys and values.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace softkv::detail {

/// Minimal allocator returning 64-byte aligned memory (whole cache lines, any SIMD width); blocks of
/// kHugeFrom bytes or more are aligned to 2 MiB and offered to the kernel for huge pages.
template <class T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  /// Blocks this large or larger are aligned to kHugeAlignment and advised MADV_HUGEPAGE (Linux): a
  /// query that reads scattered rows (a sample's blocks, a list's members) then misses the TLB once per
  /// 2 MiB instead of once per 4 KiB page.
  static constexpr std::size_t kHugeFrom = std::size_t{8} << 20;
  static constexpr std::align_val_t kHugeAlignment{std::size_t{2} << 20};

  CacheAlignedAllocator() = default;
  template <class U>
  constexpr CacheAlignedAllocator(const CacheAlignedAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kHugeFrom) return static_cast<T*>(::operator new(bytes, kAlignment));
    void* p = ::operator new(bytes, kHugeAlignment);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)::madvise(p, bytes, MADV_HUGEPAGE);  // (advice: refused or unsupported, the pages stay small)
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept { ::operator delete(p, n * sizeof(T) < kHugeFrom ? kAlignment : kHugeAlignment); }

  template <class U>
  bool operator==(const CacheAlignedAllocator<U>&) const noexcept {
    return true;
  }
};

/// Row-major float storage.
using FloatBuffer = std::vector<float, CacheAlignedAllocator<float>>;

}  // namespace softkv::detail
