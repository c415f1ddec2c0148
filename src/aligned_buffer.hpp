// A growable float array aligned to cache lines, the storage of keys and values.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace softkv::detail {

/// Minimal allocator returning 64-byte aligned memory (whole cache lines, any SIMD width).
template <class T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheAlignedAllocator() = default;
  template <class U>
  constexpr CacheAlignedAllocator(const CacheAlignedAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlignment); }

  template <class U>
  bool operator==(const CacheAlignedAllocator<U>&) const noexcept {
    return true;
  }
};

/// Row-major float storage.
using FloatBuffer = std::vector<float, CacheAlignedAllocator<float>>;

}  // namespace softkv::detail
