// softkv::Client: a synchronous client for softkv-server over TCP (docs/PROTOCOL.md).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "softkv/types.hpp"
#include "softkv/database.hpp"

namespace softkv {

/// Where and how to connect.
struct ClientOptions {
  std::string host = "127.0.0.1";     ///< server address or name
  std::uint16_t port = 7878;          ///< server port
  std::string token;                  ///< auth token; sent after hello when non-empty
  double timeout_seconds = 60;        ///< per send/receive; a slower server is an io_error
  std::uint32_t max_frame = 64u << 20;  ///< largest frame length sent or accepted (match the server's --max-frame); a larger request fails locally with frame_too_large
  std::uint16_t protocol_version = 3;  ///< highest protocol version to speak (1, 2 or 3); hello settles on min(this, the server's)
};

/// Server-wide figures.
struct ServerStats {
  std::string server_version;     ///< softkv version of the server
  std::string simd_path;          ///< the server's kernel path
  std::uint64_t collections = 0;  ///< collections in its database
  std::uint64_t connections = 0;  ///< open connections
  std::uint64_t requests = 0;     ///< requests served since start
  std::uint64_t last_sequence = 0;  ///< last logged mutation
};

/// One connection to a softkv-server. Every call sends a request and waits for its reply; a reply
/// that is an error frame is thrown as softkv::Error with the server's code and message. Not thread
/// safe: use one Client per thread.
class Client {
 public:
  /// Connects, says hello and authenticates; throws Error(io_error) if the server cannot be reached.
  explicit Client(const ClientOptions& options = {});
  ~Client();
  Client(Client&&) noexcept;             ///< moves the connection
  Client& operator=(Client&&) noexcept;  ///< moves the connection
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Round trip with no work.
  void ping();
  /// The server's version string from the handshake.
  [[nodiscard]] const std::string& server_version() const noexcept;
  /// The protocol version this connection speaks, as settled by hello.
  [[nodiscard]] std::uint16_t protocol_version() const noexcept;

  /// Creates a collection (see Database::create_collection); compact precisions and heads > 1 need
  /// protocol version 2 (Error(unsupported) on a version-1 connection).
  void create_collection(std::string_view name, const CollectionConfig& config);
  /// Drops a collection.
  void drop_collection(std::string_view name);
  /// Collection names, sorted.
  std::vector<std::string> list_collections();
  /// A collection's size and shape.
  CollectionStats describe(std::string_view name);
  /// A collection's coalescing counters: queries served, passes run, largest pass (opcode query_stats).
  CoalescingStats query_stats(std::string_view name);

  /// Adds rows (n x d keys, n x dv values, tags empty or n); returns their ids once durable on the
  /// server. Tags need protocol version 2 (Error(unsupported) on a version-1 connection).
  std::vector<std::uint64_t> add(std::string_view name, std::span<const float> keys, std::span<const float> values,
                                 std::span<const std::uint64_t> tags = {});
  /// Inserts or replaces rows by id (tags empty or n, version 2); returns once durable.
  void upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
              std::span<const float> values, std::span<const std::uint64_t> tags = {});
  /// Removes rows by id (all or none); returns once durable.
  void remove(std::string_view name, std::span<const std::uint64_t> ids);
  /// One entry.
  Entry get(std::string_view name, std::uint64_t id);

  /// The one query call, as Collection::query answers it: n >= 1 row-major queries (n x d), soft or
  /// hard, in one request; the answers in QueryResults (soft or hard filled). The other query methods
  /// are this call with another result shape.
  QueryResults query(std::string_view name, std::span<const float> queries, Retrieval kind, const QueryOptions& options = {});
  /// Soft retrieval for one query (d floats), as Collection::query_soft computes it. Masks and
  /// iterations need protocol version 2, error_target and a check_sample other than 256 version 3; a
  /// version-1 query on a multi-head collection is Error(unsupported).
  SoftResult query_soft(std::string_view name, std::span<const float> query, const QueryOptions& options = {});
  /// Hard retrieval for one query, as Collection::query_hard computes it.
  HardResult query_hard(std::string_view name, std::span<const float> query, const QueryOptions& options = {});
  /// Soft retrieval for B row-major queries (one result each; see PROTOCOL.md for which path runs).
  std::vector<SoftResult> query_soft_batch(std::string_view name, std::span<const float> queries, const QueryOptions& options = {});
  /// Hard retrieval for B row-major queries.
  std::vector<HardResult> query_hard_batch(std::string_view name, std::span<const float> queries, const QueryOptions& options = {});

  /// Asks the server to write a snapshot now.
  void snapshot();
  /// Server-wide figures.
  ServerStats stats();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace softkv
