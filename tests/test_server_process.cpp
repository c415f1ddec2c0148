// The real softkv-server process: kill -9 during acknowledged writes, and abuse from many sockets.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "errors.hpp"
#include "port_file.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"
#include "temp_dir.hpp"
#include "wire/protocol.hpp"

extern char** environ;

using namespace softkv;
using namespace std::chrono_literals;

namespace {

using test::new_port_file;
using test::read_port_file;

// softkv-server as a child process on a free port; waits until it accepts connections.
// With nofile > 0 the child runs under RLIMIT_NOFILE nofile:nofile (soft and hard), as `ulimit -n`
// would leave it; with a log path its output goes there (else to /dev/null).
struct ServerProcess {
  pid_t pid = 0;
  std::uint16_t port = 0;
  ServerProcess(const std::filesystem::path& data, std::vector<std::string> extra = {}, rlim_t nofile = 0,
                const std::filesystem::path& log = "/dev/null") {
    const std::filesystem::path port_file = new_port_file();
    std::vector<std::string> args = {SOFTKV_SERVER_BIN, "--data", data.string(), "--port", "0", "--port-file", port_file.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log_path = log.string();
    pid = ::fork();  // fork + exec rather than posix_spawn: the child sets its own limit first
    REQUIRE(pid >= 0);
    if (pid == 0) {  // only async-signal-safe calls from here to exec
      const int out = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(out, STDERR_FILENO);
      if (nofile > 0) {
        const rlimit limit{nofile, nofile};
        ::setrlimit(RLIMIT_NOFILE, &limit);
      }
      ::execve(SOFTKV_SERVER_BIN, argv.data(), environ);
      ::_exit(127);
    }
    for (int i = 0; i < 1200; ++i) {  // 30 s: under ctest -j2 next to mpirun jobs a start (or a log replay) can take seconds
      if (const auto p = read_port_file(port_file)) {
        port = *p;
        std::filesystem::remove(port_file);
        return;
      }
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {  // it exited (cannot bind, bad data): fail now
        pid = 0;
        FAIL("softkv-server exited before listening");
      }
      std::this_thread::sleep_for(25ms);
    }
    ::kill(pid, SIGKILL);  // the destructor will not run after a throwing constructor: leave no server behind
    ::waitpid(pid, nullptr, 0);
    pid = 0;
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
  // CPU time (user + system) the server process has used, in seconds.
  [[nodiscard]] double cpu_seconds() const {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    std::istringstream fields(text.substr(text.rfind(')') + 2));  // after "pid (comm) "
    std::string field;
    double ticks = 0;
    for (int i = 3; fields >> field && i <= 15; ++i)
      if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
    return ticks / double(::sysconf(_SC_CLK_TCK));
  }
  // Resident memory of the server process, in KiB.
  [[nodiscard]] long rss_kib() const {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    return -1;
  }
};

// Runs softkv-server with `args` (after the binary) to its exit, output to `log`; its wait status
// (killed after 10 s if it is still running: a start that should have been refused).
int exit_status_of(const std::vector<std::string>& args, const std::filesystem::path& log) {
  std::vector<std::string> all = {SOFTKV_SERVER_BIN};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log_path = log.string();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int out = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(out, STDERR_FILENO);
    ::execve(SOFTKV_SERVER_BIN, argv.data(), environ);
    ::_exit(127);
  }
  int status = 0;
  for (int i = 0; i < 400 && ::waitpid(pid, &status, WNOHANG) == 0; ++i) std::this_thread::sleep_for(25ms);
  if (!WIFEXITED(status)) ::kill(pid, SIGKILL), ::waitpid(pid, &status, 0);
  return status;
}

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

TEST_CASE("softkv-server writes the port it bound to --port-file whole, and an unwritable path refuses the start", "[server]") {
  test::TempDir dir;
  std::filesystem::create_directories(dir.path);
  {
    ServerProcess server(dir.path / "data");  // started with --port 0 --port-file: the port read from the file
    REQUIRE(server.port != 0);
    Client c(server.client());  // the server this test started listens there (its collection list is empty)
    CHECK(c.list_collections().empty());
    c.create_collection("mine", {4, 4, Metric::dot, {}, {}});
    CHECK(c.list_collections() == std::vector<std::string>{"mine"});
  }
  const auto log = dir.path / "refused.log";
  const int status = exit_status_of({"--data", (dir.path / "data").string(), "--port", "0", "--port-file",
                                     (dir.path / "no-such-dir" / "port").string()}, log);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("cannot write the port file") != std::string::npos);
}

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

// Under AddressSanitizer (scripts/sanitize.sh asan builds the server the same way) freed blocks stay
// in its quarantine, so the server's RSS no longer follows what it holds, and a failed allocation
// aborts instead of throwing: the memory bounds (and allocation failure) are checked in the plain
// build only (or, where a 4 GiB allocation is the fault, with a bound
// that still catches it); every other check runs in both.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeasuresTheServer = false;
#else
constexpr bool kRssMeasuresTheServer = true;
#endif

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
  CHECK(after - before < (kRssMeasuresTheServer ? 1024 : 64 * 1024));  // ASan: quarantine, not buffers
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

namespace {

// The frame waiting on fd, if one arrives within the time; nullopt if the connection closed (or reset) or nothing came.
std::optional<std::vector<std::byte>> frame_from(int fd, std::chrono::milliseconds within) {
  std::vector<std::byte> bytes;
  const auto until = std::chrono::steady_clock::now() + within;
  for (;;) {
    if (bytes.size() >= 4) {
      std::uint32_t length;
      std::memcpy(&length, bytes.data(), 4);
      if (bytes.size() >= 4 + std::size_t(length)) return bytes;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) return std::nullopt;
    std::byte buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return std::nullopt;
    bytes.insert(bytes.end(), buf, buf + n);
  }
}

// Whether the peer has closed fd (EOF or reset) within the time.
bool closed_within(int fd, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) return false;
    std::byte buf[4096];
    if (::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
}

// What a connection that said hello got: a hello reply, server_busy, a prompt close, or nothing (a hang).
enum class Greeting { hello, busy, closed, hang };
Greeting greeting_of(int fd) {
  const auto f = frame_from(fd, 3s);
  if (!f) return closed_within(fd, 1s) ? Greeting::closed : Greeting::hang;
  if (static_cast<std::uint8_t>((*f)[4]) == (static_cast<std::uint8_t>(wire::Opcode::hello) | wire::kReplyBit)) return Greeting::hello;
  std::uint16_t code = 0;
  if (f->size() >= 15) std::memcpy(&code, f->data() + 13, 2);
  return code == static_cast<std::uint16_t>(ErrorCode::server_busy) ? Greeting::busy : Greeting::hang;
}

std::size_t open_descriptors(pid_t pid) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) ++n;
  return n;
}

}  // namespace


TEST_CASE("abuse: connections announcing maximal frames hold no more memory than the server-wide cap", "[server][abuse]") {
  test::TempDir dir;
  const long cap_mib = 32;
  ServerProcess server(dir.path, {"--fsync", "never", "--max-pending-mb", std::to_string(cap_mib), "--frame-deadline", "30"});
  Client normal(server.client());
  normal.ping();
  const long before = server.rss_kib();
  // 24 connections each announce a 64 MiB frame (the default limit) and then send 4 MiB of it: 96 MiB
  // offered, three times the cap. Before the fix, each 13-byte header alone took 64 MiB.
  const int connections = 24;
  const std::size_t body = 4u << 20;
  std::vector<int> fds;
  std::vector<std::size_t> sent(connections, 0);
  std::vector<std::byte> header(13), chunk(64 * 1024, std::byte{7});
  const std::uint32_t length = wire::kDefaultMaxFrame;
  std::memcpy(header.data(), &length, 4);
  header[4] = std::byte{0x20};
  for (int i = 0; i < connections; ++i) {
    fds.push_back(connect_raw(server.port));
    REQUIRE(::send(fds.back(), header.data(), header.size(), MSG_NOSIGNAL) == 13);
  }
  std::vector<std::vector<std::byte>> received(connections);  // what each connection was told
  auto take_replies = [&] {
    for (int i = 0; i < connections; ++i) {
      std::byte buf[256];
      for (ssize_t n; (n = ::recv(fds[i], buf, sizeof buf, MSG_DONTWAIT)) > 0;) received[i].insert(received[i].end(), buf, buf + n);
    }
  };
  long peak = before;
  // poll, not a spinning loop: under ctest -j a spinning client takes the core the server needs, and
  // connections still sending when time runs out would be neither served nor refused.
  const auto until = std::chrono::steady_clock::now() + 60s;
  for (bool more = true; more && std::chrono::steady_clock::now() < until;) {
    std::vector<pollfd> waiting;
    std::vector<int> which;
    for (int i = 0; i < connections; ++i)
      if (sent[i] < body) {
        waiting.push_back({fds[i], POLLOUT, 0});
        which.push_back(i);
      }
    if (::poll(waiting.data(), waiting.size(), 100) > 0)
      for (std::size_t w = 0; w < waiting.size(); ++w) {
        if (waiting[w].revents == 0) continue;
        const int i = which[w];
        const ssize_t n = ::send(fds[i], chunk.data(), std::min(chunk.size(), body - sent[i]), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) sent[i] += std::size_t(n);
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) sent[i] = body;  // reset: nothing more to send
      }
    more = std::any_of(sent.begin(), sent.end(), [&](std::size_t s) { return s < body; });
    take_replies();
    peak = std::max(peak, server.rss_kib());
  }
  CHECK(std::all_of(sent.begin(), sent.end(), [&](std::size_t s) { return s >= body; }));  // nobody was left stalled
  // Replies of the last refusals may still be on their way on a loaded machine: give them 5 s.
  auto answered = [&] { return std::count_if(received.begin(), received.end(), [](const auto& r) { return r.size() >= 15; }); };
  for (int i = 0; i < 50 && answered() < connections - int(cap_mib / 4); ++i) {
    std::this_thread::sleep_for(100ms);
    take_replies();
  }
  std::this_thread::sleep_for(100ms);
  take_replies();
  peak = std::max(peak, server.rss_kib());
  int busy = 0;
  for (const auto& r : received) {  // a refused connection was told server_busy (its bytes then drained)
    if (r.empty()) continue;
    REQUIRE(r.size() >= 15);
    std::uint16_t code = 0;
    std::memcpy(&code, r.data() + 13, 2);
    CHECK(code == static_cast<std::uint16_t>(ErrorCode::server_busy));
    ++busy;
  }
  WARN(connections << " connections announcing 64 MiB frames, " << body / 1024 << " KiB sent each, cap " << cap_mib
                   << " MiB: server RSS " << before << " KiB -> peak " << peak << " KiB; " << busy << " refused with server_busy");
  if (kRssMeasuresTheServer) CHECK(peak - before < (cap_mib + 16) * 1024);  // the cap, plus room for the drains and the allocator
  CHECK(busy >= connections - int(cap_mib / 4));  // most were over the cap (each held 4 MiB, so at most cap/4 fit)
  normal.ping();  // and the server kept serving
  for (int fd : fds) ::close(fd);
  std::this_thread::sleep_for(500ms);
  const long after = server.rss_kib();
  WARN("after the connections closed: " << after << " KiB");
  if (kRssMeasuresTheServer) CHECK(after - before < 8 * 1024);  // the buffers went back to the system
}

TEST_CASE("abuse: out of file descriptors, accept backs off and waiting clients are refused, not left hanging", "[server][abuse]") {
  test::TempDir dir;
  ServerProcess server(dir.path, {"--fsync", "never"});
  Client(server.client()).create_collection("c", {3, 1, Metric::dot, {}, {}});
  // Lower the running server's limit to just above what it holds: it sized its connection limit for
  // the old one, so accept itself runs out of descriptors (EMFILE) with clients waiting in the backlog.
  rlimit old{};
  REQUIRE(::prlimit(server.pid, RLIMIT_NOFILE, nullptr, &old) == 0);
  const rlimit low{open_descriptors(server.pid) + 8, old.rlim_max};
  REQUIRE(::prlimit(server.pid, RLIMIT_NOFILE, &low, nullptr) == 0);
  const double cpu_before = server.cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int> fds;
  const auto hello = wire::encode_request(wire::Hello{}, 1);
  for (int i = 0; i < 60; ++i) {
    fds.push_back(connect_raw(server.port));
    ::send(fds.back(), hello.data(), hello.size(), MSG_NOSIGNAL);
  }
  std::map<Greeting, int> seen;
  for (int fd : fds) ++seen[greeting_of(fd)];
  std::this_thread::sleep_for(1s);  // the backlog is empty now; a spinning accept would still burn CPU
  const double cpu = server.cpu_seconds() - cpu_before;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN("60 connections at a limit of " << low.rlim_cur << " descriptors: " << seen[Greeting::hello] << " served, "
                                       << seen[Greeting::busy] << " server_busy, " << seen[Greeting::closed] << " closed, "
                                       << seen[Greeting::hang] << " hanging; server CPU " << cpu << " s in " << wall << " s");
  CHECK(seen[Greeting::hang] == 0);
  CHECK(seen[Greeting::hello] >= 1);
  CHECK(seen[Greeting::hello] < 60);
  // A core spinning on EMFILE (the bug this guards against) burns about the whole wall time; half of it leaves
  // room for a sanitizer build answering 60 connections on a loaded machine (an ASan run under ctest -j2 failed
  // this test once, which check unknown: 0.25 was the tightest of them).
  CHECK(cpu < 0.5 * wall);
  for (int fd : fds) ::close(fd);
  // With descriptors free again, service and snapshots resume: once the accept loop's back-off ends and the
  // server's sessions have seen their clients close (an ASan run under ctest -j2 was refused 300 ms after the
  // close, another for 5 s, cause not found: up to 20 s are allowed, and the last refusal is reported).
  std::optional<Client> c;
  std::string last_refusal;
  int attempts = 0;
  for (; attempts < 200 && !c; ++attempts) {
    std::this_thread::sleep_for(100ms);
    try {
      c.emplace(server.client());
    } catch (const Error& e) {
      last_refusal = e.what();
    }
  }
  INFO(attempts << " attempts to reconnect; the last refusal: " << last_refusal);
  REQUIRE(c.has_value());
  c->add("c", std::vector<float>{1, 2, 3}, std::vector<float>{4});
  c->snapshot();
  CHECK(server.stop(SIGTERM) == 0);
}

TEST_CASE("under a low ulimit -n the connection limit is sized to fit, leaving descriptors for snapshots", "[server][abuse]") {
  test::TempDir dir;
  const auto log = dir.path / "server.log";
  std::filesystem::create_directories(dir.path);
  ServerProcess server(dir.path / "data", {"--fsync", "never"}, 64, log);
  Client normal(server.client());
  normal.create_collection("c", {3, 1, Metric::dot, {}, {}});
  const double cpu_before = server.cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int> fds;
  const auto hello = wire::encode_request(wire::Hello{}, 1);
  for (int i = 0; i < 80; ++i) {
    fds.push_back(connect_raw(server.port));
    ::send(fds.back(), hello.data(), hello.size(), MSG_NOSIGNAL);
  }
  std::map<Greeting, int> seen;
  for (int fd : fds) ++seen[greeting_of(fd)];
  std::this_thread::sleep_for(1s);
  const double cpu = server.cpu_seconds() - cpu_before;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // 64 descriptors, 32 kept for files: 32 connections, one of them `normal`.
  CHECK(seen[Greeting::hello] == 31);
  CHECK(seen[Greeting::busy] == 80 - 31);
  CHECK(seen[Greeting::hang] == 0);
  CHECK(cpu < 0.5 * wall);
  // With every connection slot taken, a snapshot still finds the descriptors it needs.
  normal.add("c", std::vector<float>{1, 2, 3}, std::vector<float>{4});
  normal.snapshot();
  for (int fd : fds) ::close(fd);
  CHECK(server.stop(SIGTERM) == 0);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("soft limit 64 -> 64 (hard 64); max connections 32") != std::string::npos);
}

TEST_CASE("softkv-server --repair starts past a corrupt log record that otherwise refuses the start", "[server][crash]") {
  test::TempDir dir;
  const auto data = dir.path / "data";
  {
    ServerProcess server(data, {"--fsync", "always"});
    Client c(server.client());
    c.create_collection("c", {3, 1, Metric::dot, {}, {}});
    for (std::uint64_t id = 0; id < 20; ++id) c.upsert("c", std::vector<std::uint64_t>{id}, key_of(id), value_of(id));  // a record each
    server.stop(SIGKILL);  // no snapshot at exit: everything is in the log
  }
  std::vector<std::filesystem::path> segments;
  for (const auto& e : std::filesystem::directory_iterator(data))
    if (e.path().filename().string().rfind("wal-", 0) == 0) segments.push_back(e.path());
  REQUIRE(segments.size() == 1);
  {  // flip a byte 40% into the log: a damaged record with intact records after it (not a torn tail)
    std::fstream f(segments[0], std::ios::in | std::ios::out | std::ios::binary);
    const auto at = std::streamoff(std::filesystem::file_size(segments[0]) * 2 / 5);
    f.seekg(at);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x5A);
    f.seekp(at);
    f.write(&b, 1);
  }
  // Without --repair the server refuses to start, with a non-zero exit.
  const int status = exit_status_of({"--data", data.string(), "--port", "0"}, "/dev/null");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
  // With --repair it starts, keeps the records before the damage, and says what it did.
  const auto log = dir.path / "repair.log";
  ServerProcess server(data, {"--repair"}, 0, log);
  Client c(server.client());
  const std::uint64_t kept = c.describe("c").size;
  CHECK(kept >= 1);
  CHECK(kept < 20);
  for (std::uint64_t id = 0; id < kept; ++id) CHECK(c.get("c", id).value == value_of(id));  // the valid prefix, intact
  CHECK(server.stop(SIGTERM) == 0);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("--repair") != std::string::npos);
  CHECK(text.find("repair: keeping the valid prefix") != std::string::npos);
}

TEST_CASE("a full disk at shutdown: the failed snapshot is logged, the exit is clean and non-zero, the restart keeps every write", "[server][crash][tmpfs]") {
  test::TempDir mount_point;
  std::filesystem::create_directories(mount_point.path);
  if (::mount("tmpfs", mount_point.path.c_str(), "tmpfs", 0, "size=16m") != 0) {
    WARN("skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "); CI runs as root and can");
    return;
  }
  struct Unmount {
    std::filesystem::path path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mount_point.path};
  const auto data = mount_point.path / "data";
  test::TempDir logs;
  std::filesystem::create_directories(logs.path);
  constexpr std::size_t d = 64, batch = 512;  // 256 KiB per add
  std::size_t acknowledged = 0;
  {
    ServerProcess server(data, {"--snapshot-after-mb", "0"}, 0, logs.path / "server.log");
    Client client(server.client());
    client.create_collection("c", {d, d, Metric::dot, {}, {}});
    ErrorCode code{};
    for (int i = 0; i < 200 && code == ErrorCode{}; ++i) {
      try {
        client.add("c", std::vector<float>(batch * d, float(i)), std::vector<float>(batch * d, 1.0f));
        acknowledged += batch;
      } catch (const Error& e) {
        code = e.code();
      }
    }
    REQUIRE(code == ErrorCode::io_error);  // the disk filled up
    REQUIRE(acknowledged > 0);
    const int status = server.stop(SIGTERM);
    REQUIRE(WIFEXITED(status));  // not killed by SIGABRT (an exception leaving main with a live thread)
    CHECK(WEXITSTATUS(status) == 1);
  }
  std::ifstream log(logs.path / "server.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  CHECK(text.find("the snapshot before exit failed") != std::string::npos);
  CHECK(!std::filesystem::exists(data / "snapshot.skv.tmp"));
  ServerProcess again(data, {}, 0, logs.path / "again.log");  // no space was freed: the log alone is enough to start
  Client client(again.client());
  CHECK(client.describe("c").size == acknowledged);
}

namespace {

// One request at a time over a raw socket, so that every field can be sent as it is (the client
// library checks some of them before sending). Returns the reply, or nullopt if the server closed.
struct Exchange {
  int fd = -1;
  std::uint16_t port = 0;
  explicit Exchange(std::uint16_t p) : fd(connect_raw(p)), port(p) {}
  ~Exchange() { ::close(fd); }
  std::optional<std::pair<wire::Frame, std::vector<std::byte>>> send(const std::vector<std::byte>& frame) {
    for (std::size_t at = 0; at < frame.size();) {
      const ssize_t n = ::send(fd, frame.data() + at, frame.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return std::nullopt;
      at += std::size_t(n);
    }
    std::vector<std::byte> buffer;
    for (;;) {
      const wire::FrameScan scan = wire::scan_frame(buffer, wire::kDefaultMaxFrame + 1024);
      if (scan.status == wire::FrameScan::Status::complete) {
        buffer.resize(scan.size);
        const wire::FrameScan again = wire::scan_frame(buffer, wire::kDefaultMaxFrame + 1024);
        return std::pair{again.frame, std::move(buffer)};
      }
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 30000) <= 0) return std::nullopt;
      std::byte chunk[65536];
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n <= 0) return std::nullopt;
      buffer.insert(buffer.end(), chunk, chunk + n);
    }
  }
  void reconnect() {
    ::close(fd);
    fd = connect_raw(port);
  }
};

}  // namespace

TEST_CASE("every integer field of every request at its extremes is answered or refused with a typed error, in bounded memory, and the directory reopens", "[server][extremes]") {
  const std::uint64_t u64s[] = {0, 1, (1ull << 31) - 1, 1ull << 31, (1ull << 32) - 1, 1ull << 32, 1ull << 63, ~0ull - 1, ~0ull};
  std::vector<std::uint64_t> u32s;
  for (std::uint64_t v : u64s)
    if (v <= 0xFFFFFFFFull) u32s.push_back(v);
  test::TempDir dir;
  std::vector<std::string> accepted;
  {
    ServerProcess server(dir.path);
    Exchange x(server.port);
    std::uint64_t request_id = 0;
    int answered = 0, refused = 0;
    // Sends a request; the reply must carry its id and be a reply to it or a typed error that leaves
    // the connection usable. Returns the error code (0 for success).
    // Requests are encoded at the version the last hello settled (1 before any).
    std::uint16_t version = wire::kMinProtocolVersion;
    auto ask = [&](const wire::Request& request, std::uint64_t id) -> int {
      const auto reply = x.send(wire::encode_request(request, id, version));
      REQUIRE(reply.has_value());  // the server answered and did not close
      const wire::Frame& f = reply->first;
      CHECK(f.request_id == id);
      if (std::holds_alternative<wire::Hello>(request) && f.opcode != wire::kErrorOpcode)
        version = std::get<wire::HelloReply>(wire::decode_reply(wire::Opcode::hello, f)).version;
      if (f.opcode == wire::kErrorOpcode) {
        const auto e = std::get<wire::ErrorReply>(wire::decode_reply(wire::opcode_of(request), f, wire::QueryKind::soft, version));
        CHECK(e.code != ErrorCode::internal);
        CHECK(e.code != ErrorCode::protocol_error);  // every request here is well formed
        ++refused;
        return int(e.code);
      }
      CHECK(f.opcode == (std::uint8_t(wire::opcode_of(request)) | wire::kReplyBit));
      if (std::holds_alternative<wire::Hello>(request))
        version = std::get<wire::HelloReply>(wire::decode_reply(wire::Opcode::hello, f, wire::QueryKind::soft, version)).version;
      ++answered;
      return 0;
    };
    const long rss_before = server.rss_kib();
    for (std::uint64_t id : u64s) CHECK(ask(wire::Ping{}, id) == 0);  // request ids at their extremes
    for (std::uint64_t v : {0ull, 1ull, 65534ull, 65535ull}) CHECK(ask(wire::Hello{std::uint16_t(v)}, ++request_id) == 0);
    REQUIRE(ask(wire::Create{"base", {3, 2, Metric::dot, {}, {}}}, ++request_id) == 0);
    CollectionConfig flat_config{3, 2, Metric::dot, {}, {}};
    flat_config.index.kind = IndexKind::flat;
    REQUIRE(ask(wire::Create{"flat", flat_config}, ++request_id) == 0);
    CollectionConfig hnsw_config{3, 2, Metric::dot, {}, {}};
    hnsw_config.index.kind = IndexKind::hnsw;
    REQUIRE(ask(wire::Create{"hnsw", hnsw_config}, ++request_id) == 0);
    accepted = {"base", "flat", "hnsw"};
    std::vector<float> keys, values;
    for (int i = 0; i < 50; ++i) {
      const auto k = key_of(std::uint64_t(i));
      keys.insert(keys.end(), {k[0], k[1], k[2]});
      values.insert(values.end(), {float(i), -float(i)});
    }
    REQUIRE(ask(wire::Add{"base", keys, values}, ++request_id) == 0);
    REQUIRE(ask(wire::Add{"flat", keys, values}, ++request_id) == 0);
    REQUIRE(ask(wire::Add{"hnsw", keys, values}, ++request_id) == 0);
    std::this_thread::sleep_for(500ms);  // the HNSW graph of 50 rows builds in the background meanwhile

    // CollectionConfig: every integer field at every extreme its type holds.
    using Set = std::function<void(CollectionConfig&, std::uint64_t)>;
    const std::pair<const char*, Set> config_fields[] = {
        {"dim", [](CollectionConfig& c, std::uint64_t v) { c.dim = v; }},
        {"value_dim", [](CollectionConfig& c, std::uint64_t v) { c.value_dim = v; }},
        {"hnsw_m", [](CollectionConfig& c, std::uint64_t v) { c.index.kind = IndexKind::hnsw, c.index.hnsw_m = v; }},
        {"ef_construction", [](CollectionConfig& c, std::uint64_t v) { c.index.kind = IndexKind::hnsw, c.index.hnsw_ef_construction = v; }},
        {"ivf_nlist", [](CollectionConfig& c, std::uint64_t v) { c.index.kind = IndexKind::ivf, c.index.ivf_nlist = v; }},
        {"ivf_train_size", [](CollectionConfig& c, std::uint64_t v) { c.index.kind = IndexKind::ivf, c.index.ivf_train_size = v; }},
        {"auto_threshold", [](CollectionConfig& c, std::uint64_t v) { c.index.kind = IndexKind::automatic, c.index.auto_threshold = v; }},
        {"heads", [](CollectionConfig& c, std::uint64_t v) { c.heads = v; }},  // (v2) 3 x 2: only 1 divides both
    };
    int n = 0;
    for (const auto& [field, set] : config_fields) {
      const bool wide = std::string(field) == "ivf_train_size" || std::string(field) == "auto_threshold";  // u64 on the wire
      for (std::uint64_t v : wide ? std::vector<std::uint64_t>(std::begin(u64s), std::end(u64s)) : u32s) {
        CAPTURE(field, v);
        CollectionConfig config{3, 2, Metric::dot, {}, {}};
        set(config, v);
        const std::string name = "x" + std::to_string(n++);
        const int code = ask(wire::Create{name, config}, ++request_id);
        if (code != 0) {
          CHECK(code == int(ErrorCode::invalid_argument));
          continue;
        }
        accepted.push_back(name);
        if (config.dim <= 64 && config.value_dim <= 64)  // rows, so that index builds run on them
          CHECK(ask(wire::Add{name, std::vector<float>(20 * config.dim, 1.0f), std::vector<float>(20 * config.value_dim, 2.0f)},
                    ++request_id) == 0);
      }
    }
    for (std::uint64_t v : {0ull, 1ull, 2ull, 254ull, 255ull}) {  // the u8 enums
      CollectionConfig metric{3, 2, static_cast<Metric>(v), {}, {}};
      CollectionConfig kind{3, 2, Metric::dot, {}, {}};
      kind.index.kind = static_cast<IndexKind>(v);
      for (const CollectionConfig& c : {metric, kind}) {
        const std::string name = "x" + std::to_string(n++);
        const int code = ask(wire::Create{name, c}, ++request_id);
        if (code == 0) accepted.push_back(name);
        else CHECK(code == int(ErrorCode::invalid_argument));
      }
    }

    // QueryOptions: top_m, top_k, ef_search and nprobe at every u32 extreme, soft and hard, on an
    // exact and a flat collection. top_m is clamped to the collection's size.
    using Opt = std::function<void(QueryOptions&, std::uint64_t)>;
    const std::pair<const char*, Opt> option_fields[] = {
        {"top_m", [](QueryOptions& o, std::uint64_t v) { o.top_m = v; }},
        {"top_k", [](QueryOptions& o, std::uint64_t v) { o.top_k = v; }},
        {"ef_search", [](QueryOptions& o, std::uint64_t v) { o.ef_search = v, o.top_k = 5; }},
        {"nprobe", [](QueryOptions& o, std::uint64_t v) { o.nprobe = v, o.top_k = 5; }},
        {"iterations", [](QueryOptions& o, std::uint64_t v) { o.iterations = v; }},  // (v2) dv != d: only 1 is answered
    };
    for (const auto& [field, set] : option_fields)
      for (std::uint64_t v : u32s)
        for (const char* name : {"base", "flat", "hnsw"})
          for (wire::QueryKind kind : {wire::QueryKind::soft, wire::QueryKind::hard}) {
            CAPTURE(field, v, name, int(kind));
            QueryOptions o;
            set(o, v);
            const wire::Query q{name, kind, o, {1.0f, 0.5f, -0.25f}};
            const std::uint64_t id = ++request_id;
            const auto reply = x.send(wire::encode_request(q, id, version));
            REQUIRE(reply.has_value());
            const wire::Reply r = wire::decode_reply(wire::Opcode::query, reply->first, kind, version);
            if (const auto* e = std::get_if<wire::ErrorReply>(&r)) {
              CHECK((e->code == ErrorCode::invalid_argument));
              ++refused;
            } else if (const auto* soft = std::get_if<wire::SoftReply>(&r)) {
              REQUIRE(soft->results.size() == 1);
              CHECK(soft->results[0].top.size() == std::min<std::uint64_t>(o.top_m, 50));
              CHECK(std::isfinite(soft->results[0].lse));
              ++answered;
            } else {
              const auto& hard = std::get<wire::HardReply>(r);
              REQUIRE(hard.results.size() == 1);
              // Whatever the search effort, the answer is the true argmax: key_of(49) scores highest.
              CHECK(hard.results[0].id == 49);
              ++answered;
            }
          }

    // Ids at their extremes: get, upsert, remove.
    for (std::uint64_t id : u64s) {
      CAPTURE(id);
      const int got = ask(wire::Get{"base", id}, ++request_id);
      CHECK((got == 0 || got == int(ErrorCode::unknown_id)));
      const int put = ask(wire::Upsert{"base", {id}, {1.0f, 2.0f, 3.0f}, {4.0f, 5.0f}}, ++request_id);
      CHECK(put == (id == kReservedId ? int(ErrorCode::invalid_argument) : 0));
      const int removed = ask(wire::Remove{"base", {id}}, ++request_id);
      CHECK(removed == (id == kReservedId ? int(ErrorCode::unknown_id) : 0));
    }
    CHECK(answered > 100);
    CHECK(refused > 50);
    // Nothing above may cost the server much memory (a request once reserved top_m slots up front).
    CHECK(server.rss_kib() - rss_before < 256 * 1024);
    CHECK(ask(wire::Snapshot{}, ++request_id) == 0);
    const int status = server.stop(SIGTERM);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  ServerProcess again(dir.path);  // every accepted configuration loads again
  Client client(again.client());
  std::vector<std::string> names = client.list_collections();
  std::sort(accepted.begin(), accepted.end());
  CHECK(names == accepted);
}
