// softkv's native Python module (_softkv, re-exported by the softkv package): Collection, CollectionView
// and Database over numpy arrays. Every call that scans, writes or waits releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "softkv/softkv.hpp"

namespace softkv::python {
namespace {

// The Python classes answers and errors are made of (softkv._results, softkv._errors), looked up once.
// The references are leaked on purpose: they must outlive every answer, up to interpreter exit.
struct PythonTypes {
  py::handle soft, hard, soft_batch, hard_batch, contributors, make_error;
  py::handle index_names[5];  // searched_with strings by IndexKind
};
PythonTypes& types() {
  static PythonTypes t;
  return t;
}

py::handle index_name(IndexKind kind) {
  const auto i = static_cast<std::size_t>(kind);
  return i < 5 ? types().index_names[i] : types().index_names[0];
}

// ---- options and configurations: Python keywords -> softkv structs ----

std::size_t non_negative(long long v, const char* field) {
  if (v < 0) throw Error(ErrorCode::invalid_argument, std::string(field) + " must be >= 0, got " + std::to_string(v));
  return static_cast<std::size_t>(v);
}

std::optional<float> maybe_float(const std::optional<double>& v) {
  return v ? std::optional<float>(static_cast<float>(*v)) : std::nullopt;
}

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

CollectionConfig make_config(long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                             const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                             long long ivf_train_size, long long auto_threshold, double rebuild_fraction) {
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
  check_config(c);
  return c;
}

// The keyword arguments of every config-taking call, in make_config's order.
#define SOFTKV_CONFIG_ARGS                                                                                         \
  py::arg("dim"), py::arg("value_dim"), py::kw_only(), py::arg("metric") = "dot", py::arg("scale") = py::none(),  \
      py::arg("index") = "exact", py::arg("hnsw_m") = 32, py::arg("hnsw_ef_construction") = 80,                   \
      py::arg("ivf_nlist") = 0, py::arg("ivf_train_size") = 0, py::arg("auto_threshold") = 10000,                 \
      py::arg("rebuild_fraction") = 0.25

py::dict config_dict(const CollectionConfig& c) {
  py::dict d;
  d["dim"] = c.dim;
  d["value_dim"] = c.value_dim;
  d["metric"] = c.metric == Metric::cosine ? "cosine" : "dot";
  d["scale"] = c.scale ? py::object(py::float_(*c.scale)) : py::object(py::none());
  d["index"] = index_name(c.index.kind);
  d["hnsw_m"] = c.index.hnsw_m;
  d["hnsw_ef_construction"] = c.index.hnsw_ef_construction;
  d["ivf_nlist"] = c.index.ivf_nlist;
  d["ivf_train_size"] = c.index.ivf_train_size;
  d["auto_threshold"] = c.index.auto_threshold;
  d["rebuild_fraction"] = c.index.rebuild_fraction;
  return d;
}

QueryOptions make_options(std::optional<double> temperature, std::optional<double> scale, long long top_m, long long threads,
                          std::optional<long long> top_k, std::optional<double> epsilon, long long ef_search,
                          long long nprobe, bool exact) {
  QueryOptions o;
  o.temperature = maybe_float(temperature);
  o.scale = maybe_float(scale);
  o.top_m = non_negative(top_m, "top_m");
  o.threads = non_negative(threads, "threads");
  if (top_k) o.top_k = non_negative(*top_k, "top_k");
  o.epsilon = maybe_float(epsilon);
  o.ef_search = non_negative(ef_search, "ef_search");
  o.nprobe = non_negative(nprobe, "nprobe");
  o.exact = exact;
  return o;
}

// ---- answers: softkv structs -> the Python result classes ----

py::object contributors(const std::vector<Contributor>& top) {
  if (top.empty()) return types().contributors();
  std::vector<std::uint64_t> ids(top.size());
  std::vector<float> weights(top.size()), scores(top.size());
  for (std::size_t i = 0; i < top.size(); ++i) {
    ids[i] = top[i].id;
    weights[i] = top[i].weight;
    scores[i] = top[i].score;
  }
  return types().contributors(to_numpy(std::move(ids)), to_numpy(std::move(weights)), to_numpy(std::move(scores)));
}

py::object soft_answer(SoftResult&& r) {
  return types().soft(to_numpy(std::move(r.value)), r.lse, r.max_score, r.candidates, r.tail_bound, r.tail_bound_guaranteed,
                      index_name(r.searched_with), contributors(r.top));
}

py::object hard_answer(HardResult&& r) {
  return types().hard(r.id, r.score, to_numpy(std::move(r.value)), index_name(r.searched_with));
}

py::array_t<bool> all_true(std::size_t n) {
  py::array_t<bool> a(static_cast<py::ssize_t>(n));
  std::fill_n(a.mutable_data(), n, true);
  return a;
}

// ---- the query side, shared by Collection and CollectionView ----

// A collection as Python sees it: queries on a shared, read-only collection. Database.collection()
// returns this (writes go through the Database, which logs them); Collection adds the writes.
class CollectionView {
 public:
  explicit CollectionView(std::shared_ptr<const Collection> c) : collection_(std::move(c)) {}
  [[nodiscard]] const Collection& get() const { return *collection_; }
  [[nodiscard]] std::size_t dim() const { return collection_->config().dim; }
  [[nodiscard]] std::size_t value_dim() const { return collection_->config().value_dim; }

 private:
  std::shared_ptr<const Collection> collection_;
};

// A collection Python owns and writes directly (no log): softkv::Collection itself.
class OwnedCollection : public CollectionView {
 public:
  explicit OwnedCollection(std::shared_ptr<Collection> c) : CollectionView(c), writable_(std::move(c)) {}
  [[nodiscard]] Collection& write() const { return *writable_; }

 private:
  std::shared_ptr<Collection> writable_;
};

py::object query_soft(const CollectionView& self, py::handle query, const QueryOptions& o) {
  const FloatInput q = float_input(query, 1, self.dim(), "query");
  SoftResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().query_soft(q.span(), o);
  }
  return soft_answer(std::move(r));
}

py::object query_hard(const CollectionView& self, py::handle query, const QueryOptions& o) {
  const FloatInput q = float_input(query, 1, self.dim(), "query");
  HardResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().query_hard(q.span(), o);
  }
  return hard_answer(std::move(r));
}

// (B, d) queries with B >= 1 (the library's rule, checked here because some batches go row by row).
FloatInput batch_input(py::handle queries, std::size_t d) {
  FloatInput q = float_input(queries, 2, d, "queries");
  if (q.rows == 0) throw Error(ErrorCode::dimension_mismatch, "queries has shape (0, " + std::to_string(d) + "): give at least one row");
  return q;
}

// Until Collection has one batch-first entry point, a batch routes as softkv-server does: the batched
// kernel when it answers everything asked, else one query_soft per row (contributors, pruning).
py::object query_soft_batch(const CollectionView& self, py::handle queries, const QueryOptions& o) {
  const FloatInput q = batch_input(queries, self.dim());
  const std::size_t nq = q.rows, d = self.dim(), dv = self.value_dim();
  std::vector<SoftResult> rows;
  SoftBatchResult batch;
  std::size_t size = 0;
  const bool per_row = o.top_m > 0 || o.top_k || o.epsilon;
  {
    py::gil_scoped_release nogil;
    if (per_row) {
      rows.reserve(nq);
      for (std::size_t i = 0; i < nq; ++i) rows.push_back(self.get().query_soft(q.span().subspan(i * d, d), o));
    } else {
      batch = self.get().query_soft_batch(q.span(), o);
      size = self.get().size();
    }
  }
  if (!per_row) {
    py::tuple searched(nq), top(nq);
    for (std::size_t i = 0; i < nq; ++i) {
      searched[i] = index_name(IndexKind::exact);
      top[i] = types().contributors();
    }
    return types().soft_batch(to_numpy(std::move(batch.values), {static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(dv)}),
                              to_numpy(std::move(batch.lse)), to_numpy(std::move(batch.max_score)),
                              to_numpy(std::vector<std::uint64_t>(nq, size)), to_numpy(std::vector<double>(nq, 0.0)),
                              all_true(nq), std::move(searched), std::move(top));
  }
  std::vector<float> values(nq * dv), max_score(nq);
  std::vector<double> lse(nq), tail(nq);
  std::vector<std::uint64_t> candidates(nq);
  py::array_t<bool> guaranteed(static_cast<py::ssize_t>(nq));
  py::tuple searched(nq), top(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    std::copy(rows[i].value.begin(), rows[i].value.end(), values.begin() + static_cast<std::ptrdiff_t>(i * dv));
    lse[i] = rows[i].lse;
    max_score[i] = rows[i].max_score;
    candidates[i] = rows[i].candidates;
    tail[i] = rows[i].tail_bound;
    guaranteed.mutable_at(i) = rows[i].tail_bound_guaranteed;
    searched[i] = index_name(rows[i].searched_with);
    top[i] = contributors(rows[i].top);
  }
  return types().soft_batch(to_numpy(std::move(values), {static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(dv)}),
                            to_numpy(std::move(lse)), to_numpy(std::move(max_score)), to_numpy(std::move(candidates)),
                            to_numpy(std::move(tail)), std::move(guaranteed), std::move(searched), std::move(top));
}

// Hard batches take the batched scan unless an approximate index answers single queries (as the server).
py::object query_hard_batch(const CollectionView& self, py::handle queries, const QueryOptions& o) {
  const FloatInput q = batch_input(queries, self.dim());
  const std::size_t nq = q.rows, d = self.dim(), dv = self.value_dim();
  const IndexKind kind = self.get().config().index.kind;
  const bool per_row = !o.exact && (kind == IndexKind::hnsw || kind == IndexKind::ivf || kind == IndexKind::automatic);
  HardBatchResult batch;
  std::vector<IndexKind> searched_with(nq, IndexKind::exact);
  {
    py::gil_scoped_release nogil;
    if (per_row) {
      batch.ids.resize(nq);
      batch.scores.resize(nq);
      batch.values.resize(nq * dv);
      for (std::size_t i = 0; i < nq; ++i) {
        HardResult r = self.get().query_hard(q.span().subspan(i * d, d), o);
        batch.ids[i] = r.id;
        batch.scores[i] = r.score;
        std::copy(r.value.begin(), r.value.end(), batch.values.begin() + static_cast<std::ptrdiff_t>(i * dv));
        searched_with[i] = r.searched_with;
      }
    } else {
      batch = self.get().query_hard_batch(q.span(), o);
    }
  }
  py::tuple searched(nq);
  for (std::size_t i = 0; i < nq; ++i) searched[i] = index_name(searched_with[i]);
  return types().hard_batch(to_numpy(std::move(batch.ids)), to_numpy(std::move(batch.scores)),
                            to_numpy(std::move(batch.values), {static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(dv)}),
                            std::move(searched));
}

// Binds a query method with the options as keyword-only arguments (the same set on every query).
template <class Class, class Query>
void def_query(Class& cls, const char* name, Query query, const char* input, const char* doc) {
  cls.def(
      name,
      [query](const CollectionView& self, py::handle q, std::optional<double> temperature, std::optional<double> scale,
              long long top_m, long long threads, std::optional<long long> top_k, std::optional<double> epsilon,
              long long ef_search, long long nprobe, bool exact) {
        return query(self, q, make_options(temperature, scale, top_m, threads, top_k, epsilon, ef_search, nprobe, exact));
      },
      py::arg(input), py::kw_only(), py::arg("temperature") = py::none(), py::arg("scale") = py::none(), py::arg("top_m") = 0,
      py::arg("threads") = 0, py::arg("top_k") = py::none(), py::arg("epsilon") = py::none(), py::arg("ef_search") = 64,
      py::arg("nprobe") = 16, py::arg("exact") = false, doc);
}

template <class Class>
void def_queries(Class& cls) {
  def_query(cls, "query_soft", query_soft, "query",
            "query_soft(query, *, temperature=None, scale=None, top_m=0, threads=0, top_k=None, epsilon=None, ef_search=64, "
            "nprobe=16, exact=False) -> SoftResult\n\nSoft retrieval for one (d,) query: softmax(s) . V over every entry, or "
            "over the top_k (or epsilon-adaptive) candidates of the pruning index. scale = 1 / (sqrt(d) * temperature), or "
            "give scale (Hopfield's beta); unset: the collection's default. The GIL is released while it runs.");
  def_query(cls, "query_hard", query_hard, "query",
            "query_hard(query, *, ...) -> HardResult\n\nHard retrieval for one (d,) query: the value of argmax s_i "
            "(ties: smallest id). With an hnsw/ivf index the index's top-1 is taken unless exact=True.");
  def_query(cls, "query_soft_batch", query_soft_batch, "queries",
            "query_soft_batch(queries, *, ...) -> SoftBatchResult\n\nSoft retrieval for (B, d) queries. Without top_m, "
            "top_k or epsilon the entries are read once for all B; with them each row is queried as query_soft would.");
  def_query(cls, "query_hard_batch", query_hard_batch, "queries",
            "query_hard_batch(queries, *, ...) -> HardBatchResult\n\nHard retrieval for (B, d) queries; the keys are read "
            "once for all B (one by one through an hnsw/ivf/automatic index unless exact=True).");
}

// ---- Database: the durable side; every call releases the GIL (writes fsync, snapshots write files) ----

// A Python callable receiving the database's log lines, possibly from a background thread.
struct LogSink {
  py::object fn;
  ~LogSink() {
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
  void operator()(std::string_view line) const {
    if (_Py_IsFinalizing()) {  // no Python left to call: keep the line on standard error
      std::fprintf(stderr, "softkv: %.*s\n", static_cast<int>(line.size()), line.data());
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      fn(py::str(line.data(), line.size()));
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("softkv.Database log callback");
    }
  }
};

class PyDatabase {
 public:
  PyDatabase(const std::string& path, DatabaseOptions options) {
    py::gil_scoped_release nogil;
    db_ = std::make_shared<Database>(path, std::move(options));
  }
  ~PyDatabase() { close(); }

  // Runs f(db) with the GIL released; the reference taken here may be the last after close().
  template <class F>
  auto call(F&& f) {
    std::shared_ptr<Database> held = open();
    py::gil_scoped_release nogil;
    const std::shared_ptr<Database> db = std::move(held);  // dropped before the GIL is taken back
    return f(*db);
  }

  std::shared_ptr<Database> open() const {
    if (!db_) throw Error(ErrorCode::invalid_argument, "the database is closed");
    return db_;
  }

  void close() {
    std::shared_ptr<Database> db = std::move(db_);
    py::gil_scoped_release nogil;  // stopping background work may wait for a log line that needs the GIL
    db.reset();
  }

 private:
  std::shared_ptr<Database> db_;
};

py::dict stats_dict(const CollectionStats& s) {
  py::dict d;
  d["name"] = s.name;
  d["size"] = s.size;
  d["dim"] = s.dim;
  d["value_dim"] = s.value_dim;
  d["metric"] = s.metric == Metric::cosine ? "cosine" : "dot";
  d["index"] = index_name(s.index);
  d["bytes_in_memory"] = s.bytes_in_memory;
  d["bytes_on_disk"] = s.bytes_on_disk;
  return d;
}

FsyncPolicy fsync_from(const std::string& name) {
  if (name == "always") return FsyncPolicy::always;
  if (name == "everysec") return FsyncPolicy::everysec;
  if (name == "never") return FsyncPolicy::never;
  throw Error(ErrorCode::invalid_argument, "fsync must be 'always', 'everysec' or 'never', got '" + name + "'");
}

std::string error_message(const Error& e) {
  const std::string what = e.what(), prefix = std::string(to_string(e.code())) + ": ";
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
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

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      const py::object err = types().make_error(static_cast<int>(e.code()), error_message(e));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  auto view = py::class_<CollectionView>(m, "CollectionView",
      "A collection's query side, shared with a Database (Database.collection(name)): soft and hard queries over "
      "numpy arrays. Writes go through the Database, which logs them. Safe to query from many threads at once.");
  view.def_property_readonly("config", [](const CollectionView& c) { return config_dict(c.get().config()); },
                             "The configuration as a dict (dim, value_dim, metric, scale, index and its parameters).")
      .def_property_readonly("dim", &CollectionView::dim, "Key (and query) dimension d.")
      .def_property_readonly("value_dim", &CollectionView::value_dim, "Value dimension dv.")
      .def("__len__", [](const CollectionView& c) { py::gil_scoped_release nogil; return c.get().size(); }, "Number of entries.")
      .def("size", [](const CollectionView& c) { py::gil_scoped_release nogil; return c.get().size(); }, "Number of entries.")
      .def("__contains__", [](const CollectionView& c, py::handle id) {
             const std::uint64_t v = id_value(id);
             py::gil_scoped_release nogil;
             return c.get().contains(v);
           }, py::arg("id"), "Whether an entry has this id.")
      .def("get", [](const CollectionView& c, py::handle id) {
             const std::uint64_t v = id_value(id);
             Entry e;
             {
               py::gil_scoped_release nogil;
               e = c.get().get(v);
             }
             return py::make_tuple(to_numpy(std::move(e.key)), to_numpy(std::move(e.value)));
           }, py::arg("id"), "(key, value) of the entry with this id, as float32 arrays (the key as stored: unit length "
                              "under cosine); raises softkv.UnknownId.")
      .def("ids", [](const CollectionView& c) {
             std::vector<std::uint64_t> ids;
             {
               py::gil_scoped_release nogil;
               ids = c.get().ids();
             }
             return to_numpy(std::move(ids));
           }, "All ids as a uint64 array, in storage order (not sorted).")
      .def_property_readonly("next_id", [](const CollectionView& c) { py::gil_scoped_release nogil; return c.get().next_id(); },
                             "The id add() assigns next: one above the largest id ever stored.")
      .def("wait_until_indexed", [](const CollectionView& c) { py::gil_scoped_release nogil; c.get().wait_until_indexed(); },
           "Blocks (GIL released) until background index work (IVF training, HNSW/IVF builds) has finished.")
      .def_property_readonly("index_building", [](const CollectionView& c) { return c.get().index_building(); },
                             "Whether background index work is running now.")
      .def("resolve_scale", [](const CollectionView& c, std::optional<double> temperature, std::optional<double> scale) {
             QueryOptions o;
             o.temperature = maybe_float(temperature);
             o.scale = maybe_float(scale);
             return c.get().resolve_scale(o);
           }, py::kw_only(), py::arg("temperature") = py::none(), py::arg("scale") = py::none(),
           "The score scale a query with these options uses; raises softkv.InvalidArgument for a bad T or scale.");
  def_queries(view);

  py::class_<OwnedCollection, CollectionView>(m, "Collection",
      "A set of (id, key, value) float vectors queried by soft (softmax-weighted) or hard (argmax) retrieval, held in "
      "this process (no persistence: see Database). Inputs are numpy arrays: float32 C-contiguous arrays are read "
      "without a copy, anything else real-valued is converted once. Queries may run from many threads at once (the "
      "GIL is released); a write waits for running queries.")
      .def(py::init([](long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                       const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                       long long ivf_train_size, long long auto_threshold, double rebuild_fraction) {
             return OwnedCollection(std::make_shared<Collection>(make_config(dim, value_dim, metric, scale, index, hnsw_m,
                                                                             hnsw_ef_construction, ivf_nlist, ivf_train_size,
                                                                             auto_threshold, rebuild_fraction)));
           }), SOFTKV_CONFIG_ARGS,
           "Collection(dim, value_dim, *, metric='dot', scale=None, index='exact', hnsw_m=32, hnsw_ef_construction=80, "
           "ivf_nlist=0, ivf_train_size=0, auto_threshold=10000, rebuild_fraction=0.25)\n\nAn empty collection; metric "
           "'dot' or 'cosine'; index 'exact', 'flat', 'hnsw', 'ivf' or 'automatic' (pruned queries with top_k/epsilon).")
      .def("add", [](const OwnedCollection& c, py::handle key, py::handle value) {
             const FloatInput k = float_input(key, 1, c.dim(), "key"), v = float_input(value, 1, c.value_dim(), "value");
             py::gil_scoped_release nogil;
             return c.write().add(k.span(), v.span());
           }, py::arg("key"), py::arg("value"), "Adds one entry ((d,) key, (dv,) value) and returns its new id.")
      .def("add_batch", [](const OwnedCollection& c, py::handle keys, py::handle values) {
             const FloatInput k = float_input(keys, 2, c.dim(), "keys"), v = float_input(values, 2, c.value_dim(), "values");
             std::vector<std::uint64_t> ids;
             {
               py::gil_scoped_release nogil;
               ids = c.write().add_batch(k.span(), v.span());
             }
             return to_numpy(std::move(ids));
           }, py::arg("keys"), py::arg("values"), "Adds (n, d) keys and (n, dv) values; returns their new ids (uint64 array).")
      .def("upsert", [](const OwnedCollection& c, py::handle id, py::handle key, py::handle value) {
             const std::uint64_t i = id_value(id);
             const FloatInput k = float_input(key, 1, c.dim(), "key"), v = float_input(value, 1, c.value_dim(), "value");
             py::gil_scoped_release nogil;
             c.write().upsert(i, k.span(), v.span());
           }, py::arg("id"), py::arg("key"), py::arg("value"), "Inserts or replaces the entry with this id (any id but 2^64-1).")
      .def("upsert_batch", [](const OwnedCollection& c, py::handle ids, py::handle keys, py::handle values) {
             const auto i = id_input(ids, "ids");
             const FloatInput k = float_input(keys, 2, c.dim(), "keys"), v = float_input(values, 2, c.value_dim(), "values");
             py::gil_scoped_release nogil;
             c.write().upsert_batch({i.data(), static_cast<std::size_t>(i.size())}, k.span(), v.span());
           }, py::arg("ids"), py::arg("keys"), py::arg("values"), "Inserts or replaces n entries: (n,) ids, (n, d) keys, (n, dv) values.")
      .def("remove", [](const OwnedCollection& c, py::handle id) {
             const std::uint64_t i = id_value(id);
             py::gil_scoped_release nogil;
             c.write().remove(i);
           }, py::arg("id"), "Removes the entry with this id; raises softkv.UnknownId if there is none.")
      .def("remove_batch", [](const OwnedCollection& c, py::handle ids) {
             const auto i = id_input(ids, "ids");
             py::gil_scoped_release nogil;
             c.write().remove_batch({i.data(), static_cast<std::size_t>(i.size())});
           }, py::arg("ids"), "Removes distinct ids, all or nothing (softkv.UnknownId or softkv.InvalidArgument first).");

  py::class_<PyDatabase>(m, "Database",
      "Named collections in a data directory, kept by a write-ahead log and snapshots. Writes are logged (and fsynced "
      "with fsync='always') before they return; queries go to db.collection(name). One process at a time may open a "
      "directory. Use it as a context manager, or call close().")
      .def(py::init([](const std::string& path, const std::string& fsync, long long snapshot_after_bytes, bool repair,
                       py::object log) {
             DatabaseOptions o;
             o.fsync = fsync_from(fsync);
             o.snapshot_after_bytes = non_negative(snapshot_after_bytes, "snapshot_after_bytes");
             o.repair = repair;
             if (!log.is_none()) {
               auto sink = std::make_shared<LogSink>();
               sink->fn = std::move(log);
               o.log = [sink](std::string_view line) { (*sink)(line); };
             }
             return std::make_unique<PyDatabase>(path, std::move(o));
           }), py::arg("path"), py::kw_only(), py::arg("fsync") = "always", py::arg("snapshot_after_bytes") = 64ll << 20,
           py::arg("repair") = false, py::arg("log") = py::none(),
           "Database(path, *, fsync='always', snapshot_after_bytes=64 MiB, repair=False, log=None)\n\nOpens (creating if "
           "needed) the directory and recovers it. fsync: 'always', 'everysec' or 'never'. log: a callable receiving "
           "recovery and snapshot lines (maybe from a background thread); None writes them to standard error.")
      .def("close", &PyDatabase::close, "Stops background work and syncs the log (no snapshot); later calls raise.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyDatabase& db, py::args) { db.close(); })
      .def("create_collection", [](PyDatabase& db, const std::string& name, long long dim, long long value_dim,
                                   const std::string& metric, std::optional<double> scale, const std::string& index,
                                   long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                                   long long ivf_train_size, long long auto_threshold, double rebuild_fraction) {
             const CollectionConfig c = make_config(dim, value_dim, metric, scale, index, hnsw_m, hnsw_ef_construction,
                                                    ivf_nlist, ivf_train_size, auto_threshold, rebuild_fraction);
             db.call([&](Database& d) { d.create_collection(name, c); return 0; });
           }, py::arg("name"), SOFTKV_CONFIG_ARGS,
           "Creates a collection (arguments as Collection's); names are 1-64 characters of [A-Za-z0-9_.-].")
      .def("drop_collection", [](PyDatabase& db, const std::string& name) {
             db.call([&](Database& d) { d.drop_collection(name); return 0; });
           }, py::arg("name"), "Drops a collection and its entries.")
      .def("list_collections", [](PyDatabase& db) { return db.call([](Database& d) { return d.list_collections(); }); },
           "Names of all collections, sorted.")
      .def("has_collection", [](PyDatabase& db, const std::string& name) {
             return db.call([&](Database& d) { return d.has_collection(name); });
           }, py::arg("name"), "Whether a collection has this name.")
      .def("collection", [](PyDatabase& db, const std::string& name) {
             return CollectionView(db.call([&](Database& d) { return d.collection(name); }));
           }, py::arg("name"), "The collection for queries (a CollectionView); it stays valid, no longer updated, if dropped.")
      .def("stats", [](PyDatabase& db, const std::string& name) {
             return stats_dict(db.call([&](Database& d) { return d.stats(name); }));
           }, py::arg("name"), "Size and shape of a collection: the dict softkv.Client.describe returns.")
      .def("add", [](PyDatabase& db, const std::string& name, py::handle keys, py::handle values) {
             const auto c = db.call([&](Database& d) { return d.collection(name); });
             const FloatInput k = float_input(keys, 2, c->config().dim, "keys");
             const FloatInput v = float_input(values, 2, c->config().value_dim, "values");
             return to_numpy(db.call([&](Database& d) { return d.add(name, k.span(), v.span()); }));
           }, py::arg("name"), py::arg("keys"), py::arg("values"),
           "Adds (n, d) keys and (n, dv) values; returns their new ids (uint64) once logged (durable with fsync='always').")
      .def("upsert", [](PyDatabase& db, const std::string& name, py::handle ids, py::handle keys, py::handle values) {
             const auto c = db.call([&](Database& d) { return d.collection(name); });
             const auto i = id_input(ids, "ids");
             const FloatInput k = float_input(keys, 2, c->config().dim, "keys");
             const FloatInput v = float_input(values, 2, c->config().value_dim, "values");
             db.call([&](Database& d) { d.upsert(name, {i.data(), static_cast<std::size_t>(i.size())}, k.span(), v.span()); return 0; });
           }, py::arg("name"), py::arg("ids"), py::arg("keys"), py::arg("values"), "Inserts or replaces n entries by id.")
      .def("remove", [](PyDatabase& db, const std::string& name, py::handle ids) {
             const auto i = id_input(ids, "ids");
             db.call([&](Database& d) { d.remove(name, {i.data(), static_cast<std::size_t>(i.size())}); return 0; });
           }, py::arg("name"), py::arg("ids"), "Removes entries by id; raises softkv.UnknownId (removing nothing) if one is absent.")
      .def("snapshot", [](PyDatabase& db) { db.call([](Database& d) { d.snapshot(); return 0; }); },
           "Writes a snapshot of every collection now (GIL released) and deletes the log it covers.")
      .def("sync", [](PyDatabase& db) { db.call([](Database& d) { d.sync(); return 0; }); },
           "Forces everything logged so far to stable storage.")
      .def_property_readonly("last_sequence", [](PyDatabase& db) { return db.call([](Database& d) { return d.last_sequence(); }); },
                             "Sequence number of the last logged mutation.");

  m.def("check_config", [](long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                           const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                           long long ivf_train_size, long long auto_threshold, double rebuild_fraction) {
          return config_dict(make_config(dim, value_dim, metric, scale, index, hnsw_m, hnsw_ef_construction, ivf_nlist,
                                         ivf_train_size, auto_threshold, rebuild_fraction));
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
