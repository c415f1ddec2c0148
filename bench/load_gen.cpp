// load_gen: closed-loop load on softkv-server over loopback — queries/s and p50/p99 latency.
//
// Each of --connections threads holds one connection and sends a hard query (the store's GET: one
// key in, one value out) -- or with --op ping the bare round trip -- as soon as the previous answer
// arrives, for --seconds.
// --setup creates the collection first (N = 1,000, d = 128 by default).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "common.hpp"
#include "softkv/softkv.hpp"

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
  app.add_option("--op", op, "hard (a query) or ping (the round trip alone)")->check(CLI::IsMember({"hard", "ping"}));
  CLI11_PARSE(app, argc, argv);
  const softkv::ClientOptions options{"127.0.0.1", port};
  if (setup) {
    softkv::Client c(options);
    if (c.list_collections().empty()) c.create_collection("load", {d, d, softkv::Metric::dot, {}, {}});
    c.add("load", softkv::bench::uniform_floats(n * d, 1), softkv::bench::uniform_floats(n * d, 2));
  }
  std::vector<std::vector<double>> latencies(connections);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < connections; ++t) {
    threads.emplace_back([&, t] {
      softkv::Client c(options);
      const auto q = softkv::bench::uniform_floats(d, 100 + t);
      while (!go) std::this_thread::yield();
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      for (auto now = std::chrono::steady_clock::now(); now < until; now = std::chrono::steady_clock::now()) {
        if (op == "ping") c.ping();
        else (void)c.query_hard("load", q);
        latencies[t].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - now).count());
      }
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  std::vector<double> all;
  for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  std::printf("softkv %s: connections %zu, %.0f requests/s, p50 %.1f us, p99 %.1f us\n", op == "ping" ? "ping" : "hard query", connections, all.size() / seconds,
              all[all.size() / 2], all[std::min(all.size() - 1, all.size() * 99 / 100)]);
  return 0;
}
