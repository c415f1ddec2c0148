// FrameReader without sockets: frames split at every byte offset, buffer growth only as bytes arrive,
// the server-wide cap on unfinished frames, the pre-auth limit, and release of large buffers.
#include <catch2/catch.hpp>

#include <cstring>

#include "frame_reader.hpp"
#include "server.hpp"
#include "wire/protocol.hpp"

using namespace softkv;
using namespace softkv::server;

namespace {

struct Received {
  std::uint8_t opcode;
  std::uint64_t id;
  std::vector<std::byte> payload;
  bool operator==(const Received&) const = default;
};

// Feeds bytes in pieces of at most `piece` bytes (as reads would deliver them), collecting every
// frame; stops at the first close and returns it.
FrameReader::Next feed(FrameReader& reader, std::span<const std::byte> bytes, std::size_t piece, std::vector<Received>& out) {
  for (;;) {
    FrameReader::Next next = reader.next();
    if (next.status == FrameReader::Status::frame) {
      out.push_back({next.frame.opcode, next.frame.request_id, {next.frame.payload.begin(), next.frame.payload.end()}});
      continue;
    }
    if (next.status == FrameReader::Status::close || bytes.empty()) return next;
    const auto space = reader.space();
    REQUIRE(!space.empty());
    const std::size_t n = std::min({space.size(), bytes.size(), piece});
    std::memcpy(space.data(), bytes.data(), n);
    reader.received(n);
    bytes = bytes.subspan(n);
  }
}

std::vector<std::byte> frame_bytes(std::uint8_t opcode, std::uint64_t id, std::size_t payload_size) {
  std::vector<std::byte> payload(payload_size);
  for (std::size_t i = 0; i < payload_size; ++i) payload[i] = std::byte(i * 31 + id);
  return wire::encode_frame(opcode, id, payload);
}

std::vector<std::byte> header_claiming(std::uint32_t length) {
  std::vector<std::byte> h(13);
  std::memcpy(h.data(), &length, 4);
  h[4] = std::byte{0x20};
  return h;
}

}  // namespace

TEST_CASE("frames split at every byte offset come out whole and in order", "[server][frames]") {
  // Three frames: empty, small, and one larger than the initial buffer (so it grows mid-frame).
  std::vector<std::byte> stream;
  std::vector<Received> expected;
  for (const auto& [id, size] : {std::pair<std::uint64_t, std::size_t>{1, 0}, {2, 37}, {3, FrameReader::kInitialBuffer * 3 + 5}}) {
    const auto f = frame_bytes(0x03, id, size);
    stream.insert(stream.end(), f.begin(), f.end());
    expected.push_back({0x03, id, {f.begin() + 13, f.end()}});
  }
  ReceiveBudget budget(1 << 20);
  for (std::size_t cut = 0; cut <= stream.size(); ++cut) {  // two reads: [0, cut) and the rest
    FrameReader reader(1 << 20, budget);
    std::vector<Received> got;
    feed(reader, std::span(stream).first(cut), stream.size(), got);
    REQUIRE(feed(reader, std::span(stream).subspan(cut), stream.size(), got).status == FrameReader::Status::need_more);
    REQUIRE(got == expected);
    CHECK(reader.pending() == 0);
  }
  for (std::size_t piece : {1, 2, 3, 7, 13, 4096}) {  // many small reads
    FrameReader reader(1 << 20, budget);
    std::vector<Received> got;
    feed(reader, stream, piece, got);
    CHECK(got == expected);
  }
  CHECK(budget.used() == 0);  // every reader gave its growth back when it was destroyed
}

TEST_CASE("a declared frame length allocates nothing: the buffer grows only with the bytes that arrive", "[server][frames]") {
  const std::uint32_t max_frame = 64u << 20;
  ReceiveBudget budget(std::size_t{256} << 20);
  FrameReader reader(max_frame, budget);
  std::vector<Received> got;
  const auto header = header_claiming(max_frame);
  CHECK(feed(reader, header, header.size(), got).status == FrameReader::Status::need_more);
  CHECK(reader.capacity() == FrameReader::kInitialBuffer);  // 13 bytes claiming 64 MiB: no growth
  CHECK(budget.used() == 0);
  std::size_t received = header.size();
  std::vector<std::byte> body(100 * 1024);
  for (int i = 0; i < 40; ++i) {  // ~4 MiB of the 64 MiB body, in 100 KiB reads
    feed(reader, body, body.size(), got);
    received += body.size();
    CHECK(reader.capacity() <= 2 * received);  // never more than double what is held
    CHECK(budget.used() == reader.capacity() - FrameReader::kInitialBuffer);
  }
  CHECK(got.empty());
}

TEST_CASE("the server-wide cap on unfinished frames refuses with server_busy and gives memory back", "[server][frames]") {
  ReceiveBudget budget(1 << 20);
  const auto big = frame_bytes(0x20, 5, 3 << 20);  // 3 MiB: more than the whole budget
  std::vector<Received> got;
  {
    FrameReader reader(8u << 20, budget);
    const FrameReader::Next next = feed(reader, big, 64 * 1024, got);
    REQUIRE(next.status == FrameReader::Status::close);
    CHECK(next.code == ErrorCode::server_busy);
    CHECK(next.reason.find(std::to_string(1 << 20)) != std::string::npos);  // names the cap
    CHECK(budget.used() <= budget.cap());
    CHECK(got.empty());
  }
  CHECK(budget.used() == 0);

  SECTION("two connections share the cap; a finished frame frees its share for the next") {
    const auto half = frame_bytes(0x20, 6, 600 * 1024);  // fits alone, not twice
    FrameReader a(8u << 20, budget), b(8u << 20, budget);
    feed(a, std::span(half).first(half.size() - 1), half.size(), got);  // a holds all but one byte
    const std::size_t held = budget.used();
    CHECK(held > 512 * 1024);
    const FrameReader::Next refused = feed(b, half, half.size(), got);
    CHECK(refused.status == FrameReader::Status::close);
    CHECK(refused.code == ErrorCode::server_busy);
    feed(a, std::span(half).last(1), 1, got);  // a's frame completes ...
    REQUIRE(got.size() == 1);
    CHECK(a.next().status == FrameReader::Status::need_more);  // ... and, idle again, a releases its buffer
    CHECK(a.capacity() == FrameReader::kInitialBuffer);
    FrameReader c(8u << 20, budget);
    CHECK(feed(c, half, half.size(), got).status == FrameReader::Status::need_more);
    CHECK(got.size() == 2);
  }
}

TEST_CASE("frame limits: too large and too short close and the pre-auth limit applies until raised", "[server][frames]") {
  ReceiveBudget budget(1 << 20);
  std::vector<Received> got;
  for (const std::uint32_t length : {std::uint32_t{kUnauthenticatedMaxFrame + 1}, 0xFFFFFFFFu}) {
    FrameReader reader(kUnauthenticatedMaxFrame, budget);
    const FrameReader::Next next = feed(reader, header_claiming(length), 13, got);
    REQUIRE(next.status == FrameReader::Status::close);
    CHECK(next.code == ErrorCode::frame_too_large);
    CHECK(next.reason.find(std::to_string(length)) != std::string::npos);
  }
  for (const std::uint32_t length : {0u, 1u, 8u}) {
    FrameReader reader(1 << 20, budget);
    const FrameReader::Next next = feed(reader, header_claiming(length), 13, got);
    REQUIRE(next.status == FrameReader::Status::close);
    CHECK(next.code == ErrorCode::protocol_error);
  }
  // Exactly at the limit is accepted; raising the limit admits a frame the old one refused.
  FrameReader reader(kUnauthenticatedMaxFrame, budget);
  const auto at_limit = frame_bytes(0x02, 1, kUnauthenticatedMaxFrame - wire::kFrameOverhead);
  CHECK(feed(reader, at_limit, at_limit.size(), got).status == FrameReader::Status::need_more);
  CHECK(got.size() == 1);
  reader.set_max_frame(1 << 20);
  const auto above = frame_bytes(0x20, 2, kUnauthenticatedMaxFrame);
  CHECK(feed(reader, above, above.size(), got).status == FrameReader::Status::need_more);
  CHECK(got.size() == 2);
}
