// softkv's native Python module (_softkv, re-exported by the softkv package): the Python classes it
// answers with, the error translation (softkv::Error -> softkv.Error subclasses) and module functions.
#include <pybind11/stl.h>

#include <limits>
#include <string>
#include <vector>

#include "error_of.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace softkv::python {

PythonTypes& types() {
  static PythonTypes t;
  return t;
}

py::handle index_name(IndexKind kind) {
  const auto i = static_cast<std::size_t>(kind);
  return i < 5 ? types().index_names[i] : types().index_names[0];
}

std::size_t non_negative(long long v, const char* field) {
  if (v < 0) throw Error(ErrorCode::invalid_argument, std::string(field) + " must be >= 0, got " + std::to_string(v));
  return static_cast<std::size_t>(v);
}

std::optional<float> maybe_float(const std::optional<double>& v) {
  if (!v) return std::nullopt;
  const auto f = static_cast<float>(*v);
  // A negative value too small for a float stays negative (the smallest one), so that the options' checks
  // refuse it as negative instead of taking it as 0 (error_target = -1e-300 would ask for the exact answer).
  if (*v < 0 && f == 0) return -std::numeric_limits<float>::denorm_min();
  return f;
}

namespace {

Metric metric_from(const std::string& name) {
  if (name == "dot") return Metric::dot;
  if (name == "cosine") return Metric::cosine;
  throw Error(ErrorCode::invalid_argument, "metric must be 'dot' or 'cosine', got '" + name + "'");
}

IndexKind index_from(const std::string& name) {
  static const char* const names[] = {"exact", "flat", "hnsw", "ivf", "automatic"};
  for (std::size_t i = 0; i < 5; ++i)
    if (name == names[i]) return static_cast<IndexKind>(i);
  throw Error(ErrorCode::invalid_argument, "index must be one of exact, flat, hnsw, ivf, automatic; got '" + name + "'");
}

Precision precision_from(const std::string& name, const char* field) {
  static const char* const names[] = {"f32", "f16", "bf16", "i8"};
  for (std::size_t i = 0; i < 4; ++i)
    if (name == names[i]) return static_cast<Precision>(i);
  throw Error(ErrorCode::invalid_argument, std::string(field) + " must be one of f32, f16, bf16, i8; got '" + name + "'");
}

}  // namespace

const char* precision_name(Precision p) {
  static const char* const names[] = {"f32", "f16", "bf16", "i8"};
  return static_cast<std::size_t>(p) < 4 ? names[static_cast<std::size_t>(p)] : "unknown";
}

CollectionConfig make_config(long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                             const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                             long long ivf_train_size, long long auto_threshold, double rebuild_fraction,
                             const std::string& key_precision, const std::string& value_precision, long long heads) {
  CollectionConfig c;
  c.dim = non_negative(dim, "dim");
  c.value_dim = non_negative(value_dim, "value_dim");
  c.metric = metric_from(metric);
  c.scale = maybe_float(scale);
  c.index.kind = index_from(index);
  c.index.hnsw_m = non_negative(hnsw_m, "hnsw_m");
  c.index.hnsw_ef_construction = non_negative(hnsw_ef_construction, "hnsw_ef_construction");
  c.index.ivf_nlist = non_negative(ivf_nlist, "ivf_nlist");
  c.index.ivf_train_size = non_negative(ivf_train_size, "ivf_train_size");
  c.index.auto_threshold = non_negative(auto_threshold, "auto_threshold");
  c.index.rebuild_fraction = static_cast<float>(rebuild_fraction);
  c.key_precision = precision_from(key_precision, "key_precision");
  c.value_precision = precision_from(value_precision, "value_precision");
  c.heads = non_negative(heads, "heads");
  check_config(c);
  return c;
}

py::dict config_dict(const CollectionConfig& c) {
  py::dict d;
  d["dim"] = c.dim;
  d["value_dim"] = c.value_dim;
  d["metric"] = c.metric == Metric::cosine ? "cosine" : "dot";
  d["scale"] = c.scale ? py::object(py::float_(*c.scale)) : py::object(py::none());
  d["index"] = index_name(c.index.kind);
  d["heads"] = c.heads;
  d["hnsw_m"] = c.index.hnsw_m;
  d["hnsw_ef_construction"] = c.index.hnsw_ef_construction;
  d["ivf_nlist"] = c.index.ivf_nlist;
  d["ivf_train_size"] = c.index.ivf_train_size;
  d["auto_threshold"] = c.index.auto_threshold;
  d["rebuild_fraction"] = c.index.rebuild_fraction;
  d["key_precision"] = precision_name(c.key_precision);
  d["value_precision"] = precision_name(c.value_precision);
  return d;
}

namespace {

// The message without the "code: " prefix softkv::Error puts before it (Python's exception class names the code).
std::string error_message(const detail::ErrorOf& e) {
  const std::string prefix = std::string(to_string(e.code)) + ": ";
  return e.message.rfind(prefix, 0) == 0 ? e.message.substr(prefix.size()) : e.message;
}

}  // namespace
}  // namespace softkv::python

PYBIND11_MODULE(_softkv, m) {
  using namespace softkv;
  using namespace softkv::python;
  m.doc() = "softkv's native module: use it through the softkv package (import softkv).";

  const py::module_ results = py::module_::import("softkv._results");
  const py::module_ errors = py::module_::import("softkv._errors");
  PythonTypes& t = types();
  t.soft = py::object(results.attr("SoftResult")).release();
  t.hard = py::object(results.attr("HardResult")).release();
  t.soft_batch = py::object(results.attr("SoftBatchResult")).release();
  t.hard_batch = py::object(results.attr("HardBatchResult")).release();
  t.contributors = py::object(results.attr("Contributors")).release();
  t.make_error = py::object(errors.attr("make_error")).release();
  const char* const names[] = {"exact", "flat", "hnsw", "ivf", "automatic"};
  for (std::size_t i = 0; i < 5; ++i) t.index_names[i] = py::str(names[i]).release();

  // The error tiers of softkv-server's replies, from the same mapping (error_of.hpp): an Error keeps its
  // code, a failed allocation is resource_exhausted, any other C++ exception is internal (a bug to
  // report). pybind11's own exceptions (a Python error in flight, a failed argument cast) pass through unchanged.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const py::error_already_set&) {
      throw;
    } catch (const py::builtin_exception&) {
      throw;
    } catch (...) {
      const detail::ErrorOf e = detail::error_of(std::current_exception());
      const py::object err = types().make_error(static_cast<int>(e.code), error_message(e));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  bind_collections(m);
  bind_database(m);

  m.def("check_config", [](long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                           const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                           long long ivf_train_size, long long auto_threshold, double rebuild_fraction,
                           const std::string& key_precision, const std::string& value_precision, long long heads) {
          return config_dict(make_config(dim, value_dim, metric, scale, index, hnsw_m, hnsw_ef_construction, ivf_nlist,
                                         ivf_train_size, auto_threshold, rebuild_fraction, key_precision, value_precision, heads));
        }, SOFTKV_CONFIG_ARGS,
        "Checks a collection configuration against softkv's limits (softkv.InvalidArgument naming the first bad field) "
        "and returns it as a dict.");
  m.def("simd_path", [] { return std::string(simd_path()); },
        "Name of the kernel path in use: 'scalar', 'sse2', 'avx2' or 'avx512'.");
  m.def("available_simd_paths", [] {
          std::vector<std::string> out;
          for (const auto p : available_simd_paths()) out.emplace_back(p);
          return out;
        }, "Every kernel path this CPU can run, from the portable scalar reference to the widest.");
  m.def("force_simd_path", [](const std::string& name) { force_simd_path(name); }, py::arg("name"),
        "Forces a kernel path for the whole process (call it before querying); softkv.Unsupported if the CPU lacks it.");
  m.def("tile_products", [] { return tile_products(); },
        "How batch passes compute their tile products on this CPU (softkv's own tiles or libxsmm's JIT GEMMs, "
        "chosen by measuring both at first use), with the measured rates.");
  m.def("force_tile_products", [](const std::string& name) { force_tile_products(name); }, py::arg("name"),
        "Forces the tile products for the process: 'softkv', 'libxsmm' or 'auto'; softkv.Unsupported otherwise.");
  m.def("_error_names", [] {
          py::dict out;
          for (int code = 1; code < 256; ++code) {
            const std::string_view name = to_string(static_cast<ErrorCode>(code));
            if (name != "unknown_error") out[py::int_(code)] = std::string(name);
          }
          return out;
        }, "Every softkv::ErrorCode of this build and its name (the tests check softkv's classes against it).");
  m.def("_input_stats", [] {
          py::dict out;
          out["conversions"] = input_stats().conversions.load(std::memory_order_relaxed);
          out["last_address"] = input_stats().last_address.load(std::memory_order_relaxed);
          return out;
        }, "How many inputs were converted (copied) so far and the address of the last float buffer passed to softkv.");
  m.attr("__version__") = kVersion;
}
