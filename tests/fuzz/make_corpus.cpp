// Writes the fuzz seed corpus: one valid input per message kind (frames), per record kind (log),
// and a snapshot. Run: make_corpus tests/fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "softkv/database.hpp"
#include "codec/checked_blob.hpp"
#include "codec/parts.hpp"
#include "codec/records.hpp"
#include "storage/file.hpp"
#include "storage/snapshot.hpp"
#include "wire/protocol.hpp"

namespace fs = std::filesystem;
using namespace softkv;

static void write(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

int main(int argc, char** argv) {
  const fs::path root = argc > 1 ? argv[1] : "corpus";
  CollectionConfig config{3, 2, Metric::dot, {}, {}};
  QueryOptions options{.temperature = 0.5f, .top_m = 2};
  const wire::Request requests[] = {
      wire::Hello{}, wire::Auth{"token"}, wire::Ping{}, wire::Create{"c", config}, wire::Drop{"c"}, wire::List{},
      wire::Describe{"c"}, wire::Add{"c", {1, 2, 3}, {4, 5}}, wire::Upsert{"c", {9}, {1, 2, 3}, {4, 5}}, wire::Remove{"c", {9}},
      wire::Get{"c", 9}, wire::Query{"c", wire::QueryKind::soft, options, {1, 2, 3}}, wire::Snapshot{}, wire::Stats{}};
  int i = 0;
  for (const auto& r : requests) write(root / "frame" / ("request-" + std::to_string(i++)), wire::encode_request(r, i));
  SoftResult s;
  s.value = {1, 2};
  s.lse = 0.5;
  s.candidates = 3;
  s.top = {{1, 0.5f, 0.25f}};
  write(root / "frame" / "reply-soft", wire::encode_reply(wire::Opcode::query, 1, wire::SoftReply{{s}}));
  write(root / "frame" / "reply-error", wire::encode_reply(wire::Opcode::add, 1, wire::ErrorReply{ErrorCode::non_finite, "NaN"}));

  // A log with every record kind, and the snapshot of the same state.
  const fs::path dir = fs::temp_directory_path() / "softkv-make-corpus";
  fs::remove_all(dir);
  {
    DatabaseOptions o;
    o.log = [](std::string_view) {};
    Database db(dir, o);
    db.create_collection("c", config);
    db.create_collection("gone", config);
    const auto ids = db.add("c", std::vector<float>{1, 2, 3, 4, 5, 6}, std::vector<float>{1, 2, 3, 4});
    db.upsert("c", std::vector<std::uint64_t>{ids[0]}, std::vector<float>{3, 2, 1}, std::vector<float>{0, 1});
    db.remove("c", std::vector<std::uint64_t>{ids[1]});
    db.drop_collection("gone");
  }
  fs::copy_file(dir / "wal-00000000000000000001.log", root / "wal" / "all-record-kinds", fs::copy_options::overwrite_existing);
  {
    DatabaseOptions o;
    o.log = [](std::string_view) {};
    Database db(dir, o);
    db.snapshot();
  }
  fs::copy_file(dir / "snapshot.skv", root / "snapshot" / "one-collection", fs::copy_options::overwrite_existing);

  // One payload per record kind, prefixed with its type byte (fuzz_records).
  namespace m = detail::mutation;
  const detail::Mutation mutations[] = {m::Create{"c", config}, m::Drop{"c"},
                                        m::Upsert{"c", Rows{{1, 2}, {1, 2, 3, 4, 5, 6}, {1, 2, 3, 4}}}, m::Remove{"c", {1, 2}}};
  fs::create_directories(root / "records");
  int k = 0;
  for (const auto& mutation : mutations) {
    const detail::EncodedMutation e = detail::encode_mutation(mutation);
    std::vector<std::byte> bytes{std::byte(e.type)};
    bytes.insert(bytes.end(), e.payload.begin(), e.payload.end());
    write(root / "records" / ("record-" + std::to_string(k++)), bytes);
  }
  // One part per mutation kind, as a part file holds it (fuzz_parts), and its payload alone (which the
  // target seals itself).
  fs::create_directories(root / "parts");
  k = 0;
  for (const auto& mutation : mutations) {
    const std::vector<std::byte> part = detail::encode_part(mutation, {"0123456789abcdef0123456789abcdef", 1, 3, 7});
    write(root / "parts" / ("part-" + std::to_string(k)), part);
    write(root / "parts" / ("payload-" + std::to_string(k++)),
          std::vector<std::byte>(part.begin() + static_cast<std::ptrdiff_t>(detail::kBlobHeaderSize), part.end()));
  }
  fs::remove_all(dir);
  std::printf("corpus written to %s\n", root.c_str());
  return 0;
}
