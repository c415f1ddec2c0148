// Client: blocking POSIX socket I/O around the wire codec; error frames become softkv::Error.
#include "softkv/client.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "softkv/error.hpp"
#include "softkv/version.hpp"
#include "wire/protocol.hpp"

namespace softkv {

class Client::Impl {
 public:
  explicit Impl(const ClientOptions& o) : options_(o) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(o.port);
    if (const int rc = ::getaddrinfo(o.host.c_str(), port.c_str(), &hints, &found); rc != 0)
      throw Error(ErrorCode::io_error, "cannot resolve " + o.host + ": " + ::gai_strerror(rc));
    for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
      fd_ = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd_ >= 0 && ::connect(fd_, a->ai_addr, a->ai_addrlen) != 0) {
        ::close(fd_);
        fd_ = -1;
      }
    }
    ::freeaddrinfo(found);
    if (fd_ < 0) throw Error(ErrorCode::io_error, "cannot connect to " + o.host + ":" + port + ": " + std::strerror(errno));
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (o.protocol_version < wire::kMinProtocolVersion || o.protocol_version > wire::kProtocolVersion)
      throw Error(ErrorCode::invalid_argument, "ClientOptions::protocol_version " + std::to_string(o.protocol_version) + " is not one this client speaks (1, 2 or 3)");
    const auto hello = std::get<wire::HelloReply>(call(wire::Hello{o.protocol_version}));
    if (hello.version < wire::kMinProtocolVersion || hello.version > o.protocol_version)
      throw Error(ErrorCode::protocol_error, "the server settled on protocol version " + std::to_string(hello.version) + ", which this client did not offer");
    version_ = hello.version;
    server_version_ = hello.server_version;
    if (!o.token.empty()) (void)call(wire::Auth{o.token});
  }

  ~Impl() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Sends request, waits for its reply; throws the server's error as softkv::Error.
  wire::Reply call(const wire::Request& request) {
    const std::uint64_t id = ++next_id_;
    const auto bytes = wire::encode_request(request, id, version_);
    // The same check the server makes, before anything is sent: a frame it would refuse fails here
    // with frame_too_large, and the connection stays usable.
    if (const auto scan = wire::scan_frame(bytes, options_.max_frame); scan.status == wire::FrameScan::Status::too_large)
      throw Error(ErrorCode::frame_too_large, "request frame of " + std::to_string(scan.claimed) + " bytes exceeds the limit of " +
                                                  std::to_string(options_.max_frame) + " (ClientOptions::max_frame; the server's --max-frame)");
    send_all(bytes);
    const auto frame_bytes = receive_frame();
    const wire::FrameScan scan = wire::scan_frame(frame_bytes, options_.max_frame);
    if (scan.status != wire::FrameScan::Status::complete) throw Error(ErrorCode::protocol_error, "malformed reply frame");
    if (scan.frame.request_id != id && scan.frame.opcode != wire::kErrorOpcode)
      throw Error(ErrorCode::protocol_error, "reply for request " + std::to_string(scan.frame.request_id) + ", expected " + std::to_string(id));
    const auto kind = std::holds_alternative<wire::Query>(request) ? std::get<wire::Query>(request).kind : wire::QueryKind::soft;
    wire::Reply reply = wire::decode_reply(wire::opcode_of(request), scan.frame, kind, version_);
    if (auto* e = std::get_if<wire::ErrorReply>(&reply)) throw Error(e->code, e->message);  // the server's message, which names its code
    return reply;
  }

  const ClientOptions options_;
  std::string server_version_;
  std::uint16_t version_ = wire::kMinProtocolVersion;  // until hello settles it

 private:
  void wait_for(short events) {
    pollfd p{fd_, events, 0};
    const int ms = static_cast<int>(options_.timeout_seconds * 1000);
    for (;;) {
      const int rc = ::poll(&p, 1, ms);
      if (rc > 0) return;
      if (rc == 0) throw Error(ErrorCode::io_error, "timed out waiting for the server");
      if (errno != EINTR) throw Error(ErrorCode::io_error, std::string("poll: ") + std::strerror(errno));
    }
  }

  void send_all(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      wait_for(POLLOUT);
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        throw Error(ErrorCode::io_error, std::string("send: ") + std::strerror(errno));
      }
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }

  void receive_exact(std::byte* out, std::size_t size) {
    while (size > 0) {
      wait_for(POLLIN);
      const ssize_t n = ::recv(fd_, out, size, 0);
      if (n == 0) throw Error(ErrorCode::io_error, "the server closed the connection");
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        throw Error(ErrorCode::io_error, std::string("recv: ") + std::strerror(errno));
      }
      out += n;
      size -= static_cast<std::size_t>(n);
    }
  }

  std::vector<std::byte> receive_frame() {
    std::vector<std::byte> frame(wire::kLengthPrefix);
    receive_exact(frame.data(), frame.size());
    const wire::FrameScan head = wire::scan_frame(frame, options_.max_frame);  // the length alone, checked as the server does
    if (head.status == wire::FrameScan::Status::too_large)
      throw Error(ErrorCode::frame_too_large, "reply frame of " + std::to_string(head.claimed) + " bytes exceeds the limit of " +
                                                  std::to_string(options_.max_frame));
    if (head.status == wire::FrameScan::Status::malformed)
      throw Error(ErrorCode::protocol_error, "reply frame length " + std::to_string(head.claimed) + " is shorter than a frame header");
    frame.resize(wire::kLengthPrefix + head.claimed);
    receive_exact(frame.data() + wire::kLengthPrefix, head.claimed);
    return frame;
  }

  int fd_ = -1;
  std::uint64_t next_id_ = 0;
};

namespace {
std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }
}  // namespace

Client::Client(const ClientOptions& options) : impl_(std::make_unique<Impl>(options)) {}
Client::~Client() = default;
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;

void Client::ping() { (void)impl_->call(wire::Ping{}); }
const std::string& Client::server_version() const noexcept { return impl_->server_version_; }
std::uint16_t Client::protocol_version() const noexcept { return impl_->version_; }

void Client::create_collection(std::string_view name, const CollectionConfig& config) {
  (void)impl_->call(wire::Create{std::string(name), config});
}
void Client::drop_collection(std::string_view name) { (void)impl_->call(wire::Drop{std::string(name)}); }
std::vector<std::string> Client::list_collections() { return std::get<wire::NamesReply>(impl_->call(wire::List{})).names; }
CollectionStats Client::describe(std::string_view name) {
  return std::get<wire::DescribeReply>(impl_->call(wire::Describe{std::string(name)})).stats;
}

CoalescingStats Client::query_stats(std::string_view name) {
  return std::get<wire::QueryStatsReply>(impl_->call(wire::QueryStats{std::string(name)})).stats;
}

std::vector<std::uint64_t> Client::add(std::string_view name, std::span<const float> keys, std::span<const float> values,
                                      std::span<const std::uint64_t> tags) {
  return std::get<wire::IdsReply>(impl_->call(wire::Add{std::string(name), copy(keys), copy(values), {tags.begin(), tags.end()}})).ids;
}
void Client::upsert(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> keys,
                    std::span<const float> values, std::span<const std::uint64_t> tags) {
  (void)impl_->call(wire::Upsert{std::string(name), {ids.begin(), ids.end()}, copy(keys), copy(values), {tags.begin(), tags.end()}});
}
void Client::remove(std::string_view name, std::span<const std::uint64_t> ids) {
  (void)impl_->call(wire::Remove{std::string(name), {ids.begin(), ids.end()}});
}
Entry Client::get(std::string_view name, std::uint64_t id) {
  return std::get<wire::GetReply>(impl_->call(wire::Get{std::string(name), id})).entry;
}

QueryResults Client::query(std::string_view name, std::span<const float> queries, Retrieval kind, const QueryOptions& options) {
  if (kind != Retrieval::soft && kind != Retrieval::hard) throw Error(ErrorCode::invalid_argument, "unknown retrieval kind");
  const wire::QueryKind wire_kind = kind == Retrieval::hard ? wire::QueryKind::hard : wire::QueryKind::soft;
  wire::Reply reply = impl_->call(wire::Query{std::string(name), wire_kind, options, copy(queries)});
  QueryResults out;
  if (kind == Retrieval::hard) out.hard = std::move(std::get<wire::HardReply>(reply).results);
  else out.soft = std::move(std::get<wire::SoftReply>(reply).results);
  return out;
}
std::vector<SoftResult> Client::query_soft_batch(std::string_view name, std::span<const float> queries, const QueryOptions& options) {
  return std::move(query(name, queries, Retrieval::soft, options).soft);
}
std::vector<HardResult> Client::query_hard_batch(std::string_view name, std::span<const float> queries, const QueryOptions& options) {
  return std::move(query(name, queries, Retrieval::hard, options).hard);
}
SoftResult Client::query_soft(std::string_view name, std::span<const float> query, const QueryOptions& options) {
  auto r = query_soft_batch(name, query, options);
  if (r.size() != 1) throw Error(ErrorCode::protocol_error, "expected one result, got " + std::to_string(r.size()));
  return std::move(r.front());
}
HardResult Client::query_hard(std::string_view name, std::span<const float> query, const QueryOptions& options) {
  auto r = query_hard_batch(name, query, options);
  if (r.size() != 1) throw Error(ErrorCode::protocol_error, "expected one result, got " + std::to_string(r.size()));
  return std::move(r.front());
}

void Client::snapshot() { (void)impl_->call(wire::Snapshot{}); }

ServerStats Client::stats() {
  const auto s = std::get<wire::StatsReply>(impl_->call(wire::Stats{}));
  return {s.server_version, s.simd_path, s.collections, s.connections, s.requests, s.last_sequence};
}

}  // namespace softkv
