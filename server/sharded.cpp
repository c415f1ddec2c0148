// The sharded server's life cycle. Rank 0 runs the TCP front end; its request threads hand every
// engine request to the MPI dispatcher (dispatcher.cpp: rank 0's main thread, the only thread of the
// process that calls MPI), which broadcasts it (the request's own wire encoding, concurrent queries
// coalesced) to every rank and runs it there with them (shard.cpp: writes on the owners of their rows,
// queries merged with the library's partial records, stats summed). The other ranks follow rank 0's
// commands until it stops.
#include "sharded.hpp"

#include <functional>
#include <mpi.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "dispatcher.hpp"
#include "shard.hpp"
#include "mpi/sharded_impl.hpp"
#include "softkv/simd.hpp"
#include "softkv/version.hpp"
#include "wire/protocol.hpp"

namespace softkv::server {
namespace {

namespace fs = std::filesystem;

// Each rank's count of logged writes (Database::last_sequence), gathered on rank 0 (empty elsewhere).
std::vector<std::uint64_t> gather_applied(const Database& db, int rank, int size, MPI_Comm comm) {
  std::uint64_t mine = db.last_sequence();
  std::vector<std::uint64_t> all(rank == 0 ? static_cast<std::size_t>(size) : 0);
  MPI_Gather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, 0, comm);
  return all;
}

}  // namespace

std::size_t mpi_world_size() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size == nullptr) return 1;
  const long n = std::strtol(size, nullptr, 10);
  return n > 1 ? static_cast<std::size_t>(n) : 1;
}

int run_sharded(const fs::path& dir, const DatabaseOptions& options, ServerConfig config, const int stop_pipe[2]) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const auto finish = [&](int status) {
    MPI_Comm_free(&comm);
    MPI_Finalize();
    return status;
  };
  if (rank != 0) {  // rank 0 ends the job (mpirun forwards SIGINT/SIGTERM to every rank)
    std::signal(SIGINT, SIG_IGN);
    std::signal(SIGTERM, SIG_IGN);
  }
  // The start-up's steps, each ended by every rank learning its outcome: an exit status, 0 to go on
  // (1: an error, 2: a refused start, docs/SHARDING.md). on_root runs a step on rank 0 and broadcasts its
  // status; on_every_rank runs it everywhere and takes the worst. A step logs its own errors.
  const auto on_root = [&](const std::function<int()>& step) {
    int failed = rank == 0 ? step() : 0;
    MPI_Bcast(&failed, 1, MPI_INT, 0, comm);
    return failed;
  };
  const auto on_every_rank = [&](const std::function<int()>& step) {
    int failed = step();
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, comm);
    return failed;
  };
  // A step's exception: logged whole (rank 0's log is the operator's), turned into its exit status.
  const auto logged = [](const char* where, const std::exception& e, int status) {
    spdlog::error("{}{}", where, e.what());
    return status;
  };
  std::unique_ptr<Database> db;
  const auto stop = [&](int status) {
    db.reset();
    return finish(status);
  };

  // Rank 0 checks (and on first start creates) the job's manifest: shard count and job id; every rank
  // learns the outcome and the manifest.
  JobManifest job;
  if (const int failed = on_root([&] {
        try {
          if (provided < MPI_THREAD_FUNNELED) throw Error(ErrorCode::unsupported, "the MPI library does not provide MPI_THREAD_FUNNELED");
          job = open_job(dir, static_cast<std::size_t>(size));
          return 0;
        } catch (const std::exception& e) {
          return logged("", e, 2);
        }
      }))
    return stop(failed);
  char id[33] = {};
  std::copy(job.job.begin(), job.job.end(), id);
  int flags[2] = {job.created ? 1 : 0, job.upgraded ? 1 : 0};
  MPI_Bcast(id, sizeof(id), MPI_CHAR, 0, comm);
  MPI_Bcast(flags, 2, MPI_INT, 0, comm);
  job = {static_cast<std::size_t>(size), std::string(id, 32), flags[0] != 0, flags[1] != 0};

  // Every rank checks that its directory is this job's shard of its rank, then opens it; the job
  // starts only if all did.
  const fs::path mine = dir / ("shard-" + std::to_string(rank));
  const std::string shard_name = "shard " + std::to_string(rank) + ": ";
  if (const int failed = on_every_rank([&] {
        try {
          check_shard_identity(dir, job, static_cast<std::size_t>(rank));
          return 0;
        } catch (const std::exception& e) {
          return logged(shard_name.c_str(), e, 2);
        }
      }))
    return stop(failed);
  if (const int failed = on_every_rank([&] {
        try {
          db = std::make_unique<Database>(mine, options);
          return 0;
        } catch (const std::exception& e) {
          return logged((shard_name + "cannot open " + mine.string() + ": ").c_str(), e, 1);
        }
      }))
    return stop(failed);
  // Rank 0's commit log tells every rank which cross-shard writes committed; each completes or drops its parts.
  std::unique_ptr<CommitLog> commits;
  std::uint64_t last_committed[2] = {0, 0};  // the write and how many ranks held a part of it
  if (const int failed = on_root([&] {
        try {
          commits = std::make_unique<CommitLog>(dir / "commits", options.fsync == FsyncPolicy::always, job.upgraded);
          last_committed[0] = commits->last();
          last_committed[1] = commits->owners();
          if (commits->damaged_slot())
            spdlog::warn("{}: one of its two slots is damaged (a write torn by a crash, or damage): the commit point is the "
                         "other slot's, cross-shard write {}", (dir / "commits").string(), last_committed[0]);
          return 0;
        } catch (const Error& e) {
          return logged("", e, 2);  // a missing, damaged or unreadable commit log refuses the start, as the other job files do
        } catch (const std::exception& e) {
          return logged("", e, 1);
        }
      }))
    return stop(failed);
  MPI_Bcast(last_committed, 2, MPI_UINT64_T, 0, comm);
  Shard shard(comm, *db, dir, job.job, commits.get(), options.fsync == FsyncPolicy::always);
  try {
    const auto [applied, dropped] = shard.recover(last_committed[0], last_committed[1]);
    if (applied + dropped > 0)
      spdlog::info("shard {}: recovery completed {} committed cross-shard write part(s) and dropped {} uncommitted one(s)",
                   rank, applied, dropped);
  } catch (const std::exception& e) {
    // A damaged or foreign part (or a stray part file) refuses the start like the other job files (2),
    // nothing changed; an I/O error or a failure to apply is 1.
    const auto* error = dynamic_cast<const Error*>(&e);
    const bool refused = error != nullptr && (error->code() == ErrorCode::corrupt_file || error->code() == ErrorCode::invalid_argument);
    if (rank == 0) spdlog::error("recovery of the cross-shard writes failed: {}", e.what());
    return stop(refused ? 2 : 1);
  }
  // Rank 0 compares every shard's logged writes with the progress record of the last start or stop:
  // a shard behind it was restored from an older copy. Then it records where every shard is now.
  const std::vector<std::uint64_t> at_start = gather_applied(*db, rank, size, comm);
  if (const int failed = on_root([&] {
        int refused = 0;
        try {
          if (!job.created && !job.upgraded) {
            for (const std::string& problem : behind_progress(read_progress(dir, job), at_start)) {
              if (options.repair) {
                spdlog::warn("--repair: serving anyway, the writes that shard had applied since are lost for good (a start "
                             "without --repair will not ask again): {}", problem);
              } else {
                spdlog::error("{}", problem);
                refused = 2;
              }
            }
          }
          if (refused == 0) write_progress(dir, job, at_start);
          return refused;
        } catch (const std::exception& e) {
          return logged("", e, 2);
        }
      }))
    return stop(failed);

  int exit_status = 0;  // rank 0: 1 when its server stopped on an error
  if (rank != 0) {
    if (on_root([] { return 0; }) != 0) return stop(1);  // rank 0 could not bind: every rank ends
    follow(comm, shard);
  } else {
    Dispatcher dispatcher(comm, shard, options.coalesce);
    config.forwarder = &dispatcher;
    std::unique_ptr<Server> server;
    if (on_root([&] {
          try {
            server = std::make_unique<Server>(*db, config);
            return 0;
          } catch (const std::exception& e) {
            return logged("", e, 1);
          }
        }))
      return stop(1);
    spdlog::info("softkv-server {} (sharded, {} ranks) on {}:{}, kernel path {}, data {} (shard-0 .. shard-{}), {} collection(s), "
                 "coalescing {}",
                 kVersion, size, config.host, server->port(), simd_path(), dir.string(), size - 1,
                 db->list_collections().size(), options.coalesce ? "on" : "off");
    spdlog::info("connect with: softkv --port {} stats   (or softkv::Client / Python softkv.Client)", server->port());
    std::thread front([&] {
      try {
        server->run();
      } catch (const std::exception& e) {
        spdlog::error("the server stopped on an error: {}", e.what());
        exit_status = 1;
      }
      dispatcher.close();
    });
    std::thread waiter([&] {
      char sig = 0;
      while (::read(stop_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      if (sig != 0) spdlog::info("signal {}: finishing in-flight requests", int(sig));
      server->stop();
    });
    dispatcher.run();  // until the front end has stopped and every request was answered
    front.join();
    const char wake = 0;  // ends the waiter if the server stopped for another reason
    [[maybe_unused]] const auto n = ::write(stop_pipe[1], &wake, 1);
    waiter.join();
    server.reset();
  }
  // Every rank writes a snapshot of its shard before it exits (a fast restart; the logs alone suffice).
  int snapshot_failed = 0;
  try {
    db->snapshot();
  } catch (const std::exception& e) {
    spdlog::error("shard {}: the snapshot before exit failed: {}; the log is intact and the next start replays it", rank, e.what());
    snapshot_failed = 1;
  }
  // The progress record of this clean stop: where a restart must find every shard.
  const std::vector<std::uint64_t> applied = gather_applied(*db, rank, size, comm);
  if (rank == 0) {
    try {
      write_progress(dir, job, applied);
    } catch (const std::exception& e) {
      spdlog::error("the progress record could not be written: {}", e.what());
      snapshot_failed = 1;
    }
  }
  db.reset();
  MPI_Allreduce(MPI_IN_PLACE, &snapshot_failed, 1, MPI_INT, MPI_MAX, comm);
  if (snapshot_failed != 0) exit_status = 1;
  if (rank == 0) spdlog::info(exit_status == 0 ? "stopped" : "stopped with errors");
  return finish(exit_status);
}

}  // namespace softkv::server
