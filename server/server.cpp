// The Asio front end: one coroutine per connection on its own strand; requests run on a worker pool.
//
// A session reads top to bottom: wait (idle timeout) for a frame's first byte, read the rest under
// the frame deadline, check the length before allocating, decode, answer (under the reply deadline).
// The session's reads and writes carry no timers: it records what it is waiting for and since when,
// and a watchdog on the same strand closes the socket once that wait is over its limit.
// Hello, auth, ping, reads and small scans (Handler::is_cheap) are answered on the I/O thread;
// writes and large scans run on the workers, so a long scan never delays another connection's ping.
#include "server.hpp"

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "handler.hpp"
#include "softkv/error.hpp"
#include "softkv/version.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;

namespace {

constexpr auto kNoThrow = asio::as_tuple(asio::use_awaitable);
using Clock = std::chrono::steady_clock;

// Compares every byte whatever the first mismatch, so timing does not reveal a matching prefix.
bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = static_cast<unsigned char>(a.size() != b.size());
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

// Writes all of bytes unless `until` passes first (for the one-shot refusal, which has no session).
awaitable<void> write_until(tcp::socket& socket, std::span<const std::byte> bytes, Clock::time_point until) {
  asio::steady_timer timer(socket.get_executor(), until);
  co_await (asio::async_write(socket, asio::buffer(bytes.data(), bytes.size()), kNoThrow) || timer.async_wait(kNoThrow));
}

// Receive buffers start small (many idle connections cost little) and grow only to hold a frame whose
// length has already passed the limit check; a buffer grown past kKeepBuffer is released afterwards.
constexpr std::size_t kInitialBuffer = 4096;
constexpr std::size_t kKeepBuffer = 1 << 20;

}  // namespace

bool is_loopback(std::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(std::string(host), ec);
  return !ec && address.is_loopback();
}

class Server::Impl {
 public:
  Impl(Database& db, ServerConfig config)
      : config_(std::move(config)),
        handler_(db, connections_),
        workers_(config_.workers > 0 ? config_.workers : std::max(1u, std::thread::hardware_concurrency())),
        acceptor_(io_) {
    if (!is_loopback(config_.host) && config_.auth_token.empty() && !config_.insecure)
      throw Error(ErrorCode::invalid_argument, "binding " + config_.host +
                                                   " (not loopback) needs an auth token; pass --insecure to serve it without one");
    boost::system::error_code ec;
    tcp::resolver resolver(io_);
    const auto endpoints = resolver.resolve(config_.host, std::to_string(config_.port), ec);
    if (ec || endpoints.empty()) throw Error(ErrorCode::io_error, "cannot resolve " + config_.host + ": " + ec.message());
    const tcp::endpoint endpoint = endpoints.begin()->endpoint();
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) throw Error(ErrorCode::io_error, "cannot listen on " + config_.host + ":" + std::to_string(config_.port) + ": " + ec.message());
  }

  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  void run() {
    asio::co_spawn(io_, accept_loop(), asio::detached);
    std::vector<std::thread> threads;
    for (unsigned i = 1; i < std::max(1u, config_.io_threads); ++i) threads.emplace_back([this] { io_.run(); });
    io_.run();
    for (auto& t : threads) t.join();
    workers_.join();
  }

  void stop() {
    asio::post(io_, [this] { begin_stop(); });
  }

 private:
  // One connection's state, shared between its session, its watchdog and stop(), all on its strand.
  struct Connection {
    explicit Connection(tcp::socket s) : socket(std::move(s)), watchdog(socket.get_executor()) {}
    // What the session waits for: each but `request` has a limit, counted from `since`.
    enum class Wait { idle, frame, reply, request };
    tcp::socket socket;
    asio::steady_timer watchdog;
    Wait wait = Wait::idle;
    Clock::time_point since = Clock::now();

    void waiting(Wait w, Clock::time_point from = Clock::now()) {
      wait = w;
      since = from;
    }
  };

  Clock::time_point deadline_of(const Connection& c) const {
    switch (c.wait) {
      case Connection::Wait::idle: return c.since + config_.idle_timeout;
      case Connection::Wait::frame: return c.since + config_.frame_deadline;
      case Connection::Wait::reply: return c.since + config_.reply_deadline;
      case Connection::Wait::request: break;
    }
    return Clock::time_point::max();  // the server is working on a request: no client limit applies
  }

  // Wakes at the current wait's deadline, or after a tick (a quarter of the shortest limit, 10 ms to
  // 1 s) if that is sooner, because the session moves between waits without touching the timer.
  // So a limit is enforced within one tick of its deadline, at no cost per request.
  awaitable<void> watch(std::shared_ptr<Connection> c) {
    const auto shortest = std::min({config_.idle_timeout, config_.frame_deadline, config_.reply_deadline});
    const auto tick = std::clamp<Clock::duration>(shortest / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
    while (c->socket.is_open()) {
      c->watchdog.expires_at(std::min(deadline_of(*c), Clock::now() + tick));
      co_await c->watchdog.async_wait(kNoThrow);
      if (!c->socket.is_open() || Clock::now() < deadline_of(*c)) continue;
      if (c->wait == Connection::Wait::frame) log("cut off a connection that did not finish a frame within the deadline");
      if (c->wait == Connection::Wait::reply) log("closing a connection that did not read its replies within the deadline");
      boost::system::error_code ignored;
      c->socket.close(ignored);  // the session's pending read or write fails, and it ends
    }
  }

  void log(const std::string& line) const {
    if (config_.log) config_.log(line);
  }

  void begin_stop() {
    stopping_ = true;
    boost::system::error_code ec;
    acceptor_.close(ec);
    std::lock_guard lock(registry_mutex_);
    for (const auto& c : connections_set_)
      asio::post(c->socket.get_executor(), [c] {
        // A connection waiting to read is woken by the close; one working on a request, or handing
        // over its reply, finishes that first and then leaves (the session loop checks stopping_).
        if (c->wait == Connection::Wait::idle || c->wait == Connection::Wait::frame) {
          boost::system::error_code ignored;
          c->socket.close(ignored);
        }
      });
  }

  awaitable<void> accept_loop() {
    while (!stopping_) {
      auto [ec, socket] = co_await acceptor_.async_accept(asio::make_strand(io_), kNoThrow);
      if (ec) {
        if (stopping_ || ec == asio::error::operation_aborted) break;
        continue;  // e.g. too many open files: keep serving the connections we have
      }
      if (connections_.load() >= config_.max_connections) {
        asio::co_spawn(socket.get_executor(), refuse(std::move(socket)), asio::detached);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      ++connections_;
      auto c = std::make_shared<Connection>(std::move(socket));
      {
        std::lock_guard lock(registry_mutex_);
        connections_set_.insert(c);
      }
      asio::co_spawn(c->socket.get_executor(), session(c), asio::detached);
    }
  }

  // Beyond the connection limit: one error frame, then close.
  awaitable<void> refuse(tcp::socket socket) {
    const auto bytes = wire::encode_reply(wire::Opcode::hello, 0,
                                          wire::ErrorReply{ErrorCode::server_busy, "the server is at its connection limit of " +
                                                                                       std::to_string(config_.max_connections)});
    co_await write_until(socket, bytes, Clock::now() + config_.reply_deadline);
    boost::system::error_code ec;
    socket.close(ec);
  }

  // Sends one reply; false if the write failed (or the watchdog closed the socket at the reply deadline).
  awaitable<bool> send(Connection& c, std::span<const std::byte> bytes) {
    c.waiting(Connection::Wait::reply);
    auto [ec, n] = co_await asio::async_write(c.socket, asio::buffer(bytes.data(), bytes.size()), kNoThrow);
    co_return !ec;
  }

  awaitable<void> session(std::shared_ptr<Connection> c) {
    asio::co_spawn(c->socket.get_executor(), watch(c), asio::detached);
    try {
      co_await serve(*c);
    } catch (const std::exception& e) {  // never let one connection take the server down
      log(std::string("connection error: ") + e.what());
    }
    boost::system::error_code ec;
    c->socket.close(ec);
    c->watchdog.cancel();
    std::lock_guard lock(registry_mutex_);
    connections_set_.erase(c);
    --connections_;
  }

  // Sends an error reply for a frame that cannot be served; the caller then closes the connection.
  awaitable<void> refuse_frame(Connection& c, std::uint64_t id, ErrorCode code, const std::string& message) {
    const auto bytes = wire::encode_reply(wire::Opcode::ping, id, wire::ErrorReply{code, message});
    co_await send(c, bytes);
  }

  awaitable<void> serve(Connection& c) {
    bool authenticated = config_.auth_token.empty();
    // Unconsumed bytes are buffer[begin, end): whole frames are cut out of it with the codec, so one
    // read can carry several pipelined requests and a request costs one read, not three.
    std::vector<std::byte> buffer(kInitialBuffer);
    std::size_t begin = 0, end = 0;
    Clock::time_point frame_started{};  // when the first byte of the pending partial frame arrived
    while (!stopping_) {
      const wire::FrameScan scan = wire::scan_frame(std::span(buffer).subspan(begin, end - begin), config_.max_frame);
      if (scan.status == wire::FrameScan::Status::too_large) {  // decided from the 4-byte prefix: nothing allocated
        co_await refuse_frame(c, 0, ErrorCode::frame_too_large, "frame of " + std::to_string(scan.claimed) +
                                                                    " bytes exceeds the limit of " + std::to_string(config_.max_frame));
        co_return;
      }
      if (scan.status == wire::FrameScan::Status::malformed) {
        co_await refuse_frame(c, 0, ErrorCode::protocol_error, "frame too short");
        co_return;
      }
      if (scan.status == wire::FrameScan::Status::need_more) {
        if (begin > 0) {  // move the partial frame to the front
          std::memmove(buffer.data(), buffer.data() + begin, end - begin);
          end -= begin;
          begin = 0;
        }
        const std::size_t want = scan.claimed > 0 ? wire::kLengthPrefix + scan.claimed : wire::kLengthPrefix;
        if (buffer.size() < want) buffer.resize(want);
        if (end == buffer.size()) buffer.resize(buffer.size() * 2);
        // An empty buffer waits up to the idle timeout; a started frame must finish by its deadline.
        if (end == 0) c.waiting(Connection::Wait::idle);
        else c.waiting(Connection::Wait::frame, frame_started);
        auto [ec, n] = co_await c.socket.async_read_some(asio::buffer(buffer.data() + end, buffer.size() - end), kNoThrow);
        if (ec || n == 0) co_return;  // closed by the client, or by the watchdog
        if (end == 0) frame_started = Clock::now();
        end += n;
        continue;
      }
      const std::uint64_t id = scan.frame.request_id;
      wire::Request request;
      std::vector<std::byte> refusal;
      try {
        request = wire::decode_request(scan.frame);  // copies out of the buffer
      } catch (const Error& e) {  // unknown opcode or malformed payload: say why, then close
        refusal = wire::encode_reply(wire::Opcode::ping, id, wire::ErrorReply{e.code(), e.what()});
      }
      if (!refusal.empty()) {
        co_await send(c, refusal);
        co_return;
      }
      begin += scan.size;
      if (begin == end) {
        begin = end = 0;
        if (buffer.size() > kKeepBuffer) buffer = std::vector<std::byte>(kInitialBuffer);  // a large frame is done
      } else {
        frame_started = Clock::now();  // the next frame's bytes are already here
      }
      const wire::Opcode op = wire::opcode_of(request);
      wire::Reply reply;
      bool close_after = false;
      if (op == wire::Opcode::hello) {
        reply = wire::HelloReply{wire::kProtocolVersion, kVersion, !config_.auth_token.empty()};
      } else if (op == wire::Opcode::auth) {
        authenticated = config_.auth_token.empty() || constant_time_equal(std::get<wire::Auth>(request).token, config_.auth_token);
        if (authenticated) {
          reply = wire::Ack{};
        } else {
          reply = wire::ErrorReply{ErrorCode::unauthenticated, "wrong auth token"};
          close_after = true;  // no guessing on an open connection
        }
      } else if (!authenticated) {
        reply = wire::ErrorReply{ErrorCode::unauthenticated, "this server requires auth before any request but hello"};
      } else if (op == wire::Opcode::ping) {
        reply = wire::Ack{};
      } else if (handler_.is_cheap(request)) {  // small scans and reads: no thread hop
        reply = handler_.handle(request);
      } else {
        c.waiting(Connection::Wait::request);
        reply = co_await asio::co_spawn(
            workers_, [&]() -> awaitable<wire::Reply> { co_return handler_.handle(request); }, asio::use_awaitable);
      }
      const auto bytes = wire::encode_reply(op, id, reply);
      if (!co_await send(c, bytes) || close_after) co_return;
    }
  }

  ServerConfig config_;
  std::atomic<std::uint64_t> connections_{0};
  Handler handler_;
  asio::io_context io_;
  asio::thread_pool workers_;
  tcp::acceptor acceptor_;
  std::atomic<bool> stopping_{false};
  std::mutex registry_mutex_;
  std::set<std::shared_ptr<Connection>> connections_set_;
};

Server::Server(Database& db, ServerConfig config) : impl_(std::make_unique<Impl>(db, std::move(config))) {}
Server::~Server() = default;
std::uint16_t Server::port() const { return impl_->port(); }
void Server::run() { impl_->run(); }
void Server::stop() { impl_->stop(); }

}  // namespace softkv::server
