// Input arrays for the Python module: shape and dtype checks, and at most one conversion per input.
#include "arrays.hpp"

#include <string>

#include "softkv/error.hpp"

namespace softkv::python {
namespace {

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Any input as an ndarray of its own dtype: an ndarray is returned as it is, anything else converted.
py::array as_array(py::handle obj, const char* what) {
  py::array any = py::array::ensure(obj);
  if (!any) throw py::error_already_set();
  const char kind = any.dtype().kind();
  if (kind != 'f' && kind != 'i' && kind != 'u' && kind != 'b')
    throw Error(ErrorCode::invalid_argument, std::string(what) + " has dtype " + py::str(any.dtype()).cast<std::string>() +
                                                 "; give real numbers (float32 is used without a copy)");
  return any;
}

}  // namespace

InputStats& input_stats() {
  static InputStats stats;
  return stats;
}

FloatInput float_input(py::handle obj, int ndim, std::size_t cols, const char* what) {
  // The common case first: already float32, C-contiguous, native byte order, of the right shape.
  using CFloat = py::array_t<float, py::array::c_style>;
  if (CFloat::check_(obj)) {
    auto same = py::reinterpret_borrow<py::array_t<float>>(obj);
    if (same.ndim() == ndim && static_cast<std::size_t>(same.shape(ndim - 1)) == cols) {
      FloatInput input;
      input.rows = ndim == 1 ? 1 : static_cast<std::size_t>(same.shape(0));
      input.array = std::move(same);
      input_stats().last_address.store(reinterpret_cast<std::uintptr_t>(input.array.data()), std::memory_order_relaxed);
      return input;
    }
  }
  const py::array any = as_array(obj, what);
  const bool width_ok = any.ndim() == ndim && static_cast<std::size_t>(any.shape(ndim - 1)) == cols;
  if (!width_ok) {
    throw Error(ErrorCode::dimension_mismatch,
                std::string(what) + " has shape " + shape_of(any) + "; expected " +
                    (ndim == 1 ? "(" + std::to_string(cols) + ",)" : "(n, " + std::to_string(cols) + ")"));
  }
  FloatInput input;
  input.array = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(any);
  if (!input.array) throw py::error_already_set();
  input.rows = ndim == 1 ? 1 : static_cast<std::size_t>(any.shape(0));
  InputStats& stats = input_stats();
  if (input.array.ptr() != obj.ptr()) stats.conversions.fetch_add(1, std::memory_order_relaxed);
  stats.last_address.store(reinterpret_cast<std::uintptr_t>(input.array.data()), std::memory_order_relaxed);
  return input;
}

py::array_t<std::uint64_t> id_input(py::handle obj, const char* what) {
  const py::array any = as_array(obj, what);
  const char kind = any.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw Error(ErrorCode::invalid_argument, std::string(what) + " must be integers, not dtype " +
                                                 py::str(any.dtype()).cast<std::string>());
  if (any.ndim() != 1)
    throw Error(ErrorCode::dimension_mismatch, std::string(what) + " has shape " + shape_of(any) + "; expected (n,)");
  if (kind == 'i' && any.size() > 0 && py::module_::import("numpy").attr("any")(any.attr("__lt__")(0)).cast<bool>())
    throw Error(ErrorCode::invalid_argument, std::string(what) + " holds a negative id; ids are in [0, 2^64 - 1)");
  auto ids = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>::ensure(any);
  if (!ids) throw py::error_already_set();
  return ids;
}

std::uint64_t id_value(py::handle obj, const char* what) {
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) {
    PyErr_Clear();
    throw Error(ErrorCode::invalid_argument, std::string(what) + " must be an integer, not " +
                                                 py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
  }
  const unsigned long long id = PyLong_AsUnsignedLongLong(index.ptr());
  if (id == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw Error(ErrorCode::invalid_argument, std::string(what) + " " + py::str(index).cast<std::string>() + " is outside [0, 2^64 - 1]");
  }
  return id;
}

std::vector<std::uint64_t> u64_values(py::handle obj, const char* what) {
  if (obj.is_none()) return {};
  if (py::isinstance<py::array>(obj)) {
    const auto a = id_input(obj, what);
    return {a.data(), a.data() + a.size()};
  }
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj))
    throw Error(ErrorCode::invalid_argument, std::string(what) + " must be a sequence of integers");
  std::vector<std::uint64_t> out;
  const std::string element = std::string(what) + ": element";
  for (py::handle item : py::reinterpret_borrow<py::sequence>(obj)) out.push_back(id_value(item, element.c_str()));
  return out;
}

}  // namespace softkv::python
