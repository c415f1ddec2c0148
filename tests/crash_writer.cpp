// Helper for the crash test: upserts batches with fsync=always and reports each on stdout, until killed.
// Prints "begin FIRST LAST" before a batch and "ack FIRST LAST" once the call returned (durable).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "softkv/softkv.hpp"

namespace {

// Entry id's key and value: the parent recomputes them to check what it finds bit for bit.
std::vector<float> key_of(std::uint64_t id) { return {float(id), float(id % 7) + 0.5f, -float(id) / 3.0f, 1.0f}; }
std::vector<float> value_of(std::uint64_t id) { return {float(id) * 0.25f, float(id % 11)}; }

void say(const char* what, std::uint64_t first, std::uint64_t last) {
  char line[64];
  const int n = std::snprintf(line, sizeof line, "%s %llu %llu\n", what, (unsigned long long)first, (unsigned long long)last);
  if (::write(STDOUT_FILENO, line, static_cast<std::size_t>(n)) != n) std::_Exit(3);  // one write: atomic on a pipe
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  softkv::Database db(argv[1], {.fsync = softkv::FsyncPolicy::always, .snapshot_after_bytes = 4096, .log = [](std::string_view) {}});
  if (!db.has_collection("c")) db.create_collection("c", {4, 2, softkv::Metric::dot, {}, {}});
  std::uint64_t next = 0;
  const auto ids = db.collection("c")->ids();
  for (std::uint64_t id : ids) next = std::max(next, id + 1);
  std::srand(static_cast<unsigned>(std::atoi(argv[2])));
  for (;;) {
    const std::uint64_t n = 1 + std::rand() % 5;
    std::vector<std::uint64_t> batch;
    std::vector<float> keys, values;
    for (std::uint64_t i = 0; i < n; ++i) {
      batch.push_back(next + i);
      const auto k = key_of(next + i), v = value_of(next + i);
      keys.insert(keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
    }
    say("begin", next, next + n - 1);
    db.upsert("c", batch, keys, values);
    say("ack", next, next + n - 1);
    next += n;
  }
}
