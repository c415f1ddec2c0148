// softkv-server's network front end: limits, auth and the life cycle of connections.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "softkv/database.hpp"

namespace softkv::server {

class RequestForwarder;

/// Request threads by default. Most of them wait rather than compute: in a collection's coalescer for
/// the pass that will serve their query (so up to this many concurrent queries share one pass), for the
/// write lock, or for the scan pool, which has one thread per core and does the scanning.
inline constexpr unsigned kDefaultWorkers = 64;

/// Network settings and limits (defaults are the documented ones).
struct ServerConfig {
  std::string host = "127.0.0.1";       ///< bind address; anything but loopback needs a token or insecure
  std::uint16_t port = 7878;            ///< 0: an ephemeral port (see Server::port)
  unsigned io_threads = 2;              ///< threads running connections (reading, writing, pings)
  unsigned workers = 0;                 ///< threads carrying requests; 0: kDefaultWorkers (or more, one per hardware thread)
  std::string auth_token;               ///< required from every connection when non-empty
  bool insecure = false;                ///< allow a non-loopback bind without a token
  std::uint32_t max_frame = 64u << 20;  ///< largest accepted frame length; longer: error frame + close
  std::uint32_t max_connections = 1024; ///< beyond it: an error frame, then close
  std::size_t max_pending_bytes = std::size_t{256} << 20;  ///< receive-buffer memory of unfinished frames, all connections together; beyond it: server_busy, then close
  std::chrono::milliseconds idle_timeout{300000};  ///< a connection silent this long is closed
  std::chrono::milliseconds frame_deadline{10000}; ///< time to deliver a frame once its first byte came
  std::chrono::milliseconds reply_deadline{30000}; ///< time for a client to take a reply; a non-reader is closed
  std::function<void(std::string_view)> log;       ///< connection-level log lines (may be empty)
  RequestForwarder* forwarder = nullptr;           ///< sharded mode: engine requests go here, not to the Database
  std::string port_file;  ///< when set, the bound port is written here (decimal, a newline; temp file + rename) once listening
};

/// Serves one Database over TCP until stop(). Binding happens in the constructor.
class Server {
 public:
  /// Binds and listens, then writes config.port_file if set; throws Error(invalid_argument) for a
  /// non-loopback bind without a token (unless insecure) and Error(io_error) if the address cannot be
  /// bound or the port file cannot be written.
  Server(Database& db, ServerConfig config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// The bound port (useful with port 0).
  [[nodiscard]] std::uint16_t port() const;
  /// Serves until stop(); then closes idle connections, lets in-flight requests finish and returns.
  void run();
  /// Stops accepting and asks run() to return; safe from any thread and from a signal-handling thread.
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

/// Whether host names a loopback address (127.0.0.0/8, ::1, localhost).
bool is_loopback(std::string_view host);

/// Largest frame length accepted before a connection has authenticated (when the server has a token):
/// room for any hello or auth frame (an auth frame's length is at most 65,546).
inline constexpr std::uint32_t kUnauthenticatedMaxFrame = 128u << 10;

/// What fit_descriptor_limit found and chose.
struct DescriptorLimit {
  std::uint64_t soft_before = 0;     ///< the soft RLIMIT_NOFILE at start
  std::uint64_t soft = 0;            ///< the soft limit now (raised to the hard limit where allowed)
  std::uint64_t hard = 0;            ///< the hard limit
  std::uint32_t max_connections = 0; ///< the connection limit chosen (never above the one asked for)
};

/// Raises the soft RLIMIT_NOFILE to the hard limit and lowers config.max_connections so that the
/// connections fit under it with file_headroom(limit) descriptors left for the database's files.
DescriptorLimit fit_descriptor_limit(ServerConfig& config);

/// Descriptors kept free for files (log segments, snapshots, index files) under a limit of `limit`.
[[nodiscard]] constexpr std::uint64_t file_headroom(std::uint64_t limit) { return limit / 8 > 32 ? limit / 8 : 32; }

}  // namespace softkv::server
