// softkv-server over real TCP on 127.0.0.1 (ephemeral ports): answers, pipelining, limits, auth, restart.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <random>
#include <thread>

#include "handler.hpp"
#include "reference.hpp"
#include "running_server.hpp"
#include "server.hpp"
#include "softkv/softkv.hpp"
#include "errors.hpp"
#include "temp_dir.hpp"
#include "wire/protocol.hpp"

using namespace softkv;
using namespace std::chrono_literals;

namespace {

using test::quiet_db;
using test::RunningServer;

// The largest send buffer the kernel grows a TCP socket to (the third field of tcp_wmem).
std::size_t tcp_wmem_max() {
  std::ifstream in("/proc/sys/net/ipv4/tcp_wmem");
  std::size_t low = 0, initial = 0, high = 0;
  if (in >> low >> initial >> high) return high;
  return std::size_t(32) << 20;  // unknown: assume a generous 32 MiB
}

// A bare TCP connection for sending bytes no well-behaved client would. It throws rather than using
// Catch2's macros, which are not thread safe (the pipelining test uses it from many threads).
struct RawSocket {
  int fd = -1;
  // receive_buffer > 0 fixes the kernel's receive buffer (no autotuning) before connecting.
  explicit RawSocket(std::uint16_t port, int receive_buffer = 0) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect failed");
  }
  ~RawSocket() { ::close(fd); }
  void send(std::span<const std::byte> bytes) const {
    if (::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != ssize_t(bytes.size())) throw std::runtime_error("send failed");
  }
  // Up to n bytes, or fewer if the peer closes or the time runs out.
  std::vector<std::byte> read(std::size_t n, std::chrono::milliseconds within = 5s) const {
    std::vector<std::byte> out;
    const auto until = std::chrono::steady_clock::now() + within;
    while (out.size() < n) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      pollfd p{fd, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) break;
      std::byte buf[4096];
      const ssize_t got = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
      if (got <= 0) break;
      out.insert(out.end(), buf, buf + got);
    }
    return out;
  }
  // One whole frame, or nothing if the connection closed first.
  std::optional<std::vector<std::byte>> frame(std::chrono::milliseconds within = 5s) const {
    auto head = read(4, within);
    if (head.size() < 4) return std::nullopt;
    std::uint32_t length;
    std::memcpy(&length, head.data(), 4);
    auto rest = read(length, within);
    if (rest.size() < length) return std::nullopt;
    head.insert(head.end(), rest.begin(), rest.end());
    return head;
  }
  // Whether the server closed the connection (EOF) within the time.
  [[nodiscard]] bool closed_within(std::chrono::milliseconds within) const {
    const auto until = std::chrono::steady_clock::now() + within;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      pollfd p{fd, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) return false;
      std::byte b;
      const ssize_t got = ::recv(fd, &b, 1, 0);
      if (got <= 0) return true;
    }
  }
};

wire::ErrorReply error_in(const std::vector<std::byte>& bytes) {
  const auto scan = wire::scan_frame(bytes, wire::kDefaultMaxFrame);
  REQUIRE(scan.status == wire::FrameScan::Status::complete);
  REQUIRE(scan.frame.opcode == wire::kErrorOpcode);
  return std::get<wire::ErrorReply>(wire::decode_reply(wire::Opcode::ping, scan.frame));
}

using test::error_of;

void fill(Client& c, const std::string& name, std::size_t n, std::size_t d, std::size_t dv, IndexKind index = IndexKind::exact) {
  CollectionConfig config{d, dv, Metric::dot, {}, {}};
  config.index.kind = index;
  c.create_collection(name, config);
  c.add(name, test::normal_floats(n * d, 1), test::normal_floats(n * dv, 2));
}

}  // namespace

TEST_CASE("answers over TCP equal the library's bit for bit", "[server]") {
  RunningServer s;
  Client client(s.client());
  fill(client, "plain", 3000, 16, 5);
  fill(client, "pruned", 3000, 16, 5, IndexKind::flat);
  const auto plain = s.db->collection("plain");
  const auto pruned = s.db->collection("pruned");
  const auto qs = test::normal_floats(16 * 9, 3);
  const std::span<const float> q(qs.data(), 16);
  auto same_soft = [](const SoftResult& a, const SoftResult& b) {
    CHECK(a.value == b.value);
    CHECK(a.lse == b.lse);
    CHECK(a.max_score == b.max_score);
    CHECK(a.candidates == b.candidates);
    CHECK(a.tail_bound == b.tail_bound);
    REQUIRE(a.top.size() == b.top.size());
    for (std::size_t i = 0; i < a.top.size(); ++i) {
      CHECK(a.top[i].id == b.top[i].id);
      CHECK(a.top[i].weight == b.top[i].weight);
      CHECK(a.top[i].score == b.top[i].score);
    }
  };
  for (const QueryOptions& o : {QueryOptions{}, QueryOptions{.temperature = 0.3f, .top_m = 4}, QueryOptions{.scale = 2.0f, .top_m = 2}})
    same_soft(client.query_soft("plain", q, o), plain->query_soft(q, o));
  same_soft(client.query_soft("pruned", q, {.top_m = 3, .top_k = 40}), pruned->query_soft(q, {.top_m = 3, .top_k = 40}));
  same_soft(client.query_soft("pruned", q, {.epsilon = 0.01f}), pruned->query_soft(q, {.epsilon = 0.01f}));
  const HardResult h = client.query_hard("plain", q);
  const HardResult lh = plain->query_hard(q);
  CHECK(h.id == lh.id);
  CHECK(h.score == lh.score);
  CHECK(h.value == lh.value);
  // Batches: the batched library call.
  const auto sb = client.query_soft_batch("plain", qs, {.temperature = 0.5f});
  const SoftBatchResult lsb = plain->query_soft_batch(qs, {.temperature = 0.5f});
  REQUIRE(sb.size() == 9);
  for (std::size_t b = 0; b < 9; ++b) {
    CHECK(sb[b].value == std::vector<float>(lsb.values.begin() + b * 5, lsb.values.begin() + (b + 1) * 5));
    CHECK(sb[b].lse == lsb.lse[b]);
  }
  const auto hb = client.query_hard_batch("plain", qs);
  const HardBatchResult lhb = plain->query_hard_batch(qs);
  for (std::size_t b = 0; b < 9; ++b) CHECK(hb[b].id == lhb.ids[b]);
  // The one query call: the same answers in the library's shape, soft and hard.
  const QueryResults qr = client.query("plain", qs, Retrieval::soft, {.temperature = 0.5f});
  const QueryResults lqr = plain->query(qs, Retrieval::soft, {.temperature = 0.5f});
  REQUIRE(qr.soft.size() == lqr.soft.size());
  CHECK(qr.hard.empty());
  for (std::size_t b = 0; b < qr.soft.size(); ++b) {
    CHECK(qr.soft[b].value == lqr.soft[b].value);
    CHECK(qr.soft[b].lse == lqr.soft[b].lse);
    CHECK(qr.soft[b].candidates == lqr.soft[b].candidates);
  }
  const QueryResults qh = client.query("plain", qs, Retrieval::hard);
  REQUIRE(qh.hard.size() == 9);
  for (std::size_t b = 0; b < 9; ++b) CHECK(qh.hard[b].id == lhb.ids[b]);
  CHECK_THROWS_AS(client.query("plain", qs, static_cast<Retrieval>(9)), Error);
  // Writes and reads.
  CHECK(client.get("plain", 7).value == plain->get(7).value);
  client.remove("plain", std::vector<std::uint64_t>{7});
  CHECK_FALSE(plain->contains(7));
  CHECK(client.list_collections() == std::vector<std::string>{"plain", "pruned"});
  CHECK(client.describe("plain").size == 2999);
  CHECK(client.stats().collections == 2);
}

TEST_CASE("pipelined requests from many connections are each answered under their own id", "[server]") {
  RunningServer s;
  {
    Client setup(s.client());
    fill(setup, "c", 500, 8, 2);
  }
  std::vector<std::thread> clients;
  std::atomic<int> mismatches{0}, answered{0};
  for (int t = 0; t < 8; ++t) {
    clients.emplace_back([&, t] {  // no Catch2 macros in here: count, then check on the main thread
      RawSocket raw(s.server->port());
      std::vector<std::byte> burst;
      for (std::uint64_t i = 0; i < 40; ++i) {  // alternate pings and queries, all sent before reading
        const std::uint64_t id = t * 1000 + i;
        const auto f = i % 2 ? wire::encode_request(wire::Ping{}, id)
                             : wire::encode_request(wire::Query{"c", wire::QueryKind::hard, {}, test::normal_floats(8, id)}, id);
        burst.insert(burst.end(), f.begin(), f.end());
      }
      raw.send(burst);
      for (std::uint64_t i = 0; i < 40; ++i) {
        const auto f = raw.frame();
        if (!f) break;
        const auto scan = wire::scan_frame(*f, wire::kDefaultMaxFrame);
        const std::uint8_t expect = i % 2 ? 0x83 : 0xB0;
        if (scan.frame.request_id != t * 1000 + i || scan.frame.opcode != expect) ++mismatches;
        ++answered;
      }
    });
  }
  for (auto& c : clients) c.join();
  CHECK(answered == 8 * 40);
  CHECK(mismatches == 0);
}

TEST_CASE("a long scan on one connection does not delay pings on another", "[server][timing]") {
  RunningServer s;
  {
    Client setup(s.client());
    setup.create_collection("big", {128, 64, Metric::dot, {}, {}});
    const auto keys = test::normal_floats(20000 * 128, 1), values = test::normal_floats(20000 * 64, 2);
    for (int i = 0; i < 10; ++i) setup.add("big", keys, values);  // 200,000 entries
  }
  std::atomic<bool> stop{false};
  std::atomic<int> scans{0};
  double longest_scan_ms = 0;
  std::thread scanner([&] {
    Client c(s.client());
    // 1,024 queries over 200,000 rows: ~40 GFLOP, several hundred ms on the fastest machines we run on
    // (256 queries took 96 ms on a Zen 5, too short for the check below to mean something).
    const auto qs = test::normal_floats(128 * 1024, 3);
    while (!stop) {
      const auto t0 = std::chrono::steady_clock::now();
      (void)c.query_soft_batch("big", qs);
      longest_scan_ms = std::max(longest_scan_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      ++scans;
    }
  });
  while (scans == 0) std::this_thread::sleep_for(1ms);  // a scan is running from here on
  Client pinger(s.client());
  std::vector<double> ms;
  for (int i = 0; i < 50; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    pinger.ping();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    std::this_thread::sleep_for(5ms);
  }
  stop = true;
  scanner.join();
  std::sort(ms.begin(), ms.end());
  INFO("ping p50 " << ms[25] << " ms, max " << ms.back() << " ms; longest scan " << longest_scan_ms << " ms");
  CHECK(longest_scan_ms > 100);  // the scans are long enough for the check below to mean something
  CHECK(ms[45] < 25.0);          // p90 of pings stays far below one scan
}

TEST_CASE("bad input gets a typed error, and the connection survives unless the frame itself is bad", "[server]") {
  server::ServerConfig config;
  config.max_frame = 1 << 20;
  config.frame_deadline = 300ms;
  RunningServer s(config);
  Client client(s.client());
  fill(client, "c", 100, 4, 2);
  CHECK(error_of([&] { (void)client.query_soft("c", std::vector<float>{1, 2, 3}); }) == ErrorCode::dimension_mismatch);
  CHECK(error_of([&] { (void)client.query_soft("c", std::vector<float>{1, NAN, 3, 4}); }) == ErrorCode::non_finite);
  CHECK(error_of([&] { client.add("c", std::vector<float>{1, 2, 3, INFINITY}, std::vector<float>{1, 2}); }) == ErrorCode::non_finite);
  CHECK(error_of([&] { (void)client.query_hard("nope", std::vector<float>{1, 2, 3, 4}); }) == ErrorCode::unknown_collection);
  client.ping();  // still usable
  CHECK(client.describe("c").size == 100);

  SECTION("unknown opcode: an error frame, then close") {
    RawSocket raw(s.server->port());
    raw.send(wire::encode_frame(0x55, 1, {}));
    const auto f = raw.frame();
    REQUIRE(f);
    CHECK(error_in(*f).code == ErrorCode::protocol_error);
    CHECK(raw.closed_within(2s));
  }
  SECTION("a frame too short to be one: an error frame, then close") {
    RawSocket raw(s.server->port());
    const std::byte five[4] = {std::byte{5}, {}, {}, {}};
    raw.send(five);
    const auto f = raw.frame();
    REQUIRE(f);
    CHECK(error_in(*f).code == ErrorCode::protocol_error);
    CHECK(raw.closed_within(2s));
  }
  SECTION("a frame claiming 4 GiB: refused from its length, then close") {
    RawSocket raw(s.server->port());
    const std::byte huge[4] = {std::byte{0xFF}, std::byte{0xFF}, std::byte{0xFF}, std::byte{0xFF}};
    raw.send(huge);
    const auto f = raw.frame();
    REQUIRE(f);
    CHECK(error_in(*f).code == ErrorCode::frame_too_large);
    CHECK(error_in(*f).message.rfind("frame_too_large: ", 0) == 0);  // the same "<code>: " prefix as every error
    CHECK(raw.closed_within(2s));
  }
  SECTION("a slow sender is cut off at the frame deadline") {
    RawSocket raw(s.server->port());
    const auto ping = wire::encode_request(wire::Ping{}, 9);
    raw.send(std::span(ping).first(6));  // a started frame, never finished
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(raw.closed_within(3s));
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  }
  SECTION("random garbage never takes the server down") {
    std::mt19937_64 rng(7);
    for (int i = 0; i < 50; ++i) {
      RawSocket raw(s.server->port());
      std::vector<std::byte> junk(1 + rng() % 200);
      for (auto& b : junk) b = std::byte(rng());
      ::send(raw.fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    }
    Client again(s.client());
    again.ping();
  }
}

TEST_CASE("a client that stops reading its replies is disconnected at the reply deadline", "[server]") {
  server::ServerConfig config;
  config.reply_deadline = 400ms;
  RunningServer s(config);
  Client client(s.client());
  client.create_collection("wide", {4, 16384, Metric::dot, {}, {}});  // each get answers with a 64 KiB value
  const std::uint64_t id = client.add("wide", test::normal_floats(4, 1), test::normal_floats(16384, 2)).at(0);
  const std::size_t reply_bytes = wire::encode_reply(wire::Opcode::get, 1, wire::GetReply{client.get("wide", id)}).size();
  // The replies must be far more than the kernel can buffer between the two ends, or every byte
  // arrives and nothing is cut off (a CI machine with tcp_rmem max = 32 MiB took all 32 MiB once).
  // The client's receive buffer is pinned small; the server's send buffer can grow to tcp_wmem max.
  constexpr int kReceiveBuffer = 64 * 1024;
  const std::size_t buffered = tcp_wmem_max() + 4 * kReceiveBuffer;
  const std::size_t requests = std::max<std::size_t>(500, 4 * buffered / reply_bytes);
  RawSocket raw(s.server->port(), kReceiveBuffer);
  std::vector<std::byte> pipelined;
  for (std::size_t i = 0; i < requests; ++i) {
    const auto f = wire::encode_request(wire::Get{"wide", id}, i + 1);
    pipelined.insert(pipelined.end(), f.begin(), f.end());
  }
  raw.send(pipelined);
  std::this_thread::sleep_for(1500ms);  // not reading: the server's write stalls, then its deadline passes
  client.ping();                        // other connections are served meanwhile
  const auto got = raw.read(requests * reply_bytes, 5s);
  INFO("received " << got.size() << " of " << requests * reply_bytes << " reply bytes");
  CHECK(got.size() < requests * reply_bytes);  // cut off before all replies were taken
  CHECK(got.size() >= reply_bytes);            // but what fit in the buffers was sent
  CHECK(raw.closed_within(1s));
  CHECK(client.stats().connections == 1);
}

TEST_CASE("an idle connection is closed at the idle timeout while activity keeps one open", "[server]") {
  server::ServerConfig config;
  config.idle_timeout = 300ms;
  RunningServer s(config);
  RawSocket silent(s.server->port());
  RawSocket active(s.server->port());
  const auto ping = wire::encode_request(wire::Ping{}, 1);
  for (int i = 0; i < 10; ++i) {  // 1 s of pings 100 ms apart: never idle for 300 ms
    active.send(ping);
    REQUIRE(active.frame());
    std::this_thread::sleep_for(100ms);
  }
  CHECK(silent.closed_within(1s));  // already closed (300 ms, plus at most one 75 ms watchdog tick)
  active.send(ping);
  CHECK(active.frame());
}

TEST_CASE("connections beyond the limit get an error frame", "[server]") {
  server::ServerConfig config;
  config.max_connections = 2;
  RunningServer s(config);
  Client a(s.client()), b(s.client());
  RawSocket third(s.server->port());
  const auto f = third.frame();
  REQUIRE(f);
  CHECK(error_in(*f).code == ErrorCode::server_busy);
  CHECK(third.closed_within(2s));
  a.ping();
  b.ping();
}

TEST_CASE("with a token, nothing but hello and auth is served until the token is given", "[server]") {
  server::ServerConfig config;
  config.auth_token = "correct horse";
  RunningServer s(config);
  {
    RawSocket raw(s.server->port());
    raw.send(wire::encode_request(wire::Hello{}, 1));
    const auto hello = raw.frame();
    REQUIRE(hello);
    const auto reply = std::get<wire::HelloReply>(wire::decode_reply(wire::Opcode::hello, wire::scan_frame(*hello, 1 << 20).frame));
    CHECK(reply.auth_required);
    raw.send(wire::encode_request(wire::List{}, 2));
    const auto refused = raw.frame();
    REQUIRE(refused);
    CHECK(error_in(*refused).code == ErrorCode::unauthenticated);
  }
  CHECK(error_of([&] { Client c(s.client("wrong horse")); }) == ErrorCode::unauthenticated);
  CHECK(error_of([&] { Client c(s.client()); c.list_collections(); }) == ErrorCode::unauthenticated);
  Client ok(s.client("correct horse"));
  CHECK(ok.list_collections().empty());
  // And a non-loopback bind without a token is refused outright.
  server::ServerConfig open;
  open.host = "0.0.0.0";
  Database db(s.dir / "other", quiet_db());
  CHECK(error_of([&] { server::Server bad(db, open); }) == ErrorCode::invalid_argument);
}

TEST_CASE("acknowledged writes survive a server restart", "[server]") {
  test::TempDir dir;
  std::vector<std::uint64_t> ids;
  const auto keys = test::normal_floats(50 * 6, 4);
  {
    RunningServer s({}, dir.path);
    Client c(s.client());
    c.create_collection("kept", {6, 1, Metric::cosine, {}, {}});
    ids = c.add("kept", keys, std::vector<float>(50, 3.0f));
    c.upsert("kept", std::vector<std::uint64_t>{ids[0]}, test::normal_floats(6, 5), std::vector<float>{9.0f});
  }
  RunningServer s({}, dir.path);
  Client c(s.client());
  CHECK(c.describe("kept").size == 50);
  CHECK(c.get("kept", ids[0]).value == std::vector<float>{9.0f});
  CHECK(c.get("kept", ids[49]).value == std::vector<float>{3.0f});
}

TEST_CASE("a frame over the limit: the error reaches the C++ client, locally or from the server", "[server]") {
  server::ServerConfig config;
  config.max_frame = 1 << 20;
  RunningServer s(config);
  Client setup(s.client());
  setup.create_collection("c", {4, 4, Metric::dot, {}, {}});
  // A 32 MB add: far more than the socket buffers hold, so a server that closed without reading would reset the connection.
  const std::vector<float> keys(4 * 1000000, 1.0f), values(4 * 1000000, 2.0f);

  // A client that knows the limit refuses before sending anything, and stays usable.
  ClientOptions knows = s.client();
  knows.max_frame = config.max_frame;
  Client careful(knows);
  CHECK(error_of([&] { careful.add("c", keys, values); }) == ErrorCode::frame_too_large);
  careful.ping();
  // Exactly at the limit is still sent: the check is the server's own (scan_frame).
  const std::size_t tags_count = careful.protocol_version() >= 2 ? 4 : 0;  // v2 adds carry an (empty) tag array
  const std::size_t floats = (config.max_frame - wire::kFrameOverhead - 2 - 1 - 8 - tags_count) / 4;  // name "c", two counts
  CHECK(error_of([&] { careful.add("c", test::normal_floats(floats - 4, 3), std::vector<float>(4, 1.0f)); }) ==
        ErrorCode::dimension_mismatch);  // reached the server, whose answer is about the rows, not the frame

  // A client with a larger limit sends the whole frame; the server answers frame_too_large and reads
  // (discards) the rest before closing, so the client sees the error, not a reset connection.
  for (int i = 0; i < 3; ++i) {
    Client eager(s.client());
    CHECK(error_of([&] { eager.add("c", keys, values); }) == ErrorCode::frame_too_large);
  }
  setup.ping();
  CHECK(setup.describe("c").size == 0);
}

TEST_CASE("protocol corners behave as PROTOCOL.md specifies", "[server]") {
  RunningServer s;
  Client c(s.client());
  fill(c, "exact", 50, 4, 2);
  fill(c, "graph", 50, 4, 2, IndexKind::hnsw);
  RawSocket raw(s.server->port());
  auto reply_to = [&](const wire::Request& r, std::uint64_t id) {
    raw.send(wire::encode_request(r, id));
    const auto f = raw.frame();
    REQUIRE(f);
    const auto scan = wire::scan_frame(*f, wire::kDefaultMaxFrame);
    REQUIRE(scan.status == wire::FrameScan::Status::complete);
    CHECK(scan.frame.request_id == id);
    const auto kind = std::holds_alternative<wire::Query>(r) ? std::get<wire::Query>(r).kind : wire::QueryKind::soft;
    return wire::decode_reply(wire::opcode_of(r), scan.frame, kind);
  };
  auto code_of = [](const wire::Reply& r) { return std::holds_alternative<wire::ErrorReply>(r) ? std::get<wire::ErrorReply>(r).code : ErrorCode{}; };

  // hello settles the connection's version on min(asked, the server's highest), 0 counting as 1; a
  // later hello settles it again. The connection stays open whatever was asked. It ends at
  // version 1, which the raw frames below are encoded in.
  const std::pair<std::uint16_t, std::uint16_t> settles[] = {{0, 1}, {1, 1}, {2, 2}, {3, 3}, {4, 3}, {0xFFFF, 3}, {1, 1}};
  for (const auto& [asked, settled] : settles) {
    const auto hello = std::get<wire::HelloReply>(reply_to(wire::Hello{asked}, 1));
    CHECK(hello.version == settled);
    CHECK(hello.version == wire::negotiate_version(asked));
    CHECK_FALSE(hello.auth_required);
  }
  // auth on a server without a token: acknowledged, whatever the token.
  CHECK(std::holds_alternative<wire::Ack>(reply_to(wire::Auth{"anything"}, 2)));
  CHECK(std::holds_alternative<wire::Ack>(reply_to(wire::Auth{""}, 3)));
  // B = 0 (an empty queries array): dimension_mismatch, connection open.
  for (const auto kind : {wire::QueryKind::soft, wire::QueryKind::hard})
    CHECK(code_of(reply_to(wire::Query{"exact", kind, {}, {}}, 4)) == ErrorCode::dimension_mismatch);
  // top_k (or epsilon) on an exact collection: invalid_argument (no index to prune with).
  QueryOptions top_k;
  top_k.top_k = 5;
  CHECK(code_of(reply_to(wire::Query{"exact", wire::QueryKind::soft, top_k, {1, 2, 3, 4}}, 5)) == ErrorCode::invalid_argument);
  // ef_search = 0 (or nprobe = 0) with top_k or epsilon: invalid_argument; where no index is searched it is unused.
  QueryOptions zero_ef = top_k;
  zero_ef.ef_search = 0;
  CHECK(code_of(reply_to(wire::Query{"graph", wire::QueryKind::soft, zero_ef, {1, 2, 3, 4}}, 6)) == ErrorCode::invalid_argument);
  QueryOptions unused;
  unused.ef_search = 0;
  CHECK(std::holds_alternative<wire::SoftReply>(reply_to(wire::Query{"exact", wire::QueryKind::soft, unused, {1, 2, 3, 4}}, 7)));
  CHECK(std::holds_alternative<wire::Ack>(reply_to(wire::Ping{}, 8)));  // all of the above kept the connection

  // Trailing bytes after a payload: protocol_error with the request's id, then close.
  auto padded = wire::encode_request(wire::Describe{"exact"}, 9);
  padded.push_back(std::byte{0});
  const std::uint32_t length = static_cast<std::uint32_t>(padded.size() - 4);
  std::memcpy(padded.data(), &length, 4);
  raw.send(padded);
  const auto f = raw.frame();
  REQUIRE(f);
  CHECK(error_in(*f).code == ErrorCode::protocol_error);
  CHECK(wire::scan_frame(*f, wire::kDefaultMaxFrame).frame.request_id == 9);
  CHECK(raw.closed_within(3s));
}

TEST_CASE("before auth only small frames are read and after auth the full limit applies", "[server]") {
  server::ServerConfig config;
  config.auth_token = "t";
  RunningServer s(config);
  {
    RawSocket raw(s.server->port());
    std::vector<std::byte> header(13);
    const std::uint32_t length = server::kUnauthenticatedMaxFrame + 1;
    std::memcpy(header.data(), &length, 4);
    header[4] = std::byte{0x20};
    raw.send(header);
    const auto f = raw.frame();
    REQUIRE(f);
    const auto e = error_in(*f);
    CHECK(e.code == ErrorCode::frame_too_large);
    CHECK(e.message.rfind("frame_too_large: frame of ", 0) == 0);
    CHECK(e.message.find(std::to_string(server::kUnauthenticatedMaxFrame)) != std::string::npos);
    CHECK(raw.closed_within(3s));
  }
  Client c(s.client("t"));  // after auth: a 1 MiB frame is fine
  c.create_collection("c", {4, 4, Metric::dot, {}, {}});
  CHECK(c.add("c", test::normal_floats(4 * 40000, 1), test::normal_floats(4 * 40000, 2)).size() == 40000);
}

TEST_CASE("error messages are valid UTF-8 even when they echo invalid request bytes", "[server]") {
  RunningServer s;
  RawSocket raw(s.server->port());
  for (const std::string name : {std::string("f\xE3"), std::string("\xFF\xFE"), std::string(3000, '\xC3')}) {
    raw.send(wire::encode_request(wire::Create{name, {4, 4, Metric::dot, {}, {}}}, 1));
    const auto f = raw.frame();
    REQUIRE(f);
    const auto e = error_in(*f);
    CHECK(e.code == ErrorCode::invalid_argument);
    CHECK(wire::wire_message(e.message) == e.message);  // unchanged by escaping: already valid UTF-8
    CHECK(e.message.size() <= wire::kMaxErrorMessage);
  }
  raw.send(wire::encode_request(wire::Create{"f\xE3", {4, 4, Metric::dot, {}, {}}}, 2));
  const auto f = raw.frame();
  REQUIRE(f);
  CHECK(error_in(*f).message.find("'f\\xE3'") != std::string::npos);
}

TEST_CASE("error tiers on the wire: caller mistakes keep their code, bad_alloc is a resource error, the rest internal", "[server]") {
  auto reply_for = [](auto thrower) {
    try {
      thrower();
    } catch (...) {
      return server::current_error_reply();
    }
    FAIL("nothing thrown");
    return wire::ErrorReply{};
  };
  const auto caller = reply_for([] { throw Error(ErrorCode::unknown_id, "no entry 7"); });
  CHECK(caller.code == ErrorCode::unknown_id);
  CHECK(caller.message.find("no entry 7") != std::string::npos);
  CHECK(reply_for([] { throw std::bad_alloc(); }).code == ErrorCode::resource_exhausted);
  const auto invariant = reply_for([] { (void)std::vector<int>{}.at(3); });  // what a broken slot map would throw
  CHECK(invariant.code == ErrorCode::internal);
  CHECK(invariant.message.find("internal error") != std::string::npos);
  CHECK(reply_for([] { throw 42; }).code == ErrorCode::internal);
  CHECK(to_string(ErrorCode::resource_exhausted) == "resource_exhausted");
  CHECK(to_string(ErrorCode::internal) == "internal");
}

TEST_CASE("concurrent single queries over TCP share passes and query_stats reports them", "[server][coalescing]") {
  RunningServer s;
  Client client(s.client());
  fill(client, "c", 20000, 64, 16);
  constexpr int kClients = 16, kQueries = 8;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      Client own(s.client());
      for (int i = 0; i < kQueries; ++i) {
        const auto q = test::normal_floats(64, 500 + t * 10 + i);
        const SoftResult r = own.query_soft("c", q, {.temperature = 0.5f + 0.1f * float(t % 3)});
        // The same query alone, through the library, differs from a coalesced answer by float rounding only.
        const SoftResult alone = s.db->collection("c")->query_soft(q, {.temperature = 0.5f + 0.1f * float(t % 3)});
        if (std::fabs(r.lse - alone.lse) > 1e-5 * std::max(1.0, std::fabs(alone.lse)) || test::max_abs_diff(r.value, alone.value) > 1e-4)
          ++wrong;
      }
    });
  for (auto& t : threads) t.join();
  CHECK(wrong.load() == 0);
  const CoalescingStats stats = client.query_stats("c");
  CHECK(stats.queries >= std::uint64_t(kClients * kQueries));
  CHECK(stats.passes <= stats.queries);
  CHECK(stats.max_batch >= 1);
  CHECK(test::error_of([&] { (void)client.query_stats("missing"); }) == ErrorCode::unknown_collection);
}

TEST_CASE("compact storage over TCP: a version-2 client creates and describes f16/i8 collections, a version-1 client still works but cannot create one", "[server][precision]") {
  RunningServer s;
  ClientOptions v2 = s.client(), v1 = s.client();
  v2.protocol_version = 2;
  v1.protocol_version = 1;
  Client client(v2), old(v1);
  CollectionConfig config{4, 2, Metric::dot, std::nullopt, {}};
  config.key_precision = Precision::i8;
  config.value_precision = Precision::f16;
  client.create_collection("small", config);
  CHECK(s.db->collection("small")->config().key_precision == Precision::i8);
  CHECK(s.db->collection("small")->config().value_precision == Precision::f16);
  const CollectionStats st = client.describe("small");
  CHECK(st.key_precision == Precision::i8);
  CHECK(st.value_precision == Precision::f16);
  const std::vector<float> key = {1, 2, 3, 4}, value = {0.1f, 70000};
  CHECK(test::error_of([&] { (void)client.add("small", key, value); }) == ErrorCode::invalid_argument);  // beyond f16
  const auto ids = client.add("small", key, std::vector<float>{0.1f, -3});
  CHECK(client.get("small", ids[0]).value[0] == s.db->collection("small")->get(ids[0]).value[0]);  // the stored f16 value
  CHECK(client.get("small", ids[0]).value[0] != 0.1f);
  // A version-1 client sees the version-1 layouts: describe works without the fields; it cannot create
  // a compact collection (unsupported, nothing sent), and its float32 creates work.
  const CollectionStats old_st = old.describe("small");
  CHECK(old_st.size == 1);
  CHECK(old_st.key_precision == Precision::f32);
  CHECK(test::error_of([&] { old.create_collection("plain", config); }) == ErrorCode::unsupported);
  CHECK_FALSE(s.db->has_collection("plain"));
  old.create_collection("plain", CollectionConfig{4, 2});
  CHECK(s.db->collection("plain")->config().key_precision == Precision::f32);
}
