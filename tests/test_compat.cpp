// Compatibility: data directories written by earlier formats open with every entry bit for bit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "codec/records.hpp"
#include "softkv/softkv.hpp"
#include "storage/wal.hpp"
#include "temp_dir.hpp"

using namespace softkv;
namespace fs = std::filesystem;

namespace {

std::string bits(const std::vector<float>& v) {
  std::string s;
  char buf[16];
  for (float f : v) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    std::snprintf(buf, sizeof buf, "%08x ", u);
    s += buf;
  }
  return s;
}

// The same dump tests/fixtures/make_fixture.cpp writes, from an open database.
std::string dump(const Database& db) {
  std::ostringstream out;
  for (const std::string& name : db.list_collections()) {
    const auto c = db.collection(name);
    const CollectionConfig& cfg = c->config();
    out << "collection " << name << " " << cfg.dim << " " << cfg.value_dim << " " << int(cfg.metric) << " " << int(cfg.index.kind)
        << " " << c->size();
    if (cfg.key_precision != Precision::f32 || cfg.value_precision != Precision::f32)
      out << " p " << int(cfg.key_precision) << " " << int(cfg.value_precision);
    out << "\n";
    std::vector<std::uint64_t> ids = c->ids();
    std::sort(ids.begin(), ids.end());
    for (std::uint64_t id : ids) {
      const Entry e = c->get(id);
      out << "entry " << id << " k " << bits(e.key) << "v " << bits(e.value);
      if (e.tag != 0) out << "t " << e.tag << " ";
      out << "\n";
    }
  }
  return out.str();
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("a data directory written by format 1 opens bit for bit, and again after a snapshot in the current format", "[compat]") {
  const fs::path fixture = fs::path(SOFTKV_FIXTURES) / "v1";
  const std::string expected = read_text(fixture / "expected.txt");
  REQUIRE(expected.size() > 1000);
  test::TempDir dir;
  fs::copy(fixture / "data", dir.path, fs::copy_options::recursive);
  std::vector<std::string> lines;
  DatabaseOptions options;
  options.log = [&](std::string_view line) { lines.emplace_back(line); };
  // Data from before tags opens with every tag 0, and still does after a snapshot in the current format.
  auto every_tag_zero = [](const Database& db) {
    for (const std::string& name : db.list_collections()) {
      const auto c = db.collection(name);
      for (std::uint64_t id : c->ids())
        if (c->get(id).tag != 0) return false;
    }
    return !db.list_collections().empty();
  };
  auto logged = [&](std::string_view what) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  {
    Database db(dir.path, options);
    CHECK(dump(db) == expected);
    CHECK(every_tag_zero(db));
    // The legacy FAISS IVF file is not the certified lists' format: the lists are rebuilt from the rows.
    CHECK(logged("'ivf.idx': the saved index does not match the entries; rebuilt its index"));
    // The id counters came through: the next add continues where the old build left off.
    const auto late = db.collection("late");
    CHECK(late->next_id() == 3);
    CHECK(db.collection("dot")->next_id() == 1007);  // upsert of id 1000, then six adds
    db.snapshot();  // rewrites everything in the current format (3) and retires the old log
  }
  lines.clear();
  {
    Database db(dir.path, options);
    CHECK(dump(db) == expected);
    CHECK(every_tag_zero(db));
    CHECK(logged("'ivf.idx': loaded its index"));
  }
}

TEST_CASE("a data directory written by format 3 (compact rows, tags) opens bit for bit, before and after a new snapshot", "[compat]") {
  const fs::path fixture = fs::path(SOFTKV_FIXTURES) / "v3";
  const std::string expected = read_text(fixture / "expected.txt");
  REQUIRE(expected.find("collection half 4 3 0 0 22 p ") != std::string::npos);  // the fixture holds what it should
  REQUIRE(expected.find("t 18446744073709551614 ") != std::string::npos);
  test::TempDir dir;
  fs::copy(fixture / "data", dir.path, fs::copy_options::recursive);
  for (int round = 0; round < 2; ++round) {
    Database db(dir.path);
    CHECK(dump(db) == expected);
    CHECK(db.collection("half")->config().key_precision == Precision::f16);
    CHECK(db.collection("q8")->config().key_precision == Precision::i8);
    CHECK(db.collection("half")->next_id() == 23);
    QueryOptions masked;  // the tags are usable by masks, not only stored
    masked.tag_range = TagRange{7, 7};
    const SoftResult r = db.collection("half")->query_soft(std::vector<float>(4, 1.0f), masked);
    CHECK(r.candidates == 1);
    db.snapshot();  // round 2 reads what this build wrote
  }
}

TEST_CASE("a log written before the config limits, with index settings now out of range, still opens", "[compat]") {
  test::TempDir dir;
  fs::create_directories(dir.path);
  CollectionConfig config{2, 1, Metric::dot, {}, {}};
  config.index = {.kind = IndexKind::hnsw, .hnsw_m = 1000, .hnsw_ef_construction = 1u << 20};
  CollectionConfig ivf{2, 1, Metric::dot, {}, {}};
  ivf.index = {.kind = IndexKind::ivf, .ivf_nlist = 100000, .ivf_train_size = 10, .rebuild_fraction = INFINITY};
  std::vector<std::byte> log;
  std::uint64_t sequence = 0;
  for (const detail::Mutation& m : {detail::Mutation{detail::mutation::Create{"h", config}}, detail::Mutation{detail::mutation::Create{"i", ivf}},
                                     detail::Mutation{detail::mutation::Upsert{"i", Rows{{0, 1}, {1, 2, 3, 4}, {5, 6}}}}}) {
    const auto e = detail::encode_mutation(m);
    const auto record = detail::encode_record(++sequence, e.type, e.payload);
    log.insert(log.end(), record.begin(), record.end());
  }
  std::ofstream(dir.path / detail::segment_name(1), std::ios::binary).write(reinterpret_cast<const char*>(log.data()), std::streamsize(log.size()));
  std::vector<std::string> lines;
  DatabaseOptions options;
  options.log = [&](std::string_view line) { lines.emplace_back(line); };
  Database db(dir.path, options);
  CHECK(db.collection("h")->config().index.hnsw_m == ConfigLimits::kMaxHnswM);
  CHECK(db.collection("h")->config().index.hnsw_ef_construction == ConfigLimits::kMaxHnswEfConstruction);
  CHECK(db.collection("i")->config().index.ivf_nlist == ConfigLimits::kMaxIvfNlist);
  CHECK(db.collection("i")->config().index.ivf_train_size == ConfigLimits::kMaxIvfNlist);
  CHECK(db.collection("i")->config().index.rebuild_fraction == 0.25f);
  CHECK(db.collection("i")->size() == 2);
  CHECK(std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l.find("brought into range") != std::string::npos; }) == 2);
  db.snapshot();
}
