// Python bindings of Collection and CollectionView: query options as keywords, answers as the
// softkv result classes, batches routed as softkv-server routes them. The GIL is released around the library.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "arrays.hpp"
#include "bindings.hpp"

namespace softkv::python {
namespace {

// An integer option: any Python integer in [0, 2^64 - 1]; anything else is InvalidArgument naming it
// (pybind11's own conversion to a C++ integer would raise TypeError past 2^63).
std::size_t count_option(py::handle value, const char* what) { return static_cast<std::size_t>(id_value(value, what)); }

QueryOptions make_options(std::optional<double> temperature, std::optional<double> scale, py::handle top_m, py::handle threads,
                          py::handle top_k, std::optional<double> epsilon, py::handle ef_search, py::handle nprobe,
                          py::handle check_sample, bool exact, py::handle iterations, double tolerance,
                          std::optional<double> error_target) {
  QueryOptions o;
  o.error_target = maybe_float(error_target);
  o.iterations = count_option(iterations, "iterations");
  o.tolerance = static_cast<float>(tolerance);
  if (std::isfinite(tolerance) && !std::isfinite(o.tolerance)) o.tolerance = std::numeric_limits<float>::infinity();
  o.temperature = maybe_float(temperature);
  o.scale = maybe_float(scale);
  o.top_m = count_option(top_m, "top_m");
  o.threads = count_option(threads, "threads");
  if (!top_k.is_none()) o.top_k = count_option(top_k, "top_k");
  o.epsilon = maybe_float(epsilon);
  o.ef_search = count_option(ef_search, "ef_search");
  o.nprobe = count_option(nprobe, "nprobe");
  o.check_sample = count_option(check_sample, "check_sample");
  o.exact = exact;
  return o;
}

// ---- masks: tags_any (sequence of tags), tag_range ((lo, hi) inclusive), exclude (sequence of ids) ----
std::vector<std::uint64_t> u64_list(py::handle obj, const char* what) { return u64_values(obj, what); }

void add_mask(QueryOptions& o, py::handle tags_any, py::handle tag_range, py::handle exclude) {
  o.tags_any = u64_list(tags_any, "tags_any");
  o.exclude_ids = u64_list(exclude, "exclude");
  if (tag_range.is_none()) return;
  const auto range = py::reinterpret_borrow<py::sequence>(tag_range);
  if (range.size() != 2) throw Error(ErrorCode::invalid_argument, "tag_range must be a pair (lo, hi)");
  o.tag_range = TagRange{id_value(range[0], "tag_range: lo"), id_value(range[1], "tag_range: hi")};
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

// Per-head arrays of a multi-head answer (empty for h = 1).
void set_heads(py::object& out, const SoftResult& r) {
  std::vector<double> lse;
  std::vector<float> max_score;
  py::tuple top(r.heads.size());
  for (std::size_t j = 0; j < r.heads.size(); ++j) {
    lse.push_back(r.heads[j].lse);
    max_score.push_back(r.heads[j].max_score);
    top[j] = contributors(r.heads[j].top);
  }
  out.attr("head_lse") = to_numpy(std::move(lse));
  out.attr("head_max_score") = to_numpy(std::move(max_score));
  out.attr("head_top") = std::move(top);
  out.attr("iterations_run") = r.iterations_run;
  out.attr("last_change") = r.last_change;
}

py::object soft_answer(SoftResult&& r) {
  py::object out = types().soft(to_numpy(std::move(r.value)), r.lse, r.max_score, r.candidates, r.tail_bound,
                                r.tail_bound_guaranteed, index_name(r.searched_with), contributors(r.top));
  out.attr("mask_filtered_after_search") = r.mask_filtered_after_search;
  out.attr("rows_scored") = r.rows_scored;
  out.attr("error_estimate") = r.error_estimate;
  set_heads(out, r);
  return out;
}

py::object hard_answer(HardResult&& r) {
  return types().hard(r.id, r.score, to_numpy(std::move(r.value)), index_name(r.searched_with), to_numpy(std::move(r.head_ids)),
                      to_numpy(std::move(r.head_scores)));
}

// ---- the query side, shared by Collection and CollectionView: everything goes through Collection::query ----

// Runs n >= 1 queries (the library's one entry point, which picks the fused batch kernels or one query at
// a time) with the GIL released.
QueryResults run_query(const CollectionView& self, const FloatInput& q, Retrieval kind, const QueryOptions& o) {
  py::gil_scoped_release nogil;
  return self.get().query(q.span(), kind, o);
}

py::object query_soft(const CollectionView& self, py::handle query, const QueryOptions& o) {
  QueryResults r = run_query(self, float_input(query, 1, self.dim(), "query"), Retrieval::soft, o);
  return soft_answer(std::move(r.soft.at(0)));
}

py::object query_hard(const CollectionView& self, py::handle query, const QueryOptions& o) {
  QueryResults r = run_query(self, float_input(query, 1, self.dim(), "query"), Retrieval::hard, o);
  return hard_answer(std::move(r.hard.at(0)));
}

// (B, d) queries with B >= 1.
FloatInput batch_input(py::handle queries, std::size_t d) {
  FloatInput q = float_input(queries, 2, d, "queries");
  if (q.rows == 0) throw Error(ErrorCode::dimension_mismatch, "queries has shape (0, " + std::to_string(d) + "): give at least one row");
  return q;
}

py::object query_soft_batch(const CollectionView& self, py::handle queries, const QueryOptions& o) {
  const std::vector<SoftResult> rows = run_query(self, batch_input(queries, self.dim()), Retrieval::soft, o).soft;
  const std::size_t nq = rows.size(), dv = self.value_dim();
  std::vector<float> values(nq * dv), max_score(nq);
  std::vector<double> lse(nq), tail(nq), error_estimate(nq);
  std::vector<std::uint64_t> candidates(nq), rows_scored(nq);
  py::array_t<bool> guaranteed(static_cast<py::ssize_t>(nq)), filtered(static_cast<py::ssize_t>(nq));
  py::tuple searched(nq), top(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    std::copy(rows[i].value.begin(), rows[i].value.end(), values.begin() + static_cast<std::ptrdiff_t>(i * dv));
    lse[i] = rows[i].lse;
    max_score[i] = rows[i].max_score;
    candidates[i] = rows[i].candidates;
    rows_scored[i] = rows[i].rows_scored;
    error_estimate[i] = rows[i].error_estimate;
    tail[i] = rows[i].tail_bound;
    guaranteed.mutable_at(i) = rows[i].tail_bound_guaranteed;
    filtered.mutable_at(i) = rows[i].mask_filtered_after_search;
    searched[i] = index_name(rows[i].searched_with);
    top[i] = contributors(rows[i].top);
  }
  const std::size_t h = nq > 0 ? rows[0].heads.size() : 0;
  std::vector<double> head_lse, last_change;
  std::vector<float> head_max;
  std::vector<std::uint64_t> iterations_run;
  py::tuple head_top(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    py::tuple tops(h);
    for (std::size_t j = 0; j < h; ++j) {
      head_lse.push_back(rows[i].heads[j].lse);
      head_max.push_back(rows[i].heads[j].max_score);
      tops[j] = contributors(rows[i].heads[j].top);
    }
    head_top[i] = std::move(tops);
    iterations_run.push_back(rows[i].iterations_run);
    last_change.push_back(rows[i].last_change);
  }
  const std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(h)};
  return types().soft_batch(to_numpy(std::move(values), {static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(dv)}),
                            to_numpy(std::move(lse)), to_numpy(std::move(max_score)), to_numpy(std::move(candidates)),
                            to_numpy(std::move(tail)), std::move(guaranteed), std::move(searched), std::move(top),
                            to_numpy(std::move(head_lse), shape), to_numpy(std::move(head_max), shape), std::move(head_top),
                            to_numpy(std::move(iterations_run)), to_numpy(std::move(last_change)), std::move(filtered),
                            to_numpy(std::move(rows_scored)), to_numpy(std::move(error_estimate)));
}

py::object query_hard_batch(const CollectionView& self, py::handle queries, const QueryOptions& o) {
  const std::vector<HardResult> rows = run_query(self, batch_input(queries, self.dim()), Retrieval::hard, o).hard;
  const std::size_t nq = rows.size(), dv = self.value_dim();
  std::vector<std::uint64_t> ids(nq);
  std::vector<float> scores(nq), values(nq * dv);
  py::tuple searched(nq);
  for (std::size_t i = 0; i < nq; ++i) {
    ids[i] = rows[i].id;
    scores[i] = rows[i].score;
    std::copy(rows[i].value.begin(), rows[i].value.end(), values.begin() + static_cast<std::ptrdiff_t>(i * dv));
    searched[i] = index_name(rows[i].searched_with);
  }
  const std::size_t h = nq > 0 ? rows[0].head_ids.size() : 0;
  std::vector<std::uint64_t> head_ids;
  std::vector<float> head_scores;
  for (const HardResult& r : rows) {
    head_ids.insert(head_ids.end(), r.head_ids.begin(), r.head_ids.end());
    head_scores.insert(head_scores.end(), r.head_scores.begin(), r.head_scores.end());
  }
  const std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(h)};
  return types().hard_batch(to_numpy(std::move(ids)), to_numpy(std::move(scores)),
                            to_numpy(std::move(values), {static_cast<py::ssize_t>(nq), static_cast<py::ssize_t>(dv)}),
                            std::move(searched), to_numpy(std::move(head_ids), shape), to_numpy(std::move(head_scores), shape));
}

// Binds a query method with the options as keyword-only arguments (the same set on every query).
template <class Class, class Query>
void def_query(Class& cls, const char* name, Query query, const char* input, const char* doc) {
  cls.def(
      name,
      [query](const CollectionView& self, py::handle q, std::optional<double> temperature, std::optional<double> scale,
              py::handle top_m, py::handle threads, py::handle top_k, std::optional<double> epsilon, py::handle ef_search,
              py::handle nprobe, py::handle check_sample, bool exact, py::handle tags_any, py::handle tag_range,
              py::handle exclude, py::handle iterations, double tolerance, std::optional<double> error_target) {
        QueryOptions o = make_options(temperature, scale, top_m, threads, top_k, epsilon, ef_search, nprobe, check_sample, exact,
                                      iterations, tolerance, error_target);
        add_mask(o, tags_any, tag_range, exclude);
        return query(self, q, o);
      },
      py::arg(input), py::kw_only(), py::arg("temperature") = py::none(), py::arg("scale") = py::none(), py::arg("top_m") = 0,
      py::arg("threads") = 0, py::arg("top_k") = py::none(), py::arg("epsilon") = py::none(), py::arg("ef_search") = 64,
      py::arg("nprobe") = 16, py::arg("check_sample") = QueryOptions{}.check_sample, py::arg("exact") = false, py::arg("tags_any") = py::none(),
      py::arg("tag_range") = py::none(), py::arg("exclude") = py::none(), py::arg("iterations") = 1, py::arg("tolerance") = 0.0,
      py::arg("error_target") = py::none(), doc);
}

template <class Class>
void def_queries(Class& cls) {
  def_query(cls, "query_soft", query_soft, "query",
            "query_soft(query, *, temperature=None, scale=None, top_m=0, threads=0, top_k=None, epsilon=None, ef_search=64, "
            "nprobe=16, check_sample=256, exact=False, tags_any=None, tag_range=None, exclude=None, iterations=1, tolerance=0.0) "
            "-> SoftResult\n\nSoft retrieval "
            "for one (d,) query: softmax(s) . V over "
            "every entry, or over the top_k (or epsilon-adaptive) candidates of the pruning index. scale = 1 / (sqrt(d) * "
            "temperature), or give scale (Hopfield's beta); unset: the collection's default. check_sample (hnsw/ivf): rows "
            "sampled outside the candidates to check the tail bound. Masks (all must hold): tags_any (tags), tag_range "
            "(lo, hi) inclusive, exclude (ids); a masked entry is as if absent. Iterative (Hopfield) retrieval: iterations "
            "(1..1000) passes, the blended value becoming the next query (needs value_dim == dim) until the relative "
            "change is <= tolerance; the answer's iterations_run and last_change say how it ended. Multi-head "
            "collections answer head_lse, head_max_score and head_top per head (top_k/epsilon: softkv.Unsupported). "
            "error_target=e (>= 0): an estimate within e of max ||v_i||_inf at 95% confidence from sampled rows "
            "(answer fields rows_scored and error_estimate; docs/PRUNING.md, 'Estimated answers'). "
            "The GIL is released while it runs.");
  def_query(cls, "query_hard", query_hard, "query",
            "query_hard(query, *, ...) -> HardResult\n\nHard retrieval for one (d,) query: the value of argmax s_i "
            "(ties: smallest id). With an hnsw/ivf index the best of the index's top 64 is taken unless exact=True. "
            "Multi-head collections: head_ids and head_scores per head, value slice j from head j's winner.");
  def_query(cls, "query_soft_batch", query_soft_batch, "queries",
            "query_soft_batch(queries, *, ...) -> SoftBatchResult\n\nSoft retrieval for (B, d) queries through "
            "Collection::query: without top_m, top_k or epsilon the entries are read once for all B (candidates = N, no "
            "contributors); with them each row is answered as query_soft would.");
  def_query(cls, "query_hard_batch", query_hard_batch, "queries",
            "query_hard_batch(queries, *, ...) -> HardBatchResult\n\nHard retrieval for (B, d) queries through "
            "Collection::query: the keys are read once for all B, or one query at a time through an hnsw/ivf/automatic "
            "index unless exact=True.");
}

}  // namespace

void bind_collections(py::module_& m) {
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
             const std::uint64_t v = id_value(id, "id");
             py::gil_scoped_release nogil;
             return c.get().contains(v);
           }, py::arg("id"), "Whether an entry has this id.")
      .def("get", [](const CollectionView& c, py::handle id, bool with_tag) {
             const std::uint64_t v = id_value(id, "id");
             Entry e;
             {
               py::gil_scoped_release nogil;
               e = c.get().get(v);
             }
             if (with_tag) return py::make_tuple(to_numpy(std::move(e.key)), to_numpy(std::move(e.value)), e.tag);
             return py::make_tuple(to_numpy(std::move(e.key)), to_numpy(std::move(e.value)));
           }, py::arg("id"), py::kw_only(), py::arg("with_tag") = false,
           "(key, value) of the entry with this id, as float32 arrays (the key as stored: unit length under cosine); "
           "with_tag=True: (key, value, tag). Raises softkv.UnknownId.")
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
      .def_property("coalescing", [](const CollectionView& c) { return c.get().coalescing(); },
                    [](const CollectionView& c, bool on) { c.get().set_coalescing(on); },
                    "Whether concurrent single queries share passes over the rows (on by default).")
      .def("coalescing_stats", [](const CollectionView& c) {
             const CoalescingStats s = c.get().coalescing_stats();
             py::dict d;
             d["queries"] = s.queries, d["passes"] = s.passes, d["max_batch"] = s.max_batch;
             return d;
           }, "Coalesced single queries: {'queries', 'passes', 'max_batch'}.")
      .def("resolve_scale", [](const CollectionView& c, std::optional<double> temperature, std::optional<double> scale) {
             QueryOptions o;
             o.temperature = maybe_float(temperature);
             o.scale = maybe_float(scale);
             return c.get().resolve_scale(o);
           }, py::kw_only(), py::arg("temperature") = py::none(), py::arg("scale") = py::none(),
           "The score scale a query with these options uses; raises softkv.InvalidArgument for a bad T or scale.");
  def_queries(view);
  view.def("__repr__", [](py::handle self) {
    const CollectionConfig& config = self.cast<const CollectionView&>().get().config();
    return "<softkv." + py::str(py::type::handle_of(self).attr("__name__")).cast<std::string>() + " dim=" +
           std::to_string(config.dim) + " value_dim=" + std::to_string(config.value_dim) +
           " metric=" + (config.metric == Metric::cosine ? "cosine" : "dot") + " index=" +
           index_name(config.index.kind).cast<std::string>() + " size=" +
           std::to_string(self.cast<const CollectionView&>().get().size_hint()) + ">";
  });
  view.def("_time_native", [](const CollectionView& c, py::handle query, long long reps, bool hard) {
        const FloatInput q = float_input(query, 1, c.dim(), "query");
        const std::size_t n = std::max<std::size_t>(1, non_negative(reps, "reps"));
        std::vector<double> seconds(n);
        py::gil_scoped_release nogil;
        for (double& s : seconds) {
          const auto t0 = std::chrono::steady_clock::now();
          if (hard) {
            (void)c.get().query_hard(q.span());
          } else {
            (void)c.get().query_soft(q.span());
          }
          s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        std::nth_element(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(n / 2), seconds.end());
        return seconds[n / 2];
      }, py::arg("query"), py::arg("reps"), py::arg("hard") = false,
      "Benchmark hook (bench/python_module_bench.py): the median seconds of one bare C++ query_soft or query_hard "
      "with default options, timed in C++ with no Python in the loop.");

  py::class_<OwnedCollection, CollectionView>(m, "Collection",
      "A set of (id, key, value) float vectors queried by soft (softmax-weighted) or hard (argmax) retrieval, held in "
      "this process (no persistence: see Database). Inputs are numpy arrays: float32 C-contiguous arrays are read "
      "without a copy, anything else real-valued is converted once. Queries may run from many threads at once (the "
      "GIL is released); a write waits for running queries.")
      .def(py::init([](long long dim, long long value_dim, const std::string& metric, std::optional<double> scale,
                       const std::string& index, long long hnsw_m, long long hnsw_ef_construction, long long ivf_nlist,
                       long long ivf_train_size, long long auto_threshold, double rebuild_fraction,
                       const std::string& key_precision, const std::string& value_precision, long long heads) {
             return OwnedCollection(std::make_shared<Collection>(make_config(dim, value_dim, metric, scale, index, hnsw_m,
                                                                             hnsw_ef_construction, ivf_nlist, ivf_train_size,
                                                                             auto_threshold, rebuild_fraction, key_precision,
                                                                             value_precision, heads)));
           }), SOFTKV_CONFIG_ARGS,
           "Collection(dim, value_dim, *, metric='dot', scale=None, index='exact', hnsw_m=32, hnsw_ef_construction=80, "
           "ivf_nlist=0, ivf_train_size=0, auto_threshold=10000, rebuild_fraction=0.25, key_precision='f32', "
           "value_precision='f32', heads=1)\n\nAn empty collection; metric "
           "'dot' or 'cosine'; index 'exact', 'flat', 'hnsw', 'ivf' or 'automatic' (pruned queries with top_k/epsilon); "
           "key_precision 'f32', 'f16', 'bf16' or 'i8', value_precision 'f32', 'f16' or 'bf16' (compact storage); "
           "heads h (1..1024, dividing dim and value_dim): h attention heads, each with its own softmax over its key and "
           "value slices (scale 1 / sqrt(dim / h)); needs index 'exact'.")
      .def("add", [](const OwnedCollection& c, py::handle key, py::handle value, py::handle tag) {
             const FloatInput k = float_input(key, 1, c.dim(), "key"), v = float_input(value, 1, c.value_dim(), "value");
             const std::uint64_t t = id_value(tag, "tag");
             py::gil_scoped_release nogil;
             return c.write().add(k.span(), v.span(), t);
           }, py::arg("key"), py::arg("value"), py::kw_only(), py::arg("tag") = 0,
           "Adds one entry ((d,) key, (dv,) value, u64 tag) and returns its new id.")
      .def("add_batch", [](const OwnedCollection& c, py::handle keys, py::handle values, py::handle tags) {
             const FloatInput k = float_input(keys, 2, c.dim(), "keys"), v = float_input(values, 2, c.value_dim(), "values");
             const std::vector<std::uint64_t> t = u64_list(tags, "tags");
             std::vector<std::uint64_t> ids;
             {
               py::gil_scoped_release nogil;
               ids = c.write().add_batch(k.span(), v.span(), t);
             }
             return to_numpy(std::move(ids));
           }, py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("tags") = py::none(),
           "Adds (n, d) keys, (n, dv) values and (n,) tags (None: all 0); returns their new ids (uint64 array).")
      .def("upsert", [](const OwnedCollection& c, py::handle id, py::handle key, py::handle value, py::handle tag) {
             const std::uint64_t i = id_value(id, "id"), t = id_value(tag, "tag");
             const FloatInput k = float_input(key, 1, c.dim(), "key"), v = float_input(value, 1, c.value_dim(), "value");
             py::gil_scoped_release nogil;
             c.write().upsert(i, k.span(), v.span(), t);
           }, py::arg("id"), py::arg("key"), py::arg("value"), py::kw_only(), py::arg("tag") = 0,
           "Inserts or replaces the entry with this id (any id but 2^64-1); it takes the new tag.")
      .def("upsert_batch", [](const OwnedCollection& c, py::handle ids, py::handle keys, py::handle values, py::handle tags) {
             const auto i = id_input(ids, "ids");
             const FloatInput k = float_input(keys, 2, c.dim(), "keys"), v = float_input(values, 2, c.value_dim(), "values");
             const std::vector<std::uint64_t> t = u64_list(tags, "tags");
             py::gil_scoped_release nogil;
             c.write().upsert_batch({i.data(), static_cast<std::size_t>(i.size())}, k.span(), v.span(), t);
           }, py::arg("ids"), py::arg("keys"), py::arg("values"), py::kw_only(), py::arg("tags") = py::none(),
           "Inserts or replaces n entries: (n,) ids, (n, d) keys, (n, dv) values, (n,) tags (None: all 0).")
      .def("remove", [](const OwnedCollection& c, py::handle id) {
             const std::uint64_t i = id_value(id, "id");
             py::gil_scoped_release nogil;
             c.write().remove(i);
           }, py::arg("id"), "Removes the entry with this id; raises softkv.UnknownId if there is none.")
      .def("remove_batch", [](const OwnedCollection& c, py::handle ids) {
             const auto i = id_input(ids, "ids");
             py::gil_scoped_release nogil;
             c.write().remove_batch({i.data(), static_cast<std::size_t>(i.size())});
           }, py::arg("ids"), "Removes distinct ids, all or nothing (softkv.UnknownId or softkv.InvalidArgument first).");

}

}  // namespace softkv::python
