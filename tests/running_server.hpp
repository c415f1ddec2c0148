// An in-process softkv server for tests: a Database in a temporary (or given) directory, served on an
// ephemeral port by a thread that runs server::Server.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "server.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"

namespace softkv::test {

/// Database options that keep the log quiet.
inline DatabaseOptions quiet_db() {
  DatabaseOptions o;
  o.log = [](std::string_view) {};
  return o;
}

/// A server on an ephemeral port over a database in a temporary (or the given) directory.
struct RunningServer {
  TempDir own_dir;
  std::filesystem::path dir;
  std::unique_ptr<Database> db;
  std::unique_ptr<server::Server> server;
  std::thread thread;

  explicit RunningServer(server::ServerConfig config = {}, std::filesystem::path at = {}) : dir(at.empty() ? own_dir.path : at) {
    config.port = 0;
    db = std::make_unique<Database>(dir, quiet_db());
    server = std::make_unique<server::Server>(*db, config);
    thread = std::thread([this] { server->run(); });
  }
  ~RunningServer() { stop(); }
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;
  /// Stops the server and closes the database (idempotent).
  void stop() {
    if (!thread.joinable()) return;
    server->stop();
    thread.join();
    server.reset();
    db.reset();
  }
  /// Client options for this server at the highest protocol version, or the one SOFTKV_TEST_PROTOCOL
  /// names: ctest runs the [server] cases a second time with version 1, as a client from before
  /// version 2 would.
  [[nodiscard]] ClientOptions client(std::string token = {}) const {
    ClientOptions o{"127.0.0.1", server->port(), std::move(token)};
    if (const char* v = std::getenv("SOFTKV_TEST_PROTOCOL")) o.protocol_version = static_cast<std::uint16_t>(std::atoi(v));
    return o;
  }
  /// Client options for this server speaking the given protocol version.
  [[nodiscard]] ClientOptions client_at(std::uint16_t version) const {
    ClientOptions o{"127.0.0.1", server->port(), {}};
    o.protocol_version = version;
    return o;
  }
};

}  // namespace softkv::test
