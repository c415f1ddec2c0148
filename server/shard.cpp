// One rank of the sharded server: a request run on every rank together (each rank's share of it on
// its own Database), and the commit protocol of writes over several shards (docs/SHARDING.md, "The sharded server").
#include "shard.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "error_of.hpp"
#include "handler.hpp"
#include "ids.hpp"
#include "mpi/parts.hpp"
#include "mpi/sharded_impl.hpp"
#include "overloaded.hpp"
#include "query/plan.hpp"
#include "softkv/simd.hpp"
#include "softkv/version.hpp"

namespace softkv::server {
namespace {

namespace fs = std::filesystem;
using detail::Overloaded;

// fsync of a directory: its entries (a created, renamed or removed file) on stable storage.
void sync_directory(const fs::path& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::uint64_t check_word(std::uint64_t txn) { return txn * 0x9E3779B97F4A7C15ull + 0x736f66746b76ull; }

// Writes bytes to path, on stable storage (file and directory) when sync.
void write_file(const fs::path& path, std::span<const std::byte> bytes, bool sync) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(ErrorCode::io_error, "cannot create " + path.string() + ": " + std::strerror(errno));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      throw Error(ErrorCode::io_error, "cannot write " + path.string() + ": " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  const bool synced = !sync || ::fdatasync(fd) == 0;
  ::close(fd);
  if (!synced) throw Error(ErrorCode::io_error, "cannot fsync " + path.string() + ": " + std::strerror(errno));
  if (sync) sync_directory(path.parent_path());
}

}  // namespace

namespace {

// Format 2: a slot's first word is the write number in its low 48 bits and the number of ranks that
// held a part of it in its high 16 (recovery checks that none is missing). Format 1 (the same size, no
// owner count) is read and its header rewritten as format 2, which an older build then refuses.
constexpr char kCommitMagic[16] = "softkv-commits2";   // 15 characters and the terminating zero
constexpr char kCommitMagic1[16] = "softkv-commits1";  // format 1
constexpr std::size_t kCommitBytes = 48;               // header, two slots
constexpr std::uint64_t kTxnBits = 48;

// The commit log as create() writes it: header, slots {0, check_word(0)} twice, or slots {last, ...}.
std::array<std::uint64_t, 6> commit_image(std::uint64_t a, std::uint64_t b) {
  std::array<std::uint64_t, 6> words{};
  std::memcpy(words.data(), kCommitMagic, sizeof kCommitMagic);
  words[2] = a;
  words[3] = check_word(a);
  words[4] = b;
  words[5] = check_word(b);
  return words;
}

}  // namespace

void CommitLog::create(const fs::path& path) {
  const auto image = commit_image(0, 0);
  write_file(path, std::as_bytes(std::span(image)), true);
}

CommitLog::CommitLog(const fs::path& path, bool sync, bool legacy) : sync_(sync) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC | (legacy ? O_CREAT : 0), 0644);
  if (fd_ < 0) {
    const int err = errno;
    throw Error(err == ENOENT ? ErrorCode::invalid_argument : ErrorCode::io_error,
                err == ENOENT ? path.string() + " (the commit log of cross-shard writes) is missing: restore the whole job directory "
                                                "from one backup (docs/SHARDING.md)"
                              : "cannot open " + path.string() + ": " + std::strerror(err));
  }
  std::uint64_t words[6] = {};
  const ssize_t n = ::pread(fd_, words, sizeof(words), 0);
  const auto fail = [&](const std::string& why) {
    ::close(fd_);
    throw Error(ErrorCode::corrupt_file, path.string() + " (the commit log of cross-shard writes) " + why);
  };
  if (legacy) {  // two slots from offset 0 (a file shorter than a slot: nothing was committed)
    for (int i = 0; i < 2 && n >= (i + 1) * 16; ++i)
      if (words[2 * i + 1] == check_word(words[2 * i])) last_ = std::max(last_, words[2 * i]);
    const auto image = commit_image(last_, last_);
    if (::pwrite(fd_, image.data(), kCommitBytes, 0) != static_cast<ssize_t>(kCommitBytes) || ::fdatasync(fd_) != 0) {
      ::close(fd_);
      throw Error(ErrorCode::io_error, "cannot rewrite " + path.string() + ": " + std::strerror(errno));
    }
    return;
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(std::string("cannot be examined: ") + std::strerror(errno));
  if (n != static_cast<ssize_t>(kCommitBytes) || st.st_size != static_cast<off_t>(kCommitBytes))
    fail("has " + std::to_string(st.st_size) + " bytes, not 48");
  const bool format1 = std::memcmp(words, kCommitMagic1, sizeof kCommitMagic1) == 0;
  if (!format1 && std::memcmp(words, kCommitMagic, sizeof kCommitMagic) != 0) fail("has a damaged header");
  int valid = 0;
  std::uint64_t best = 0;
  for (int i = 1; i <= 2; ++i)
    if (words[2 * i + 1] == check_word(words[2 * i])) {
      const std::uint64_t txn = format1 ? words[2 * i] : words[2 * i] & ((std::uint64_t{1} << kTxnBits) - 1);
      if (valid == 0 || txn > last_) {
        last_ = txn;
        best = words[2 * i];
      }
      ++valid;
    }
  if (valid == 0) fail("is damaged: neither slot holds a valid commit point");
  damaged_slot_ = valid == 1;
  owners_ = format1 ? 0 : best >> kTxnBits;
  if (format1 && (::pwrite(fd_, kCommitMagic, sizeof kCommitMagic, 0) != static_cast<ssize_t>(sizeof kCommitMagic) ||
                  ::fdatasync(fd_) != 0)) {
    ::close(fd_);
    throw Error(ErrorCode::io_error, "cannot rewrite the header of " + path.string() + ": " + std::strerror(errno));
  }
}

CommitLog::~CommitLog() { ::close(fd_); }

void CommitLog::commit(std::uint64_t txn, std::size_t owners) {
  if (txn >> kTxnBits != 0 || owners >> (64 - kTxnBits) != 0)
    throw Error(ErrorCode::resource_exhausted, "the commit log numbers at most 2^48 cross-shard writes over at most 65,535 ranks");
  const std::uint64_t word = txn | (static_cast<std::uint64_t>(owners) << kTxnBits);
  const std::uint64_t slot[2] = {word, check_word(word)};
  if (::pwrite(fd_, slot, sizeof(slot), static_cast<off_t>(sizeof(kCommitMagic) + (txn % 2) * sizeof(slot))) != static_cast<ssize_t>(sizeof(slot)) ||
      (sync_ && ::fdatasync(fd_) != 0))
    throw Error(ErrorCode::io_error, std::string("cannot record a commit point in the commit log: ") + std::strerror(errno));
  last_ = txn;
  owners_ = owners;
}

wire::Request decode_command(std::span<const std::byte> bytes) {
  const wire::FrameScan scan = wire::scan_frame(bytes, std::numeric_limits<std::uint32_t>::max());
  if (scan.status != wire::FrameScan::Status::complete) throw Error(ErrorCode::corrupt_file, "an incomplete request frame");
  return wire::decode_request(scan.frame, wire::kProtocolVersion);
}

namespace {

// Part files before format "skvpart1" held the part as a request frame (which starts with its length,
// never with the part magic): read for one release, so a job that crashed mid-commit can be upgraded.
bool is_legacy_part(std::span<const std::byte> bytes) {
  return bytes.size() < 8 || std::memcmp(bytes.data(), "skvpart1", 8) != 0;
}

detail::Mutation legacy_part(std::span<const std::byte> bytes) {
  return std::visit(Overloaded{
                        [](const wire::Create& m) -> detail::Mutation { return detail::mutation::Create{m.name, m.config}; },
                        [](const wire::Drop& m) -> detail::Mutation { return detail::mutation::Drop{m.name}; },
                        [](const wire::Upsert& m) -> detail::Mutation {
                          return detail::mutation::Upsert{m.name, Rows{m.ids, m.keys, m.values, m.tags}, true};
                        },
                        [](const wire::Remove& m) -> detail::Mutation { return detail::mutation::Remove{m.name, m.ids}; },
                        [](const auto&) -> detail::Mutation { throw Error(ErrorCode::corrupt_file, "a part that is not a write"); },
                    },
                    decode_command(bytes));
}

}  // namespace

CrashPoint::CrashPoint() {
  const char* spec = std::getenv("SOFTKV_TEST_CRASH");
  if (spec == nullptr) return;
  const std::string s(spec);
  const auto a = s.find(':'), b = s.rfind(':');
  if (a == std::string::npos || b == a) return;
  rank = std::atoi(s.substr(0, a).c_str());
  point = s.substr(a + 1, b - a - 1);
  nth = std::strtoull(s.substr(b + 1).c_str(), nullptr, 10);
}

void CrashPoint::at(std::size_t my_rank, const char* here, std::uint64_t count) const {
  if (rank == static_cast<int>(my_rank) && point == here && count == nth) ::kill(::getpid(), SIGKILL);
}


void Shard::agree(const std::function<void()>& body) const { detail::agree(comm_, body); }

Shard::Shard(MPI_Comm comm, Database& db, fs::path dir, std::string job, CommitLog* commits, bool sync)
    : comm_(comm), db_(db), dir_(std::move(dir)), job_(std::move(job)), commits_(commits), sync_(sync) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  rank_ = static_cast<std::size_t>(rank);
  ranks_ = static_cast<std::size_t>(size);
}

std::pair<std::size_t, std::size_t> Shard::recover(std::uint64_t last_committed, std::uint64_t owners) {
  next_txn_ = last_committed + 1;
  // Phase 1, nothing changed yet: every rank reads and checks the parts it must complete. A damaged or
  // foreign one stops the start on every rank with the directory as it was (an operator can restore
  // the job from its backup: docs/SHARDING.md).
  std::vector<std::tuple<std::uint64_t, fs::path, detail::Mutation>> committed;
  std::vector<fs::path> uncommitted, markers;
  std::optional<fs::path> marker_of_last;  // this rank's applied marker of the last committed write
  std::uint64_t holds_last = 0;  // this rank holds the part of the last committed write, or its applied marker
  // <kind>-<r>-<n> names rank r's file of write n: (r, n), or Error(invalid_argument) for another name
  // of that kind or a rank the job does not have.
  const auto rank_and_write = [&](const fs::path& path, const char* kind) {
    unsigned long long r = 0, txn = 0;
    char tail = 0;
    if (std::sscanf(path.filename().c_str(), (std::string(kind) + "-%llu-%llu%c").c_str(), &r, &txn, &tail) != 2)
      throw Error(ErrorCode::invalid_argument, path.string() + " is not a file this job writes (" + kind + "-<rank>-<write>)");
    if (r >= ranks_)
      throw Error(ErrorCode::invalid_argument, path.string() + " belongs to rank " + std::to_string(r) + ", but this job has " +
                                                   std::to_string(ranks_) + " ranks");
    return std::pair<std::size_t, std::uint64_t>(r, txn);
  };
  agree([&] {
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("applied-", 0) == 0) {  // applied-<r>-<n>: rank r applied its part of write n
        const auto [r, txn] = rank_and_write(e.path(), "applied");
        if (r != rank_) continue;
        // Applied only after its commit point was on disk: the commit log lost it. (Without --fsync always
        // neither is synced, and a machine crash may keep the marker and lose the commit point: then the
        // marker goes, as the write's other effects may, docs/SHARDING.md.)
        if (txn > last_committed && sync_)
          throw Error(ErrorCode::corrupt_file, e.path().string() + " shows that cross-shard write " + std::to_string(txn) +
                                                   " was committed and applied, but the commit log's last commit point is " +
                                                   std::to_string(last_committed) + ": the commit log is damaged or older than "
                                                   "the shards; restore the whole job directory from one backup (docs/SHARDING.md)");
        if (txn == last_committed) {
          holds_last = 1;
          marker_of_last = e.path();
        } else {
          markers.push_back(e.path());  // an earlier write, applied everywhere
        }
        continue;
      }
      if (name.rfind("part-", 0) != 0) continue;
      const auto [r, txn] = rank_and_write(e.path(), "part");
      if (r != rank_) continue;
      if (txn > last_committed) {  // never committed: no client was told it succeeded
        uncommitted.push_back(e.path());
        continue;
      }
      std::ifstream in(e.path(), std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const auto bytes = std::as_bytes(std::span(text.data(), text.size()));
      const std::string what = e.path().string() + " (the part of committed write " + std::to_string(txn) + ")";
      try {
        if (is_legacy_part(bytes)) {
          committed.emplace_back(txn, e.path(), legacy_part(bytes));
          if (txn == last_committed) holds_last = 1;
          continue;
        }
        detail::Part part = detail::decode_part(bytes, e.path().string());
        const detail::PartTag expected{job_, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(ranks_), txn};
        if (!(part.tag == expected))
          throw Error(ErrorCode::corrupt_file, "it belongs to rank " + std::to_string(part.tag.rank) + " of " +
                                                   std::to_string(part.tag.ranks) + ", job '" + part.tag.job + "', write " +
                                                   std::to_string(part.tag.txn) + ": a file copied from elsewhere");
        committed.emplace_back(txn, e.path(), std::move(part.mutation));
        if (txn == last_committed) holds_last = 1;
      } catch (const Error& err) {
        throw Error(ErrorCode::corrupt_file, what + " cannot be used: " + err.what());
      }
    }
  });
  // Every rank that held a part of the last committed write still has it, or its applied marker: a
  // part deleted by hand would leave that write half applied.
  MPI_Allreduce(MPI_IN_PLACE, &holds_last, 1, MPI_UINT64_T, MPI_SUM, comm_);
  if (owners != 0 && holds_last < owners)
    throw Error(ErrorCode::corrupt_file, "cross-shard write " + std::to_string(last_committed) + " was committed with parts on " +
                                             std::to_string(owners) + " ranks, but only " + std::to_string(holds_last) +
                                             " hold their part (part-<rank>-" + std::to_string(last_committed) + ") or its applied "
                                             "marker: a part file was deleted; restore the whole job directory from one backup "
                                             "(docs/SHARDING.md)");
  // Phase 2: complete the committed parts in write order, drop the others.
  std::sort(committed.begin(), committed.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  agree([&] {
    for (const auto& [txn, path, part] : committed) {
      apply_part(part);
      if (txn == last_committed) last_marker_ = mark_applied(path);
      else fs::remove(path);
    }
    for (const fs::path& path : uncommitted) fs::remove(path);
    for (const fs::path& path : markers) fs::remove(path);
    if (!last_marker_) last_marker_ = marker_of_last;  // the marker already there stays until the next write commits
  });
  return {committed.size(), uncommitted.size()};
}

wire::Reply Shard::execute(const wire::Request& request) {
  return std::visit(
      Overloaded{
          [](const wire::Hello&) -> wire::Reply { throw session_only(); },
          [](const wire::Auth&) -> wire::Reply { throw session_only(); },
          [](const wire::Ping&) -> wire::Reply { throw session_only(); },
          [&](const wire::Create& m) -> wire::Reply {
            agree([&] {
              Database::check_name(m.name);
              check_config(m.config);
              if (m.config.heads != 1)  // the shards' partial answers merge one softmax per query
                throw Error(ErrorCode::unsupported, "multi-head collections (heads > 1) are not supported by the sharded server");
              if (db_.has_collection(m.name)) throw Error(ErrorCode::collection_exists, "a collection named '" + m.name + "' exists");
            });
            mutate(detail::mutation::Create{m.name, m.config});
            return wire::Ack{};
          },
          [&](const wire::Drop& m) -> wire::Reply {
            agree([&] { (void)db_.collection(m.name); });
            mutate(detail::mutation::Drop{m.name});
            return wire::Ack{};
          },
          [&](const wire::List&) -> wire::Reply { return wire::NamesReply{db_.list_collections()}; },
          [&](const wire::Describe& m) -> wire::Reply { return describe(m); },
          [&](const wire::QueryStats&) -> wire::Reply {  // rank 0's dispatcher keeps the counters (dispatcher.cpp)
            throw Error(ErrorCode::internal, "query_stats is answered by rank 0's dispatcher, not by the shards");
          },
          [&](const wire::Add& m) -> wire::Reply { return add(m); },
          [&](const wire::Upsert& m) -> wire::Reply {
            agree([&] {
              const auto c = db_.collection(m.name);
              const Rows rows = c->prepare(m.ids, m.keys, m.values, m.tags);
              if (rows.ids.size() * c->config().dim != rows.keys.size())  // no ids for n > 0 rows (as Database::upsert)
                throw Error(ErrorCode::dimension_mismatch,
                            "0 ids but " + std::to_string(rows.keys.size() / c->config().dim) + " keys");
              detail::mpi_count(m.ids.size(), "a write");
            });
            mutate(detail::mutation::Upsert{m.name, Rows{m.ids, m.keys, m.values, m.tags}, true});
            return wire::Ack{};
          },
          [&](const wire::Remove& m) -> wire::Reply { return remove(m); },
          [&](const wire::Get& m) -> wire::Reply { return get(m); },
          [&](const wire::Query& m) -> wire::Reply { return query(m); },
          [&](const wire::Snapshot&) -> wire::Reply {
            agree([&] { db_.snapshot(); });
            return wire::Ack{};
          },
          [&](const wire::Stats&) -> wire::Reply {
            std::uint64_t sequence = db_.last_sequence();  // the sum over shards of their logged mutations
            MPI_Allreduce(MPI_IN_PLACE, &sequence, 1, MPI_UINT64_T, MPI_SUM, comm_);
            return wire::StatsReply{kVersion, std::string(simd_path()), db_.list_collections().size(), 0, 0, sequence};
          },
      },
      request);
}


void Shard::apply_part(const detail::Mutation& part) {
  std::visit(Overloaded{
                 [&](const detail::mutation::Create& m) {
                   if (!db_.has_collection(m.name)) db_.create_collection(m.name, m.config);
                 },
                 [&](const detail::mutation::Drop& m) {
                   if (db_.has_collection(m.name)) db_.drop_collection(m.name);
                 },
                 [&](const detail::mutation::Upsert& m) {  // keys as the client gave them: the Database prepares them
                   db_.upsert(m.name, m.rows.ids, m.rows.keys, m.rows.values, m.rows.tags);
                 },
                 [&](const detail::mutation::Remove& m) {
                   const auto c = db_.collection(m.name);
                   std::vector<std::uint64_t> present;
                   for (std::uint64_t id : m.ids)
                     if (c->contains(id)) present.push_back(id);
                   if (!present.empty()) db_.remove(m.name, present);
                 },
             },
             part);
}

void Shard::mutate(const detail::Mutation& whole) {
  std::optional<detail::Mutation> mine;
  std::size_t owners = 0;
  agree([&] {
    mine = detail::part_of(whole, rank_, ranks_);  // the split ShardedCollection scatters
    owners = detail::owners_of(whole, ranks_);
  });
  if (owners <= 1) {
    agree([&] {
      if (mine) apply_part(*mine);
    });
    return;
  }
  const std::uint64_t txn = next_txn_++;
  ++spanning_;
  const fs::path part_file = dir_ / ("part-" + std::to_string(rank_) + "-" + std::to_string(txn));
  const auto forget = [&] {
    std::error_code ec;
    fs::remove(part_file, ec);
  };
  try {
    crash_.at(rank_, "write", spanning_);
    agree([&] {
      if (mine)
        write_file(part_file,
                   detail::encode_part(*mine, {job_, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(ranks_), txn}),
                   sync_);
    });
    crash_.at(rank_, "parts", spanning_);
    agree([&] {
      if (commits_ != nullptr) commits_->commit(txn, owners);
    });
  } catch (...) {
    forget();  // not committed: no rank applies its part
    throw;
  }
  crash_.at(rank_, "commit", spanning_);
  agree([&] {
    // Write txn is committed: every earlier one was applied everywhere, so their markers can go.
    if (last_marker_) {
      std::error_code ec;
      fs::remove(*last_marker_, ec);
      last_marker_.reset();
    }
    if (!mine) return;
    apply_part(*mine);  // on failure the file stays: the next start completes the committed write
    last_marker_ = mark_applied(part_file);
  });
}

fs::path Shard::mark_applied(const fs::path& part) const {
  // part-<r>-<n> becomes applied-<r>-<n>, emptied: until the next cross-shard write commits, it tells a
  // restart that this rank held a part of write n and applied it (a part missing without its marker was
  // deleted by hand). Synced under --fsync always, so that the part cannot come back after a power loss
  // and be applied again over later writes.
  const fs::path marker = part.parent_path() / ("applied" + part.filename().string().substr(4));
  fs::rename(part, marker);
  fs::resize_file(marker, 0);
  if (sync_) sync_directory(dir_);
  return marker;
}

wire::Reply Shard::add(const wire::Add& m) {
  std::uint64_t first = 0;
  std::size_t n = 0;
  agree([&] {
    const auto c = db_.collection(m.name);
    (void)c->prepare({}, m.keys, m.values, m.tags);  // every check Database::add makes, on every rank alike
    first = c->next_id();
    n = m.keys.size() / c->config().dim;
  });
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_UINT64_T, MPI_MAX, comm_);  // the global next id
  std::vector<std::uint64_t> ids = detail::next_ids(first, n);  // the same on every rank: all throw or none
  mutate(detail::mutation::Upsert{m.name, Rows{ids, m.keys, m.values, m.tags}, true});
  return wire::IdsReply{std::move(ids)};
}

wire::Reply Shard::remove(const wire::Remove& m) {
  std::uint64_t missing = kReservedId;
  agree([&] {
    const auto c = db_.collection(m.name);
    detail::check_distinct(m.ids);
    for (std::uint64_t id : m.ids)
      if (shard_owner(id, ranks_) == rank_ && !c->contains(id)) missing = std::min(missing, id);
  });
  MPI_Allreduce(MPI_IN_PLACE, &missing, 1, MPI_UINT64_T, MPI_MIN, comm_);
  if (missing != kReservedId) throw Error(ErrorCode::unknown_id, "remove: no entry has id " + std::to_string(missing));
  mutate(detail::mutation::Remove{m.name, m.ids});
  return wire::Ack{};
}

wire::Reply Shard::get(const wire::Get& m) {
  const int owner = static_cast<int>(shard_owner(m.id, ranks_));
  Entry entry;
  detail::RootStatus status;
  if (owner == static_cast<int>(rank_)) {
    try {
      entry = db_.collection(m.name)->get(m.id);
    } catch (const Error& e) {
      status = detail::status_of(e);
    } catch (const std::bad_alloc&) {
      status = detail::status_of(Error(ErrorCode::resource_exhausted, "get: out of memory on the owner"));
    }
  }
  detail::broadcast_status(status, owner, comm_);
  std::uint64_t shape[3] = {entry.key.size(), entry.value.size(), entry.tag};
  MPI_Bcast(shape, 3, MPI_UINT64_T, owner, comm_);
  entry.id = m.id;
  entry.key.resize(shape[0]);
  entry.value.resize(shape[1]);
  entry.tag = shape[2];
  MPI_Bcast(entry.key.data(), static_cast<int>(shape[0]), MPI_FLOAT, owner, comm_);
  MPI_Bcast(entry.value.data(), static_cast<int>(shape[1]), MPI_FLOAT, owner, comm_);
  return wire::GetReply{std::move(entry)};
}

wire::Reply Shard::describe(const wire::Describe& m) {
  CollectionStats stats;
  agree([&] { stats = db_.stats(m.name); });
  std::uint64_t sums[3] = {stats.size, stats.bytes_in_memory, stats.bytes_on_disk};
  MPI_Allreduce(MPI_IN_PLACE, sums, 3, MPI_UINT64_T, MPI_SUM, comm_);
  stats.size = sums[0];
  stats.bytes_in_memory = sums[1];
  stats.bytes_on_disk = sums[2];
  return wire::DescribeReply{std::move(stats)};
}

wire::Reply Shard::query(const wire::Query& m) {
  const Retrieval kind = m.kind == wire::QueryKind::hard ? Retrieval::hard : Retrieval::soft;
  std::shared_ptr<const Collection> c;
  std::size_t n = 0;
  agree([&] {
    c = db_.collection(m.name);
    n = detail::check_query(*c, m.queries, kind, m.options);
  });
  const detail::ShardScan scan{*c, comm_, rank_, ranks_, nullptr};
  QueryResults r = scan.answer(m.queries, n, kind, m.options);
  if (kind == Retrieval::hard) return wire::HardReply{std::move(r.hard)};
  return wire::SoftReply{std::move(r.soft)};
}

std::size_t Shard::one_pass_queries(const wire::Query& q) const {
  try {
    const Retrieval kind = q.kind == wire::QueryKind::hard ? Retrieval::hard : Retrieval::soft;
    const auto c = db_.collection(q.name);
    const std::size_t n = detail::check_query(*c, q.queries, kind, q.options);
    return detail::shares_a_pass(c->config(), q.options, kind) ? n : 0;  // the plan Collection::query follows
  } catch (const std::exception&) {  // its own run reports the error to its own client
    return 0;
  }
}

void Shard::require_collection(const std::string& name) const { (void)db_.collection(name); }

}  // namespace softkv::server
