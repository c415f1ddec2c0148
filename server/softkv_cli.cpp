// softkv: the command-line client (create, load, query, list, stats, snapshot, drop) over softkv::Client.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "softkv/client.hpp"
#include "softkv/error.hpp"
#include "softkv/version.hpp"
#include "vector_files.hpp"

namespace {

using softkv::cli::Matrix;

const char* const kPrecisionNames[] = {"f32", "f16", "bf16", "i8"};

// The Precision a --key-precision / --value-precision name stands for (CLI11 has checked the name).
softkv::Precision precision_of(const std::string& name) {
  for (int p = 0; p < 4; ++p)
    if (name == kPrecisionNames[p]) return static_cast<softkv::Precision>(p);
  return softkv::Precision::f32;
}

const char* precision_name(softkv::Precision p) { return static_cast<int>(p) < 4 ? kPrecisionNames[static_cast<int>(p)] : "unknown"; }

const char* index_name(softkv::IndexKind k) {
  switch (k) {
    case softkv::IndexKind::exact: return "exact";
    case softkv::IndexKind::flat: return "flat";
    case softkv::IndexKind::hnsw: return "hnsw";
    case softkv::IndexKind::ivf: return "ivf";
    case softkv::IndexKind::automatic: return "automatic";
  }
  return "?";
}

std::vector<float> parse_floats(const std::string& text) {
  std::vector<float> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stof(item));
  return out;
}

// Comma-separated unsigned 64-bit integers (tags or ids); anything else is invalid_argument.
std::vector<std::uint64_t> parse_u64s(const std::string& text, const char* what) {
  std::vector<std::uint64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    std::size_t used = 0;
    unsigned long long v = 0;
    try {
      v = std::stoull(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || item.find('-') != std::string::npos)
      throw softkv::Error(softkv::ErrorCode::invalid_argument, std::string(what) + ": '" + item + "' is not an unsigned 64-bit integer");
    out.push_back(v);
  }
  return out;
}

// One status line on stderr, redrawn in place: rows done, percentage, rate.
void progress(std::size_t done, std::size_t total, double seconds) {
  std::fprintf(stderr, "\rloaded %zu / %zu rows (%3.0f%%), %.0f rows/s   ", done, total, 100.0 * done / std::max<std::size_t>(total, 1),
               seconds > 0 ? done / seconds : 0.0);
  std::fflush(stderr);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"softkv: command-line client for softkv-server"};
  app.require_subcommand(1);
  app.footer("example: softkv --port 7878 stats   (each subcommand's --help shows an example of it)");
  softkv::ClientOptions options;
  std::string token_file;
  app.add_option("--host", options.host, "server address")->capture_default_str();
  app.add_option("--port", options.port, "server port")->capture_default_str();
  app.add_option("--auth-token-file", token_file, "file holding the server's auth token (default: none, no token sent)");

  std::string name;
  auto* create = app.add_subcommand("create", "create a collection");
  create->footer("example: softkv create animals --dim 4 --value-dim 2 --index ivf");
  std::size_t dim = 0, value_dim = 0;
  std::string metric = "dot", index = "exact";
  create->add_option("name", name, "collection name")->required();
  create->add_option("--dim", dim, "key dimension")->required();
  create->add_option("--value-dim", value_dim, "value dimension")->required();
  create->add_option("--metric", metric, "dot (q·k) or cosine (keys and queries normalised)")->check(CLI::IsMember({"dot", "cosine"}))->capture_default_str();
  create->add_option("--index", index, "pruning index for --top-k / --epsilon queries (exact: none)")->check(CLI::IsMember({"exact", "flat", "hnsw", "ivf", "automatic"}))->capture_default_str();
  // Compact storage (docs/PRECISION.md, "Compact storage"): needs a server that speaks protocol version 2.
  std::string key_precision = "f32", value_precision = "f32";
  create->add_option("--key-precision", key_precision, "how keys are stored")->check(CLI::IsMember({"f32", "f16", "bf16", "i8"}))->capture_default_str();
  create->add_option("--value-precision", value_precision, "how values are stored")->check(CLI::IsMember({"f32", "f16", "bf16"}))->capture_default_str();
  // Multi-head (docs/ATTENTION.md, "Multi-head"): heads > 1 needs protocol version 2.
  std::size_t heads = 1;
  create->add_option("--heads", heads, "attention heads (1..1024, dividing --dim and --value-dim)")->capture_default_str();

  auto* load = app.add_subcommand("load", "add rows from key and value files (.npy or .fvecs)");
  load->footer("example: softkv load animals --keys keys.npy --values values.npy");
  std::string keys_file, values_file;
  std::size_t batch = 10000;
  load->add_option("name", name, "collection name")->required();
  load->add_option("--keys", keys_file, "n x d keys")->required()->check(CLI::ExistingFile);
  load->add_option("--values", values_file, "n x dv values")->required()->check(CLI::ExistingFile);
  load->add_option("--batch", batch, "rows per request")->capture_default_str();
  std::string load_tag;
  load->add_option("--tag", load_tag, "tag every loaded row with this u64 (default 0)");

  auto* query = app.add_subcommand("query", "soft (default) or hard retrieval");
  query->footer("examples: softkv query animals --query 0.3,0.9,1,0 --temperature 0.5\n"
                "          softkv query animals --query 0.3,0.9,1,0 --hard\n"
                "          softkv query big --queries q.npy --epsilon 0.01 --out answers.npy\n"
                "          softkv query big --query 0.3,0.9,1,0 --error-target 0.01");
  std::string inline_query, queries_file, out_file;
  bool hard = false, exact = false;
  softkv::QueryOptions qo;
  std::optional<float> temperature, scale, epsilon, error_target;
  std::optional<std::size_t> top_k;
  std::size_t top_m = 5;
  query->add_option("name", name, "collection name")->required();
  query->add_option("--query", inline_query, "one query as comma-separated floats (default: none; give this or --queries)");
  query->add_option("--queries", queries_file, "B x d queries (.npy or .fvecs; default: none; give this or --query)")->check(CLI::ExistingFile);
  query->add_flag("--hard", hard, "hard retrieval (argmax) instead of soft (default: soft)");
  query->add_option("--temperature", temperature, "T > 0: scores q·k / (sqrt(d)·T) (default: the collection's own scale if it was created with one, else T = 1, i.e. scale 1/sqrt(d))");
  query->add_option("--scale", scale, "score factor instead of 1/(sqrt(d)·T), finite and > 0 (exclusive with --temperature; default: 1/(sqrt(d)·T))");
  query->add_option("--top-m", top_m, "contributors to show (soft; the libraries' top_m defaults to 0)")->capture_default_str();
  query->add_option("--top-k", top_k, "prune to the k best keys (needs an index; default: no pruning)");
  query->add_option("--epsilon", epsilon, "adaptive pruning: stop once the dropped weight is <= this (needs an index; default: none)");
  query->add_option("--error-target", error_target,
                    "soft: estimate the answer within this error relative to max |v| at 95% confidence, from a sample of the "
                    "rows (protocol 3; default: none, the exact or pruned answer)");
  query->add_flag("--exact", exact, "hard: scan every key even with an index (default: off, hard queries use the index)");
  query->add_option("--out", out_file, "write the answers as a B x dv float32 .npy (default: print them)");
  std::string mask_tags, mask_range, mask_exclude;
  query->add_option("--tags", mask_tags, "mask: only entries with one of these tags (comma-separated; default: any tag)");
  query->add_option("--tag-range", mask_range, "mask: only entries with lo <= tag <= hi, given as lo,hi (default: any tag)");
  query->add_option("--exclude", mask_exclude, "mask: never these ids (comma-separated; default: none)");
  // Iterative (Hopfield) retrieval: soft, dv == d, protocol version 2.
  std::size_t iterations = 1;
  float tolerance = 0.0f;
  query->add_option("--iterations", iterations, "soft: feed the value back as the query up to this many times (1..1000)")->capture_default_str();
  query->add_option("--tolerance", tolerance, "stop iterating once the relative change is <= this")->capture_default_str();

  auto* list = app.add_subcommand("list", "collection names");
  list->footer("example: softkv list");
  auto* stats = app.add_subcommand("stats", "server statistics, or a collection's with a name");
  stats->add_option("name", name, "collection name (default: the server's statistics)");
  stats->footer("examples: softkv stats\n          softkv stats animals");
  auto* snapshot = app.add_subcommand("snapshot", "write a snapshot now");
  snapshot->footer("example: softkv snapshot");
  auto* drop = app.add_subcommand("drop", "drop a collection");
  drop->add_option("name", name, "collection name")->required();
  drop->footer("example: softkv drop animals");
  CLI11_PARSE(app, argc, argv);

  try {
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      std::getline(in, options.token);
    }
    softkv::Client client(options);
    if (*create) {
      softkv::CollectionConfig config{dim, value_dim, metric == "cosine" ? softkv::Metric::cosine : softkv::Metric::dot, {}, {}};
      const char* kinds[] = {"exact", "flat", "hnsw", "ivf", "automatic"};
      for (int k = 0; k < 5; ++k)
        if (index == kinds[k]) config.index.kind = static_cast<softkv::IndexKind>(k);
      config.key_precision = precision_of(key_precision);
      config.value_precision = precision_of(value_precision);
      config.heads = heads;
      client.create_collection(name, config);
      std::printf("created %s: d = %zu, dv = %zu, %s, index %s, keys %s, values %s, heads %zu\n", name.c_str(), dim, value_dim, metric.c_str(),
                  index.c_str(), key_precision.c_str(), value_precision.c_str(), heads);
    } else if (*load) {
      const Matrix keys = softkv::cli::read_matrix(keys_file), values = softkv::cli::read_matrix(values_file);
      if (keys.rows != values.rows)
        throw softkv::Error(softkv::ErrorCode::dimension_mismatch, std::to_string(keys.rows) + " keys but " + std::to_string(values.rows) + " values");
      std::uint64_t tag = 0;
      if (!load_tag.empty()) {
        const auto one = parse_u64s(load_tag, "--tag");
        if (one.size() != 1) throw softkv::Error(softkv::ErrorCode::invalid_argument, "--tag takes one u64");
        tag = one[0];
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t at = 0; at < keys.rows; at += batch) {
        const std::size_t n = std::min(batch, keys.rows - at);
        const std::vector<std::uint64_t> tags(tag != 0 ? n : 0, tag);  // untagged loads stay protocol-1 compatible
        client.add(name, std::span(keys.data).subspan(at * keys.cols, n * keys.cols), std::span(values.data).subspan(at * values.cols, n * values.cols),
                   tags);
        progress(at + n, keys.rows, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::fprintf(stderr, "\n");
    } else if (*query) {
      Matrix qs;
      if (!queries_file.empty()) {
        qs = softkv::cli::read_matrix(queries_file);
      } else {
        qs.data = parse_floats(inline_query);
        qs.rows = 1, qs.cols = qs.data.size();
      }
      qo.temperature = temperature, qo.scale = scale, qo.epsilon = epsilon, qo.top_k = top_k, qo.exact = exact;
      qo.top_m = hard ? 0 : top_m;
      qo.iterations = iterations, qo.tolerance = tolerance;
      qo.error_target = error_target;
      if (!mask_tags.empty()) qo.tags_any = parse_u64s(mask_tags, "--tags");
      if (!mask_exclude.empty()) qo.exclude_ids = parse_u64s(mask_exclude, "--exclude");
      if (!mask_range.empty()) {
        const auto r = parse_u64s(mask_range, "--tag-range");
        if (r.size() != 2) throw softkv::Error(softkv::ErrorCode::invalid_argument, "--tag-range takes lo,hi");
        qo.tag_range = softkv::TagRange{r[0], r[1]};
      }
      Matrix answers{qs.rows, 0, {}};
      if (hard) {
        for (const softkv::HardResult& h : client.query_hard_batch(name, qs.data, qo)) {
          std::printf("id %llu  score %.6g  (%s)  value [", (unsigned long long)h.id, h.score, index_name(h.searched_with));
          for (std::size_t i = 0; i < h.value.size() && i < 8; ++i) std::printf(i ? ", %.4g" : "%.4g", h.value[i]);
          std::printf(h.value.size() > 8 ? ", ...]\n" : "]\n");
          for (std::size_t j = 0; j < h.head_ids.size(); ++j)
            std::printf("    head %zu: id %llu  score %.6g\n", j, (unsigned long long)h.head_ids[j], h.head_scores[j]);
          answers.cols = h.value.size();
          answers.data.insert(answers.data.end(), h.value.begin(), h.value.end());
        }
      } else {
        for (const softkv::SoftResult& s : client.query_soft_batch(name, qs.data, qo)) {
          std::printf("lse %.6g  max score %.6g  candidates %zu  tail bound %.3g%s%s  value [", s.lse, s.max_score, s.candidates, s.tail_bound,
                      s.tail_bound_guaranteed ? "" : " (estimate)", s.mask_filtered_after_search ? " (mask filtered after search)" : "");
          for (std::size_t i = 0; i < s.value.size() && i < 8; ++i) std::printf(i ? ", %.4g" : "%.4g", s.value[i]);
          std::printf(s.value.size() > 8 ? ", ...]\n" : "]\n");
          if (iterations > 1) std::printf("    iterations run %zu  last change %.3g\n", s.iterations_run, s.last_change);
          if (error_target) std::printf("    rows scored %zu  error estimate %.3g\n", s.rows_scored, s.error_estimate);
          if (s.heads.empty()) {
            for (const softkv::Contributor& c : s.top) std::printf("    id %-10llu weight %.4f  score %.6g\n", (unsigned long long)c.id, c.weight, c.score);
          }
          for (std::size_t j = 0; j < s.heads.size(); ++j) {
            std::printf("    head %zu: lse %.6g  max score %.6g\n", j, s.heads[j].lse, s.heads[j].max_score);
            for (const softkv::Contributor& c : s.heads[j].top)
              std::printf("      id %-10llu weight %.4f  score %.6g\n", (unsigned long long)c.id, c.weight, c.score);
          }
          answers.cols = s.value.size();
          answers.data.insert(answers.data.end(), s.value.begin(), s.value.end());
        }
      }
      if (!out_file.empty()) softkv::cli::write_npy(out_file, answers);
    } else if (*list) {
      for (const auto& n : client.list_collections()) std::printf("%s\n", n.c_str());
    } else if (*stats) {
      if (name.empty()) {
        const softkv::ServerStats s = client.stats();
        std::printf("softkv-server %s, kernel path %s: %llu collections, %llu connections, %llu requests, last sequence %llu\n",
                    s.server_version.c_str(), s.simd_path.c_str(), (unsigned long long)s.collections, (unsigned long long)s.connections,
                    (unsigned long long)s.requests, (unsigned long long)s.last_sequence);
      } else {
        const softkv::CollectionStats s = client.describe(name);
        std::printf("%s: %zu entries, d = %zu, dv = %zu, heads %zu, %s, index %s, keys %s, values %s, %llu bytes in memory, %llu bytes in the last snapshot\n",
                    s.name.c_str(), s.size, s.dim, s.value_dim, s.heads, s.metric == softkv::Metric::cosine ? "cosine" : "dot",
                    index_name(s.index), precision_name(s.key_precision), precision_name(s.value_precision),
                    (unsigned long long)s.bytes_in_memory, (unsigned long long)s.bytes_on_disk);
      }
    } else if (*snapshot) {
      client.snapshot();
      std::printf("snapshot written\n");
    } else if (*drop) {
      client.drop_collection(name);
      std::printf("dropped %s\n", name.c_str());
    }
  } catch (const softkv::Error& e) {
    std::fprintf(stderr, "softkv: %s\n", e.what());
    return 1;
  }
  return 0;
}
