// Request -> Database mapping. Queries run exactly the library call a user of Collection would make,
// so answers over TCP equal the library's bit for bit.
#include "handler.hpp"

#include "error_of.hpp"

#include <algorithm>
#include <string>

#include "overloaded.hpp"
#include "softkv/simd.hpp"
#include "softkv/version.hpp"

namespace softkv::server {
namespace {

using detail::Overloaded;

// Hello, auth and ping are answered by the session (server.cpp) before a request reaches the handler.
Error session_request() { return Error(ErrorCode::internal, "hello, auth and ping are the session's, not the handler's"); }

}  // namespace

// A thin mapping: the collection picks the path (batch kernel, one by one, pruned) itself.
wire::Reply Handler::query(const wire::Query& q) {
  const auto c = db_.collection(q.name);
  // A version-1 reply has no per-head fields: answering would pass head 0 off as the whole answer.
  if (q.decoded_version < 2 && c->config().heads > 1)
    throw Error(ErrorCode::unsupported, "collection '" + q.name + "' has " + std::to_string(c->config().heads) +
                                            " heads: querying a multi-head collection needs protocol version 2");
  if (q.kind == wire::QueryKind::hard) return wire::HardReply{c->query(q.queries, Retrieval::hard, q.options).hard};
  return wire::SoftReply{c->query(q.queries, Retrieval::soft, q.options).soft};
}

bool Handler::is_cheap(const wire::Request& request) const {
  if (forwarder_ != nullptr) return false;  // sharded: every request waits for the MPI dispatcher
  // Nothing here may wait: an I/O thread asks. So no collection lock (size_hint), and nothing that
  // takes the database's write lock (stats). A collection's lock is writer-first, so even a small
  // read could wait behind a writer that waits for a long scan: only small collections qualify,
  // whose scans (and so any such wait) are short.
  if (std::holds_alternative<wire::List>(request)) return true;
  const std::string* name = nullptr;
  std::size_t rows = 1;
  bool soft = false;
  if (const auto* q = std::get_if<wire::Query>(&request)) {
    name = &q->name;
    soft = q->kind == wire::QueryKind::soft;
    rows = q->queries.size();  // divided by d below
  } else if (const auto* g = std::get_if<wire::Get>(&request)) {
    name = &g->name;
  } else if (const auto* d = std::get_if<wire::Describe>(&request)) {
    name = &d->name;
  } else {
    return false;
  }
  try {
    const auto c = db_.collection(*name);
    const std::size_t d = c->config().dim, dv = c->config().value_dim;
    if (std::holds_alternative<wire::Query>(request)) rows = std::max<std::size_t>(1, rows / d);
    return c->size_hint() * (d + (soft ? dv : 0)) * rows <= kInlineFloats;
  } catch (const Error&) {
    return true;  // unknown collection: the error reply is cheap too
  }
}

wire::Reply Handler::handle(const wire::Request& request) {
  ++requests_;
  try {
    if (forwarder_ != nullptr) {
      if (std::holds_alternative<wire::Hello>(request) || std::holds_alternative<wire::Auth>(request) ||
          std::holds_alternative<wire::Ping>(request))
        throw session_request();
      wire::Reply reply = forwarder_->forward(request);
      if (auto* stats = std::get_if<wire::StatsReply>(&reply)) {  // the front end's own counters
        stats->connections = connections_.load();
        stats->requests = requests_.load();
      }
      return reply;
    }
    return std::visit(
        Overloaded{
            [](const wire::Hello&) -> wire::Reply { throw session_request(); },
            [](const wire::Auth&) -> wire::Reply { throw session_request(); },
            [](const wire::Ping&) -> wire::Reply { throw session_request(); },
            [&](const wire::Create& m) -> wire::Reply { return db_.create_collection(m.name, m.config), wire::Ack{}; },
            [&](const wire::Drop& m) -> wire::Reply { return db_.drop_collection(m.name), wire::Ack{}; },
            [&](const wire::List&) -> wire::Reply { return wire::NamesReply{db_.list_collections()}; },
            [&](const wire::Describe& m) -> wire::Reply { return wire::DescribeReply{db_.stats(m.name)}; },
            [&](const wire::QueryStats& m) -> wire::Reply { return wire::QueryStatsReply{db_.collection(m.name)->coalescing_stats()}; },
            [&](const wire::Add& m) -> wire::Reply { return wire::IdsReply{db_.add(m.name, m.keys, m.values, m.tags)}; },
            [&](const wire::Upsert& m) -> wire::Reply { return db_.upsert(m.name, m.ids, m.keys, m.values, m.tags), wire::Ack{}; },
            [&](const wire::Remove& m) -> wire::Reply { return db_.remove(m.name, m.ids), wire::Ack{}; },
            [&](const wire::Get& m) -> wire::Reply { return wire::GetReply{db_.collection(m.name)->get(m.id)}; },
            [&](const wire::Query& m) -> wire::Reply { return query(m); },
            [&](const wire::Snapshot&) -> wire::Reply { return db_.snapshot(), wire::Ack{}; },
            [&](const wire::Stats&) -> wire::Reply {
              return wire::StatsReply{kVersion, std::string(simd_path()), db_.list_collections().size(), connections_.load(),
                                      requests_.load(), db_.last_sequence()};
            },
        },
        request);
  } catch (...) {
    return current_error_reply();
  }
}

wire::ErrorReply current_error_reply() {
  detail::ErrorOf e = detail::error_of(std::current_exception());  // anything but an Error escaping the engine is a bug: said so, and the server keeps serving
  return wire::ErrorReply{e.code, std::move(e.message)};
}

}  // namespace softkv::server
