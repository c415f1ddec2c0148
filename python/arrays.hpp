// numpy <-> softkv for the Python module: input arrays as float32/uint64 spans (no copy when they
// already are C-contiguous float32/uint64), answers as numpy arrays that own their buffers.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace softkv::python {

namespace py = pybind11;

/// Counts of what the input conversion did, for the zero-copy tests (softkv._softkv._input_stats()).
struct InputStats {
  std::atomic<std::uint64_t> conversions{0};   ///< inputs that had to be copied (dtype, order or not an array)
  std::atomic<std::uintptr_t> last_address{0}; ///< address of the last float buffer handed to the library
};
/// The process-wide counters (updated with relaxed atomics: one store each per input).
InputStats& input_stats();

/// A float32 C-contiguous array holding an input while the library reads it (with the GIL released).
struct FloatInput {
  py::array_t<float> array;  ///< the caller's own array when it already fit, else the one converted copy
  std::size_t rows = 0;      ///< rows of a 2-D input; 1 for a 1-D input
  /// The floats, row-major.
  [[nodiscard]] std::span<const float> span() const { return {array.data(), static_cast<std::size_t>(array.size())}; }
};

/// Checks a vector (ndim 1, shape (cols,)) or a row-major matrix (ndim 2, shape (n, cols)) of real
/// numbers and returns it as float32 C-contiguous, copying only when the input is not already that.
/// Throws Error(dimension_mismatch) for another ndim or width, Error(invalid_argument) for a dtype that
/// is not real numbers (complex, object, strings).
FloatInput float_input(py::handle obj, int ndim, std::size_t cols, const char* what);

/// ids as a uint64 C-contiguous 1-D array (a copy unless it already is one); Error(invalid_argument)
/// for non-integer dtypes and negative values, Error(dimension_mismatch) for another ndim.
py::array_t<std::uint64_t> id_input(py::handle obj, const char* what);

/// One id or tag (what names it in errors) from a Python int or numpy integer; Error(invalid_argument) outside [0, 2^64 - 1].
std::uint64_t id_value(py::handle obj, const char* what);
/// Tags or ids as u64s from None (empty), a numpy integer array, or a sequence of Python ints (ints
/// up to 2^64 - 1, which numpy would turn into float64).
std::vector<std::uint64_t> u64_values(py::handle obj, const char* what);

/// Moves a vector into a numpy array of the given shape; the array owns the buffer (no copy).
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(std::move(shape), owned->data(), owner);
}

/// A 1-D numpy array of a vector's elements.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& values) {
  const auto n = static_cast<py::ssize_t>(values.size());
  return to_numpy(std::move(values), {n});
}

}  // namespace softkv::python
