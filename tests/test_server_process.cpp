// The real softkv-server process: kill -9 during acknowledged writes, and abuse from many sockets.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "reference.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"
#include "wire/protocol.hpp"

extern char** environ;

using namespace softkv;
using namespace std::chrono_literals;

namespace {

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// softkv-server as a child process on a free port; waits until it accepts connections.
struct ServerProcess {
  pid_t pid = 0;
  std::uint16_t port = 0;
  ServerProcess(const std::filesystem::path& data, std::vector<std::string> extra = {}) {
    port = free_port();
    std::vector<std::string> args = {SOFTKV_SERVER_BIN, "--data", data.string(), "--port", std::to_string(port)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
    REQUIRE(posix_spawn(&pid, SOFTKV_SERVER_BIN, &actions, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&actions);
    for (int i = 0; i < 200; ++i) {
      try {
        Client probe({"127.0.0.1", port});
        return;
      } catch (const Error&) {
        std::this_thread::sleep_for(25ms);
      }
    }
    FAIL("softkv-server did not start listening");
  }
  ~ServerProcess() {
    if (pid > 0) stop(SIGTERM);
  }
  int stop(int sig) {
    ::kill(pid, sig);
    int status = 0;
    ::waitpid(pid, &status, 0);
    pid = 0;
    return status;
  }
  [[nodiscard]] ClientOptions client() const { return {"127.0.0.1", port}; }
  // Resident memory of the server process, in KiB.
  [[nodiscard]] long rss_kib() const {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    return -1;
  }
};

int connect_raw(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

std::vector<float> key_of(std::uint64_t id) { return {float(id), 1.0f, -float(id % 13)}; }
std::vector<float> value_of(std::uint64_t id) { return {float(id) / 7.0f}; }

// p99 of n pings paced 1 ms apart (about n ms of wall time), so a momentary burst on the server --
// such as 200 slow senders delivering their byte of the second at once -- touches only a ping or two
// instead of deciding the percentile of a few milliseconds' sample.
double p99_ping_ms(Client& c, int n) {
  std::vector<double> ms;
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_for(1ms);
    const auto t0 = std::chrono::steady_clock::now();
    c.ping();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[std::size_t(n * 0.99)];
}

}  // namespace

TEST_CASE("kill -9 of the server loses no acknowledged write", "[server][crash]") {
  std::mt19937_64 rng(11);
  std::size_t acked_total = 0;
  for (int trial = 0; trial < 10; ++trial) {
    test::TempDir dir;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> acked;  // [first, last] of acknowledged batches
    std::pair<std::uint64_t, std::uint64_t> in_flight{1, 0};
    {
      ServerProcess server(dir.path, {"--fsync", "always"});
      Client(server.client()).create_collection("c", {3, 1, Metric::dot, {}, {}});
      std::atomic<bool> done{false};
      std::thread writer([&] {
        try {
          Client c(server.client());
          for (std::uint64_t next = 0;; ) {
            const std::uint64_t n = 1 + next % 4;
            std::vector<std::uint64_t> ids;
            std::vector<float> keys, values;
            for (std::uint64_t id = next; id < next + n; ++id) {
              ids.push_back(id);
              const auto k = key_of(id), v = value_of(id);
              keys.insert(keys.end(), k.begin(), k.end());
              values.insert(values.end(), v.begin(), v.end());
            }
            in_flight = {next, next + n - 1};
            c.upsert("c", ids, keys, values);
            acked.push_back(in_flight);
            next += n;
          }
        } catch (const Error&) {  // the server died under us
        }
        done = true;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 250));
      const int status = server.stop(SIGKILL);
      CHECK(WIFSIGNALED(status));
      writer.join();
    }
    ServerProcess again(dir.path);
    Client c(again.client());
    for (const auto& [a, b] : acked)
      for (std::uint64_t id = a; id <= b; ++id) {
        INFO("trial " << trial << ", acknowledged id " << id);
        const Entry e = c.get("c", id);
        CHECK(e.key == key_of(id));
        CHECK(e.value == value_of(id));
      }
    std::size_t present = 0;  // the batch in flight at the kill: all or nothing
    for (std::uint64_t id = in_flight.first; id <= in_flight.second; ++id) {
      try {
        (void)c.get("c", id);
        ++present;
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::unknown_id);
      }
    }
    CHECK((present == 0 || present == in_flight.second - in_flight.first + 1));
    acked_total += acked.size();
  }
  WARN("server kill -9: 10 trials, " << acked_total << " acknowledged batches, 0 lost");  // figure for RELIABILITY.md
  CHECK(acked_total > 0);
}

TEST_CASE("abuse: slow senders are cut off without hurting a normal client", "[server][abuse][timing]") {
  test::TempDir dir;
  ServerProcess server(dir.path, {"--frame-deadline", "2", "--fsync", "never"});
  Client normal(server.client());
  // One attempt: the normal client's ping p99 alone, then while 200 connections send one byte a second
  // (the first byte starts each one's frame clock); then every slow connection must have been closed.
  // On a shared 2-core VM a single p99 can be hit by a neighbour's burst, so the latency bound may take
  // up to three attempts; a server that really stalls behind slow senders fails all of them, and the
  // cut-off and the hard stall bound are checked on every attempt.
  struct Attempt {
    double unloaded, loaded;
    int closed;
  };
  auto attempt = [&] {
    Attempt a{};
    a.unloaded = p99_ping_ms(normal, 600);
    std::vector<int> slow;
    for (int i = 0; i < 200; ++i) slow.push_back(connect_raw(server.port));
    std::atomic<bool> stop{false};
    std::thread trickle([&] {
      for (int second = 0; !stop && second < 10; ++second) {
        for (int fd : slow) {
          const std::byte b{0x10};
          ::send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        for (int i = 0; i < 10 && !stop; ++i) std::this_thread::sleep_for(100ms);
      }
    });
    std::this_thread::sleep_for(200ms);
    a.loaded = p99_ping_ms(normal, 1000);  // ~1.2 s: inside the 2 s before the cut-off, spanning a burst
    std::this_thread::sleep_for(3500ms);   // the deadline (2 s) plus a margin
    stop = true;
    trickle.join();
    for (int fd : slow) {
      char buf[64];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) {
      }
      a.closed += n == 0;
      ::close(fd);
    }
    return a;
  };
  auto within = [](const Attempt& a) { return a.loaded <= 2 * a.unloaded + 0.2; };  // 0.2 ms: timer resolution
  Attempt last{};  // the attempt that met the bound, or the third
  for (int i = 0; i < 3; ++i) {
    const Attempt a = attempt();
    WARN("200 slow senders, attempt " << i + 1 << ": ping p99 " << a.unloaded << " ms unloaded, " << a.loaded
                                      << " ms loaded; " << a.closed << " cut off");
    CHECK(a.closed == 200);
    CHECK(a.loaded < 100);  // never stalled anywhere near the frame deadline, in any build
    last = a;
    if (within(a)) break;
  }
  CHECK(within(last));
  normal.ping();
}

TEST_CASE("abuse: 4 GiB length prefixes are refused without memory growth", "[server][abuse]") {
  test::TempDir dir;
  ServerProcess server(dir.path, {"--fsync", "never"});
  Client(server.client()).ping();
  const long before = server.rss_kib();
  for (int i = 0; i < 20; ++i) {
    const int fd = connect_raw(server.port);
    const std::byte huge[4] = {std::byte{0xFF}, std::byte{0xFF}, std::byte{0xFF}, std::byte{0xFF}};
    ::send(fd, huge, 4, MSG_NOSIGNAL);
    std::vector<std::byte> reply(64);
    std::size_t got = 0;
    for (ssize_t n; (n = ::recv(fd, reply.data() + got, reply.size() - got, 0)) > 0;) got += std::size_t(n);
    REQUIRE(got >= 13);
    CHECK(static_cast<std::uint8_t>(reply[4]) == wire::kErrorOpcode);
    std::uint16_t code;
    std::memcpy(&code, reply.data() + 13, 2);
    CHECK(code == static_cast<std::uint16_t>(ErrorCode::frame_too_large));
    ::close(fd);
  }
  const long after = server.rss_kib();
  WARN("20 frames claiming 4 GiB: server RSS " << before << " KiB -> " << after << " KiB");
  CHECK(after - before < 1024);
}

TEST_CASE("abuse: random garbage on many sockets never takes the server down", "[server][abuse]") {
  test::TempDir dir;
  ServerProcess server(dir.path, {"--fsync", "never", "--frame-deadline", "1"});
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    const int fd = connect_raw(server.port);
    std::vector<std::byte> junk(1 + rng() % 512);
    for (auto& b : junk) b = std::byte(rng());
    if (i % 3 == 0) {  // sometimes a plausible small length first, so the body is parsed
      const std::uint32_t len = 9 + std::uint32_t(rng() % 64);
      std::memcpy(junk.data(), &len, std::min<std::size_t>(4, junk.size()));
    }
    ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    ::close(fd);
  }
  Client c(server.client());
  c.ping();
  CHECK(c.stats().requests >= 0);
  CHECK(server.stop(SIGTERM) == 0);  // and it still shuts down cleanly
}
