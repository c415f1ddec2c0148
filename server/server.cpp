// The Asio front end: one coroutine per connection on its own strand; requests run on a worker pool.
//
// A session reads top to bottom: next frame (FrameReader: the buffer, its growth and the limits) ->
// decode -> authorize (hello and auth are answered here and only here) -> answer -> send. The
// session's reads and writes carry no timers: it records what it is waiting for and since when, and a
// watchdog composed with it (serve || watch) closes the socket once that wait is over its limit.
// Ping, reads and small scans (Handler::is_cheap) are answered on the I/O thread; writes and large
// scans run on the workers, so a long scan never delays another connection's ping.
#include "server.hpp"

#include <sys/resource.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "frame_reader.hpp"
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

// An error the server itself raises (not a softkv::Error from the handler): the same "<code name>: "
// prefix as every other error message. No Error object is made: this also runs when the process is
// out of descriptors, where UBSan's check of a polymorphic object cannot open what it needs.
wire::ErrorReply error_reply(ErrorCode code, const std::string& text) {
  return wire::ErrorReply{code, std::string(to_string(code)) + ": " + text};
}

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

// How long a refused connection is read from (and discarded) before it is closed: a client still
// sending sees the error frame instead of a reset (closing with unread bytes sends a TCP RST).
constexpr auto kDrainTime = std::chrono::seconds(2);
// How long accept waits after running out of file descriptors, so it does not spin on the failure.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

bool out_of_descriptors(const boost::system::error_code& ec) {
  return ec == boost::system::errc::too_many_files_open || ec == boost::system::errc::too_many_files_open_in_system;
}

}  // namespace

bool is_loopback(std::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(std::string(host), ec);
  return !ec && address.is_loopback();
}

DescriptorLimit fit_descriptor_limit(ServerConfig& config) {
  DescriptorLimit out;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    out.max_connections = config.max_connections;
    return out;
  }
  out.soft_before = limit.rlim_cur;
  if (limit.rlim_cur != limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  out.soft = limit.rlim_cur;
  out.hard = limit.rlim_max;
  if (limit.rlim_cur != RLIM_INFINITY) {
    const std::uint64_t room = limit.rlim_cur > file_headroom(limit.rlim_cur) ? limit.rlim_cur - file_headroom(limit.rlim_cur) : 1;
    config.max_connections = static_cast<std::uint32_t>(std::min<std::uint64_t>(config.max_connections, room));
  }
  out.max_connections = config.max_connections;
  return out;
}

class Server::Impl {
 public:
  Impl(Database& db, ServerConfig config)
      : config_(std::move(config)),
        budget_(config_.max_pending_bytes),
        handler_(db, connections_, config_.forwarder),
        workers_(config_.workers > 0 ? config_.workers : std::max(kDefaultWorkers, std::thread::hardware_concurrency())),
        accept_strand_(asio::make_strand(io_)),
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
    spare_descriptor_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }

  ~Impl() {
    if (spare_descriptor_ >= 0) ::close(spare_descriptor_);
  }

  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  void run() {
    asio::co_spawn(accept_strand_, accept_loop(), asio::detached);
    std::vector<std::thread> threads;
    for (unsigned i = 1; i < std::max(1u, config_.io_threads); ++i) threads.emplace_back([this] { io_.run(); });
    io_.run();
    for (auto& t : threads) t.join();
    workers_.join();
  }

  void stop() {
    // On the accept loop's strand: closing the acceptor while another io thread starts the loop's next
    // accept on it is a data race (ThreadSanitizer saw one in a test's stop).
    asio::post(accept_strand_, [this] { begin_stop(); });
  }

 private:
  // One connection's state, shared between its session, its watchdog and stop(), all on its strand.
  struct Connection {
    explicit Connection(tcp::socket s) : socket(std::move(s)), watchdog(socket.get_executor()) {}
    // What the session waits for: each but `request` has a limit, counted from `since`.
    enum class Wait { idle, frame, reply, request, drain };
    tcp::socket socket;
    asio::steady_timer watchdog;
    Wait wait = Wait::idle;
    Clock::time_point since = Clock::now();
    Clock::time_point frame_started{};  // when the first byte of the pending partial frame arrived

    void waiting(Wait w, Clock::time_point from = Clock::now()) {
      wait = w;
      since = from;
    }
  };

  // A reply, and whether the connection closes after sending it.
  struct Answer {
    wire::Reply reply;
    bool close_after = false;
  };

  Clock::time_point deadline_of(const Connection& c) const {
    switch (c.wait) {
      case Connection::Wait::idle: return c.since + config_.idle_timeout;
      case Connection::Wait::frame: return c.since + config_.frame_deadline;
      case Connection::Wait::reply: return c.since + config_.reply_deadline;
      case Connection::Wait::drain: return c.since + kDrainTime;
      case Connection::Wait::request: break;
    }
    return Clock::time_point::max();  // the server is working on a request: no client limit applies
  }

  // Wakes at the current wait's deadline, or after a tick (a quarter of the shortest limit, 10 ms to
  // 1 s) if that is sooner, because the session moves between waits without touching the timer.
  // So a limit is enforced within one tick of its deadline, at no cost per request. Ends when the
  // socket is closed, or when the session ends first (the || in session() cancels the wait).
  awaitable<void> watch(Connection& c) {
    const auto shortest = std::min({config_.idle_timeout, config_.frame_deadline, config_.reply_deadline});
    const auto tick = std::clamp<Clock::duration>(shortest / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
    while (c.socket.is_open()) {
      c.watchdog.expires_at(std::min(deadline_of(c), Clock::now() + tick));
      const auto [ec] = co_await c.watchdog.async_wait(kNoThrow);
      // Cancelled: the session ended (its wait may have completed just before the cancellation came).
      const asio::cancellation_state cancel = co_await asio::this_coro::cancellation_state;
      if (ec == asio::error::operation_aborted || cancel.cancelled() != asio::cancellation_type::none) co_return;
      if (!c.socket.is_open() || Clock::now() < deadline_of(c)) continue;
      if (c.wait == Connection::Wait::frame) log("cut off a connection that did not finish a frame within the deadline");
      if (c.wait == Connection::Wait::reply) log("closing a connection that did not read its replies within the deadline");
      boost::system::error_code ignored;
      c.socket.close(ignored);  // the session's pending read or write fails, and it ends
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
        if (c->wait == Connection::Wait::idle || c->wait == Connection::Wait::frame || c->wait == Connection::Wait::drain) {
          boost::system::error_code ignored;
          c->socket.close(ignored);
        }
      });
  }

  awaitable<void> accept_loop() {
    asio::steady_timer backoff(io_);
    while (!stopping_) {
      auto [ec, socket] = co_await acceptor_.async_accept(asio::make_strand(io_), kNoThrow);
      if (ec) {
        if (stopping_ || ec == asio::error::operation_aborted) break;
        if (out_of_descriptors(ec)) refuse_without_descriptors();
        // The failed connection may still wait in the backlog: pause rather than fail again at once.
        backoff.expires_after(kAcceptBackoff);
        co_await backoff.async_wait(kNoThrow);
        continue;
      }
      if (connections_.load() >= config_.max_connections) {  // refused at once: a refusal holds no descriptor
        refuse_now(socket.native_handle());
        socket.close(ec);
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

  std::vector<std::byte> busy_frame() const {
    return wire::encode_reply(wire::Opcode::hello, 0,
                              error_reply(ErrorCode::server_busy, "the server is at its connection limit of " +
                                                               std::to_string(config_.max_connections)));
  }

  // One server_busy frame and a close, keeping no descriptor: the frame fits any fresh socket buffer,
  // and the bytes the client has already sent (its hello) are read first, so the close is a FIN
  // rather than a reset that could destroy the frame before the client reads it.
  void refuse_now(int fd) const {
    const auto busy = busy_frame();
    [[maybe_unused]] const auto sent = ::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(fd, SHUT_WR);
    std::array<char, 4096> sink;
    for (int i = 0; i < 16 && ::recv(fd, sink.data(), sink.size(), MSG_DONTWAIT) > 0; ++i) {
    }
  }

  // Out of descriptors: the spare one is given up so the waiting connections can be taken one at a
  // time, refused and closed; then the spare is taken back. Without this they would wait in the
  // backlog and their clients hang.
  void refuse_without_descriptors() {
    if (spare_descriptor_ < 0) return;
    ::close(spare_descriptor_);
    for (int i = 0; i < 64; ++i) {
      const int fd = ::accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;
      refuse_now(fd);
      ::close(fd);
    }
    spare_descriptor_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    log("out of file descriptors: refused waiting connections with server_busy");
  }

  // Sends one reply; false if the write failed (or the watchdog closed the socket at the reply deadline).
  awaitable<bool> send(Connection& c, std::span<const std::byte> bytes) {
    c.waiting(Connection::Wait::reply);
    auto [ec, n] = co_await asio::async_write(c.socket, asio::buffer(bytes.data(), bytes.size()), kNoThrow);
    co_return !ec;
  }

  // Sends a last frame, half-closes, and reads and discards until the client closes (or kDrainTime
  // passes): a client still sending a refused frame then reads the error instead of a reset.
  awaitable<void> drain_after(Connection& c, std::span<const std::byte> last) {
    const bool sent = co_await send(c, last);
    if (!sent) co_return;
    boost::system::error_code ignored;
    c.socket.shutdown(tcp::socket::shutdown_send, ignored);
    c.waiting(Connection::Wait::drain);
    std::array<std::byte, 16384> sink;
    for (;;) {
      auto [ec, n] = co_await c.socket.async_read_some(asio::buffer(sink), kNoThrow);
      if (ec || n == 0) co_return;
    }
  }

  awaitable<void> session(std::shared_ptr<Connection> c) {
    try {
      co_await (serve(*c) || watch(*c));
    } catch (const std::exception& e) {  // never let one connection take the server down
      log(std::string("connection error: ") + e.what());
    }
    boost::system::error_code ec;
    c->socket.close(ec);
    std::lock_guard lock(registry_mutex_);
    connections_set_.erase(c);
    --connections_;
  }

  // The next whole frame, reading as needed; Status::close with an empty reason when the peer (or
  // the watchdog) closed the connection.
  awaitable<FrameReader::Next> next_frame(Connection& c, FrameReader& reader) {
    if (reader.pending() > 0) c.frame_started = Clock::now();  // the next frame's clock starts as we resume reading
    for (;;) {
      FrameReader::Next next = reader.next();
      if (next.status != FrameReader::Status::need_more) co_return next;
      // An empty buffer waits up to the idle timeout; a started frame must finish by its deadline.
      const bool started = reader.pending() > 0;
      if (started) c.waiting(Connection::Wait::frame, c.frame_started);
      else c.waiting(Connection::Wait::idle);
      const auto space = reader.space();
      auto [ec, n] = co_await c.socket.async_read_some(asio::buffer(space.data(), space.size()), kNoThrow);
      if (ec || n == 0) co_return FrameReader::Next{FrameReader::Status::close, {}, ErrorCode::protocol_error, {}};
      if (!started) c.frame_started = Clock::now();
      reader.received(n);
    }
  }

  // Hello and auth belong to the session; everything else needs auth, then goes to the handler.
  // version is the connection's protocol version; a hello sets it for the requests that follow.
  awaitable<Answer> answer(Connection& c, const wire::Request& request, bool& authenticated, std::uint16_t& version) {
    if (const auto* hello = std::get_if<wire::Hello>(&request)) {
      version = wire::negotiate_version(hello->version);
      co_return Answer{wire::HelloReply{version, kVersion, !config_.auth_token.empty()}};
    }
    if (const auto* auth = std::get_if<wire::Auth>(&request)) {
      authenticated = config_.auth_token.empty() || constant_time_equal(auth->token, config_.auth_token);
      if (authenticated) co_return Answer{wire::Ack{}};
      co_return Answer{error_reply(ErrorCode::unauthenticated, "wrong auth token"), true};  // no guessing on an open connection
    }
    if (!authenticated)
      co_return Answer{error_reply(ErrorCode::unauthenticated, "this server requires auth before any request but hello")};
    if (std::holds_alternative<wire::Ping>(request)) co_return Answer{wire::Ack{}};
    if (handler_.is_cheap(request)) co_return Answer{handler_.handle(request)};  // small scans and reads: no thread hop
    c.waiting(Connection::Wait::request);
    wire::Reply reply = co_await asio::co_spawn(
        workers_, [&]() -> awaitable<wire::Reply> { co_return handler_.handle(request); }, asio::use_awaitable);
    co_return Answer{std::move(reply)};
  }

  awaitable<void> serve(Connection& c) {
    std::vector<std::byte> last;  // a refusal, sent once the reader's memory is released
    {
      bool authenticated = config_.auth_token.empty();
      std::uint16_t version = wire::kMinProtocolVersion;  // until a hello names another
      FrameReader reader(authenticated ? config_.max_frame : std::min(config_.max_frame, kUnauthenticatedMaxFrame), budget_);
      while (!stopping_) {
        const FrameReader::Next next = co_await next_frame(c, reader);
        if (next.status == FrameReader::Status::close) {
          if (!next.reason.empty()) last = wire::encode_reply(wire::Opcode::ping, 0, error_reply(next.code, next.reason));
          break;
        }
        const std::uint64_t id = next.frame.request_id;
        wire::Request request;
        try {
          request = wire::decode_request(next.frame, version);  // copies out of the buffer
        } catch (const Error& e) {  // unknown opcode or malformed payload: say why, then close
          last = wire::encode_reply(wire::Opcode::ping, id, wire::ErrorReply{e.code(), e.what()});
          break;
        }
        const bool was_authenticated = authenticated;
        const Answer a = co_await answer(c, request, authenticated, version);
        if (authenticated && !was_authenticated) reader.set_max_frame(config_.max_frame);
        // (Temporaries stay out of co_await expressions: GCC 12 may destroy them twice.)
        const std::vector<std::byte> bytes = wire::encode_reply(wire::opcode_of(request), id, a.reply, version);
        const bool sent = co_await send(c, bytes);
        if (!sent || a.close_after) co_return;
      }
    }
    if (!last.empty()) co_await drain_after(c, last);
  }

  ServerConfig config_;
  std::atomic<std::uint64_t> connections_{0};
  ReceiveBudget budget_;
  Handler handler_;
  asio::io_context io_;
  asio::thread_pool workers_;
  asio::strand<asio::io_context::executor_type> accept_strand_;  // the accept loop's and begin_stop's
  tcp::acceptor acceptor_;
  int spare_descriptor_ = -1;  // given up when accept runs out of descriptors (refuse_without_descriptors)
  std::atomic<bool> stopping_{false};
  std::mutex registry_mutex_;
  std::set<std::shared_ptr<Connection>> connections_set_;
};

Server::Server(Database& db, ServerConfig config) : impl_(std::make_unique<Impl>(db, config)) {
  if (config.port_file.empty()) return;
  // Written whole under a temporary name and renamed: a reader polling for the file never sees a part.
  const std::filesystem::path path(config.port_file), temp = path.string() + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << port() << '\n';
    out.close();
    if (!out) throw Error(ErrorCode::io_error, "cannot write the port file " + temp.string());
  }
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot rename " + temp.string() + " to " + path.string() + ": " + ec.message());
}
Server::~Server() = default;
std::uint16_t Server::port() const { return impl_->port(); }
void Server::run() { impl_->run(); }
void Server::stop() { impl_->stop(); }

}  // namespace softkv::server
