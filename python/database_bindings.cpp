// Python binding of Database: every call releases the GIL (writes fsync, snapshots write files), and the
// optional log callable is called with the GIL taken, possibly from a background thread.
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstdio>
#include <filesystem>
#include <string_view>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"

namespace softkv::python {
namespace {

// Tags given as None (all 0) or a (n,) integer sequence.
std::vector<std::uint64_t> tag_list(py::handle tags) { return u64_values(tags, "tags"); }

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
  PyDatabase(const std::filesystem::path& path, DatabaseOptions options) {
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
  d["key_precision"] = precision_name(s.key_precision);
  d["heads"] = s.heads;
  d["value_precision"] = precision_name(s.value_precision);
  return d;
}

FsyncPolicy fsync_from(const std::string& name) {
  if (name == "always") return FsyncPolicy::always;
  if (name == "everysec") return FsyncPolicy::everysec;
  if (name == "never") return FsyncPolicy::never;
  throw Error(ErrorCode::invalid_argument, "fsync must be 'always', 'everysec' or 'never', got '" + name + "'");
}

}  // namespace

void bind_database(py::module_& m) {
  py::class_<PyDatabase>(m, "Database",
      "Named collections in a data directory, kept by a write-ahead log and snapshots. Writes are logged (and fsynced "
      "with fsync='always') before they return; queries go to db.collection(name). One process at a time may open a "
      "directory. Use it as a context manager, or call close().")
      .def(py::init([](const std::filesystem::path& path, const std::string& fsync, long long snapshot_after_bytes, bool repair,
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
                                   long long ivf_train_size, long long auto_threshold, double rebuild_fraction,
                                   const std::string& key_precision, const std::string& value_precision, long long heads) {
             const CollectionConfig c = make_config(dim, value_dim, metric, scale, index, hnsw_m, hnsw_ef_construction,
                                                    ivf_nlist, ivf_train_size, auto_threshold, rebuild_fraction,
                                                    key_precision, value_precision, heads);
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
      .def("add", [](PyDatabase& db, const std::string& name, py::handle keys, py::handle values, py::handle tags) {
             const auto c = db.call([&](Database& d) { return d.collection(name); });
             const FloatInput k = float_input(keys, 2, c->config().dim, "keys");
             const FloatInput v = float_input(values, 2, c->config().value_dim, "values");
             const std::vector<std::uint64_t> t = tag_list(tags);
             return to_numpy(db.call([&](Database& d) { return d.add(name, k.span(), v.span(), t); }));
           }, py::arg("name"), py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("tags") = py::none(),
           "Adds (n, d) keys, (n, dv) values and (n,) tags (None: all 0); returns their new ids (uint64) once logged "
           "(durable with fsync='always').")
      .def("upsert", [](PyDatabase& db, const std::string& name, py::handle ids, py::handle keys, py::handle values, py::handle tags) {
             const auto c = db.call([&](Database& d) { return d.collection(name); });
             const auto i = id_input(ids, "ids");
             const FloatInput k = float_input(keys, 2, c->config().dim, "keys");
             const FloatInput v = float_input(values, 2, c->config().value_dim, "values");
             const std::vector<std::uint64_t> t = tag_list(tags);
             db.call([&](Database& d) { d.upsert(name, {i.data(), static_cast<std::size_t>(i.size())}, k.span(), v.span(), t); return 0; });
           }, py::arg("name"), py::arg("ids"), py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("tags") = py::none(),
           "Inserts or replaces n entries by id, with (n,) tags (None: all 0).")
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

}

}  // namespace softkv::python
