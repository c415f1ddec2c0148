// softkv-server: serves a softkv database over TCP (docs/PROTOCOL.md).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <malloc.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <fstream>
#include <string>
#include <thread>

#include "server.hpp"
#ifdef SOFTKV_SERVER_MPI
#include "sharded.hpp"
#endif
#include "softkv/softkv.hpp"

namespace {

// SIGINT/SIGTERM write their number to this pipe; a thread reads it and stops the server. A handler
// (rather than blocking the signals) is needed because libraries such as OpenBLAS start threads
// before main, and any of them may receive a process-directed signal.
int signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const char byte = static_cast<char>(sig);
  [[maybe_unused]] const auto n = ::write(signal_pipe[1], &byte, 1);  // async-signal-safe
}

// How to run the softkv command-line client that was built beside this server: its path when the
// server was started by a path (./build/server/softkv-server -> ./build/server/softkv), else "softkv".
std::string cli_beside(const char* argv0) {
  const std::string self = argv0 != nullptr ? argv0 : "";
  const auto slash = self.rfind('/');
  return slash == std::string::npos ? "softkv" : self.substr(0, slash + 1) + "softkv";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"softkv-server: a soft-retrieval key-value store over TCP"};
  std::string data = "./softkv-data", fsync = "always", token_file;
  softkv::server::ServerConfig config;
  std::uint64_t snapshot_mb = 64, pending_mb = config.max_pending_bytes >> 20;
  bool repair = false;
  unsigned idle_s = 300, deadline_s = 10, reply_s = 30;
  app.add_option("--data", data, "data directory")->capture_default_str();
  app.add_option("--host", config.host, "bind address")->capture_default_str();
  app.add_option("--port", config.port, "port (0: any free port)")->capture_default_str();
  app.add_option("--port-file", config.port_file,
                 "once listening, write the bound port to this file (with --port 0: how a script learns the port without a race; default: none)");
  app.add_option("--threads", config.io_threads, "I/O threads")->capture_default_str();
  app.add_option("--workers", config.workers, "request threads (0: 64; they mostly wait, the scan pool computes)")->capture_default_str();
  std::string coalesce = "on";
  app.add_option("--coalesce", coalesce, "concurrent single queries (sharded server: also batches) on a collection share one pass (on | off)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--fsync", fsync, "when writes reach the disk: always (before each reply), everysec (at most 1 s of writes lost on power loss), never (the OS decides)")->check(CLI::IsMember({"always", "everysec", "never"}))->capture_default_str();
  app.add_option("--auth-token-file", token_file, "file holding the auth token clients must send (default: none, no auth)");
  app.add_flag("--insecure", config.insecure, "allow a non-loopback bind without a token (default: off)");
  bool tune = false;
  app.add_flag("--tune-scans", tune,
               "measure the scans' prefetch settings on this machine at start-up (~0.4 s, 256 MiB while it runs) and keep the "
               "fastest, and choose the batch tile products (~20 ms; otherwise at the first batch) (default: off)");
  app.add_option("--max-frame", config.max_frame, "largest frame in bytes")->capture_default_str();
  app.add_option("--max-connections", config.max_connections,
                 "connection limit (lowered to fit under the file-descriptor limit, keeping 1/8 of it, at least 32, for files)")
      ->capture_default_str();
  app.add_option("--max-pending-mb", pending_mb,
                 "MiB of receive buffers that unfinished frames may hold, all connections together; beyond it a connection "
                 "is answered server_busy and closed")
      ->capture_default_str();
  app.add_option("--idle-timeout", idle_s, "seconds before an idle connection is closed")->capture_default_str();
  app.add_option("--frame-deadline", deadline_s, "seconds to finish sending a started frame")->capture_default_str();
  app.add_option("--reply-deadline", reply_s, "seconds a client may take to read a reply before it is disconnected")->capture_default_str();
  app.add_option("--snapshot-after-mb", snapshot_mb, "log megabytes between background snapshots (0: never)")->capture_default_str();
  app.add_flag("--repair", repair,
               "start even if a log record is corrupt: keep the records before it, set the later log segments aside as "
               "*.corrupt (their writes are lost) and log what was kept; cannot bridge a missing log segment or a damaged snapshot "
               "(default: off)");
  CLI11_PARSE(app, argc, argv);
  config.max_pending_bytes = static_cast<std::size_t>(pending_mb) << 20;
  config.idle_timeout = std::chrono::seconds(idle_s);
  config.frame_deadline = std::chrono::seconds(deadline_s);
  config.reply_deadline = std::chrono::seconds(reply_s);
  config.log = [](std::string_view line) { spdlog::info("{}", line); };

  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!std::getline(in, config.auth_token) || config.auth_token.empty()) {
      spdlog::error("cannot read an auth token from {}", token_file);
      return 2;
    }
  }
  if (::pipe(signal_pipe) != 0) {
    spdlog::error("cannot create the signal pipe");
    return 2;
  }
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  // Large blocks (receive buffers of big frames, decoded requests) are mapped and unmapped on their
  // own, so memory they held goes back to the system when freed; glibc's default threshold grows
  // after such frees and would keep later ones in the heap for good.
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  const softkv::server::DescriptorLimit fds = softkv::server::fit_descriptor_limit(config);
  spdlog::info("file descriptors: soft limit {} -> {} (hard {}); max connections {}", fds.soft_before, fds.soft, fds.hard,
               fds.max_connections);

  try {
    const auto t0 = std::chrono::steady_clock::now();
    softkv::DatabaseOptions options;
    options.fsync = fsync == "always" ? softkv::FsyncPolicy::always : fsync == "everysec" ? softkv::FsyncPolicy::everysec : softkv::FsyncPolicy::never;
    options.snapshot_after_bytes = snapshot_mb << 20;
    options.repair = repair;
    options.coalesce = coalesce == "on";
    if (repair) spdlog::warn("--repair: a corrupt log record ends recovery there; later log segments are set aside as *.corrupt");
    options.log = [](std::string_view line) { spdlog::info("{}", line); };
#ifdef SOFTKV_SERVER_MPI
    // Under mpirun with P > 1 ranks: the sharded server (every rank runs this; rank 0 serves TCP).
    if (softkv::server::mpi_world_size() > 1) return softkv::server::run_sharded(data, options, config, signal_pipe);
    try {  // a sharded directory is refused without mpirun, with the status of every refused start
      softkv::server::check_not_sharded(data);
    } catch (const softkv::Error& e) {
      spdlog::error("{}", e.what());
      return 2;
    }
#endif
    if (tune) spdlog::info("scan tuning: {}; tile products: {}", softkv::tune_scans(), softkv::tile_products());
    softkv::Database db(data, options);
    softkv::server::Server server(db, config);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spdlog::info("softkv-server {} on {}:{}, kernel path {}, data {}, {} collection(s) loaded in {:.2f} s, fsync {}, coalescing {}", softkv::kVersion,
                 config.host, server.port(), softkv::simd_path(), data, db.list_collections().size(), secs, fsync, coalesce);
    spdlog::info("connect with: {} --port {} stats   (or softkv::Client / Python softkv.Client)", cli_beside(argv[0]), server.port());
    std::thread waiter([&] {
      char sig = 0;
      while (::read(signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      if (sig != 0) spdlog::info("signal {}: finishing in-flight requests", int(sig));
      server.stop();
    });
    // Nothing below may leave this scope by an exception while the waiter runs (a joinable thread's
    // destructor aborts): a failure is logged and becomes the exit status.
    int status = 0;
    try {
      server.run();
    } catch (const std::exception& e) {
      spdlog::error("the server stopped on an error: {}", e.what());
      status = 1;
    }
    try {
      spdlog::info("writing a snapshot before exit");
      db.snapshot();
    } catch (const std::exception& e) {
      spdlog::error("the snapshot before exit failed: {}; the log is intact and the next start replays it", e.what());
      status = 1;
    }
    const char wake = 0;  // ends the waiter if the server stopped for another reason
    [[maybe_unused]] const auto n = ::write(signal_pipe[1], &wake, 1);
    waiter.join();
    if (status == 0) spdlog::info("stopped");
    else spdlog::info("stopped with errors (exit status {})", status);
    return status;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
}
