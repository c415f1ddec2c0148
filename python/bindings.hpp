// Shared parts of the Python module's translation units: the Python classes answers are made of,
// collection configurations from keywords, and the collection wrappers Python holds.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "softkv/softkv.hpp"

namespace softkv::python {

namespace py = pybind11;

/// The Python classes answers and errors are made of (softkv._results, softkv._errors), looked up once
/// at import. The references are leaked on purpose: they must outlive every answer, up to interpreter exit.
struct PythonTypes {
  py::handle soft, hard, soft_batch, hard_batch, contributors, make_error;  ///< classes and the error factory
  py::handle index_names[5];  ///< searched_with strings by IndexKind
};
/// The process-wide table, filled by the module's init.
PythonTypes& types();
/// 'exact', 'flat', 'hnsw', 'ivf' or 'automatic'.
py::handle index_name(IndexKind kind);

/// v as a size; Error(invalid_argument) naming the field when it is negative.
std::size_t non_negative(long long v, const char* field);
/// A Python float option as the library's float option.
std::optional<float> maybe_float(const std::optional<double>& v);
/// A CollectionConfig from the keyword arguments, checked by check_config.
CollectionConfig make_config(long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                             const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                             long long ivf_train_size, long long auto_threshold, double rebuild_fraction,
                             const std::string& key_precision = "f32", const std::string& value_precision = "f32",
                             long long heads = 1);
/// The name of a Precision ("f32", "f16", "bf16", "i8").
const char* precision_name(Precision p);
/// A configuration as the dict Python sees.
py::dict config_dict(const CollectionConfig& c);

/// The keyword arguments of every config-taking call, in make_config's order.
#define SOFTKV_CONFIG_ARGS                                                                                         \
  py::arg("dim"), py::arg("value_dim"), py::kw_only(), py::arg("metric") = "dot", py::arg("scale") = py::none(),  \
      py::arg("index") = "exact", py::arg("hnsw_m") = 32, py::arg("hnsw_ef_construction") = 80,                   \
      py::arg("ivf_nlist") = 0, py::arg("ivf_train_size") = 0, py::arg("auto_threshold") = 10000,                 \
      py::arg("rebuild_fraction") = 0.25, py::arg("key_precision") = "f32", py::arg("value_precision") = "f32",  \
      py::arg("heads") = 1


/// A collection as Python sees it: queries on a shared, read-only collection. Database.collection()
/// returns this (writes go through the Database, which logs them); Collection adds the writes.
class CollectionView {
 public:
  explicit CollectionView(std::shared_ptr<const Collection> c) : collection_(std::move(c)) {}
  [[nodiscard]] const Collection& get() const { return *collection_; }
  [[nodiscard]] std::size_t dim() const { return collection_->config().dim; }
  [[nodiscard]] std::size_t value_dim() const { return collection_->config().value_dim; }

 private:
  std::shared_ptr<const Collection> collection_;
};

/// A collection Python owns and writes directly (no log): softkv::Collection itself.
class OwnedCollection : public CollectionView {
 public:
  explicit OwnedCollection(std::shared_ptr<Collection> c) : CollectionView(c), writable_(std::move(c)) {}
  [[nodiscard]] Collection& write() const { return *writable_; }

 private:
  std::shared_ptr<Collection> writable_;
};

/// Binds CollectionView and Collection.
void bind_collections(py::module_& m);
/// Binds Database.
void bind_database(py::module_& m);

}  // namespace softkv::python
