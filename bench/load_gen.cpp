// load_gen: closed-loop load on softkv-server over loopback — queries/s and p50/p99 latency.
//
// One thread runs an epoll loop over --connections non-blocking connections, the same client model
// as redis-benchmark, so the two are compared at equal client cost. Each connection sends a hard
// query (the store's GET: one key in, one value out) -- or with --op ping the bare round trip -- as
// soon as the previous answer has fully arrived, for --seconds.
// --setup creates the collection first (N = 1,000, d = 128 by default).
#include <CLI/CLI.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "softkv/softkv.hpp"
#include "wire/protocol.hpp"

namespace {

using Clock = std::chrono::steady_clock;

int connect_nonblocking(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("cannot connect");
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// One connection's request in flight: when it was sent and how much of the reply has arrived.
struct Conn {
  int fd = -1;
  Clock::time_point sent;
  std::vector<std::byte> reply;  // the reply so far
};

void send_all(int fd, const std::vector<std::byte>& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {  // a small request fits the socket buffer: this never loops in practice
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) throw std::runtime_error("send failed");
    done += std::size_t(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"load_gen: closed-loop hard queries against softkv-server"};
  std::uint16_t port = 7878;
  std::size_t connections = 16, n = 1000, d = 128;
  double seconds = 5;
  bool setup = false;
  std::string op = "hard";
  app.add_option("--port", port);
  app.add_option("--connections", connections);
  app.add_option("--seconds", seconds);
  app.add_option("--n", n, "entries (with --setup)");
  app.add_option("--d", d, "dimension (with --setup)");
  app.add_flag("--setup", setup, "create and fill the collection 'load' first");
  app.add_option("--op", op, "hard or soft (one query per request) or ping (the round trip alone)")
      ->check(CLI::IsMember({"hard", "soft", "ping"}));
  CLI11_PARSE(app, argc, argv);
  const softkv::ClientOptions options{"127.0.0.1", port};
  {
    softkv::Client c(options);
    if (setup) {
      if (c.list_collections().empty()) c.create_collection("load", {d, d, softkv::Metric::dot, {}, {}});
      // In pieces of at most 32 MiB of floats, under the server's 64 MiB frame limit.
      const std::size_t rows = std::max<std::size_t>(1, (32u << 20) / (8 * d));
      for (std::size_t at = 0; at < n; at += rows) {
        const std::size_t m = std::min(rows, n - at);
        c.add("load", softkv::bench::uniform_floats(m * d, 1 + at), softkv::bench::uniform_floats(m * d, 2 + at));
      }
    }
    if (op != "ping") d = c.describe("load").dim;
  }
  // Each connection sends its own query (soft at temperature 1, or hard), over and over.
  auto frame_for = [&](std::size_t i) {
    softkv::wire::Request request = softkv::wire::Ping{};
    if (op != "ping")
      request = softkv::wire::Query{"load", op == "hard" ? softkv::wire::QueryKind::hard : softkv::wire::QueryKind::soft, {},
                                    softkv::bench::uniform_floats(d, 100 + i)};
    return softkv::wire::encode_request(request, 1);
  };

  const int ep = ::epoll_create1(0);
  std::vector<Conn> conns(connections);
  for (std::size_t i = 0; i < connections; ++i) {
    conns[i].fd = connect_nonblocking(port);
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.u64 = i;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &e);
  }
  std::vector<double> latencies;
  latencies.reserve(std::size_t(seconds * 200000));
  std::size_t errors = 0;
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::vector<std::byte>> frames;
  for (std::size_t i = 0; i < connections; ++i) frames.push_back(frame_for(i));
  for (std::size_t i = 0; i < connections; ++i) {
    conns[i].sent = Clock::now();
    send_all(conns[i].fd, frames[i]);
  }
  std::vector<epoll_event> events(connections);
  std::byte buf[65536];
  while (Clock::now() < until) {
    const int ready = ::epoll_wait(ep, events.data(), int(events.size()), 100);
    for (int k = 0; k < ready; ++k) {
      Conn& c = conns[events[k].data.u64];
      const ssize_t got = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (got <= 0) throw std::runtime_error("the server closed a connection");
      c.reply.insert(c.reply.end(), buf, buf + got);
      if (c.reply.size() < softkv::wire::kLengthPrefix) continue;
      std::uint32_t length;
      std::memcpy(&length, c.reply.data(), 4);
      if (c.reply.size() < softkv::wire::kLengthPrefix + length) continue;
      const auto now = Clock::now();  // one reply is whole (closed loop: never more than one)
      latencies.push_back(std::chrono::duration<double, std::micro>(now - c.sent).count());
      errors += static_cast<std::uint8_t>(c.reply[4]) == softkv::wire::kErrorOpcode;
      c.reply.clear();
      c.sent = now;
      send_all(c.fd, frames[events[k].data.u64]);
    }
  }
  for (auto& c : conns) ::close(c.fd);
  ::close(ep);
  if (latencies.empty() || errors > 0) {
    std::fprintf(stderr, "load_gen: %zu replies, %zu of them errors\n", latencies.size(), errors);
    return 1;
  }
  std::sort(latencies.begin(), latencies.end());
  std::printf("softkv %s: connections %zu, %.1f requests/s, p50 %.1f us, p99 %.1f us\n",
              op == "ping" ? "ping" : op == "hard" ? "hard query" : "soft query", connections,
              double(latencies.size()) / seconds, latencies[latencies.size() / 2],
              latencies[std::min(latencies.size() - 1, latencies.size() * 99 / 100)]);
  return 0;
}
