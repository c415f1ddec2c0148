// Handler: turns decoded requests into Database calls and results into replies; the server's only
// door into the engine.
#pragma once

#include <atomic>
#include <cstdint>

#include "softkv/database.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {

/// Where a sharded server sends engine requests instead of its local Database (server/sharded.hpp):
/// rank 0 of an MPI job hands each request to the thread that runs it on every rank.
class RequestForwarder {
 public:
  virtual ~RequestForwarder() = default;
  /// The reply to one engine request (never throws: failures are ErrorReply). May block.
  virtual wire::Reply forward(const wire::Request& request) = 0;
};

/// Executes requests against a Database. Thread safe (the Database is); may block (scans, fsync).
class Handler {
 public:
  /// Serves db; connections is the server's live connection count, reported by stats.
  Handler(Database& db, const std::atomic<std::uint64_t>& connections, RequestForwarder* forwarder = nullptr)
      : db_(db), connections_(connections), forwarder_(forwarder) {}

  /// The reply to one engine request (not hello, auth or ping: the session answers those). Every
  /// softkv::Error becomes an ErrorReply with its code, std::bad_alloc resource_exhausted, and any
  /// other exception (a broken invariant) internal.
  wire::Reply handle(const wire::Request& request);

  /// Whether a request is cheap enough to answer on an I/O thread without ever waiting long: list,
  /// and queries, gets and describes on collections small enough that a scan reads at most
  /// kInlineFloats floats. Writes (which may fsync), stats and larger scans go to the worker pool.
  [[nodiscard]] bool is_cheap(const wire::Request& request) const;

  /// Scan work (floats read) below which a query is answered inline: ~1 MiB, tens of microseconds,
  /// about what two thread hops cost.
  static constexpr std::size_t kInlineFloats = std::size_t{1} << 18;

 private:
  wire::Reply query(const wire::Query& q);

  Database& db_;
  const std::atomic<std::uint64_t>& connections_;
  RequestForwarder* forwarder_;  // sharded mode: every engine request goes here (null: to db_)
  std::atomic<std::uint64_t> requests_{0};
};

/// The error reply for the exception being handled (call only inside a catch block): a softkv::Error
/// keeps its code, std::bad_alloc is resource_exhausted, anything else is a broken invariant
/// (internal, the message saying so).
wire::ErrorReply current_error_reply();

}  // namespace softkv::server
