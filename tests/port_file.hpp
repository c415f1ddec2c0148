// The port of a softkv-server started with `--port 0 --port-file PATH`, for tests that start server
// processes. Guessing a free port and passing it is racy: under ctest -j another test's server can
// take the port first, and the test would then talk to that server.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace softkv::test {

/// A fresh path in the temporary directory for a server to write its port to (on another file system
/// than a data directory a test fills up). Unique per process and call; the caller removes it.
inline std::filesystem::path new_port_file() {
  static std::atomic<unsigned> counter{0};
  return std::filesystem::temp_directory_path() /
         ("softkv-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".port");
}

/// The port written in `path`, or nothing while the server has not written it yet (the server writes
/// the file whole, by a rename, so a file that exists is complete).
inline std::optional<std::uint16_t> read_port_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  unsigned long port = 0;
  if (!(in >> port) || port == 0 || port > 65535) return std::nullopt;
  return static_cast<std::uint16_t>(port);
}

}  // namespace softkv::test
