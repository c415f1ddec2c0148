// The sharded server: `mpirun -np P softkv-server` (P from SOFTKV_TEST_RANKS) against a single
// softkv-server holding the same data, through the unchanged C++ client; restart and a refused P.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "errors.hpp"
#include "port_file.hpp"
#include "reference.hpp"
#include "mpi/parts.hpp"
#include "softkv/softkv.hpp"
#include "wire/protocol.hpp"
#include "temp_dir.hpp"

extern char** environ;

using namespace softkv;
using namespace std::chrono_literals;

namespace {

std::size_t test_ranks() {
  const char* r = std::getenv("SOFTKV_TEST_RANKS");
  return r != nullptr ? static_cast<std::size_t>(std::atoi(r)) : 2;
}

using test::new_port_file;
using test::read_port_file;

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A server process in its own process group (mpirun and its ranks), killed as a group if the test
// fails; ranks == 0: a plain softkv-server.
struct Job {
  pid_t pid = 0;
  std::uint16_t port = 0;
  std::filesystem::path log;

  Job(const std::filesystem::path& data, std::size_t ranks, const std::filesystem::path& log_path, bool wait_listening = true,
      const std::string& extra_env = "", const std::vector<std::string>& extra_args = {})
      : log(log_path) {
    const std::filesystem::path port_file = new_port_file();
    std::vector<std::string> args;
    if (ranks > 0) args = {SOFTKV_MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(ranks)};
    for (std::string a : {std::string(SOFTKV_SERVER_BIN), std::string("--data"), data.string(), std::string("--port"),
                          std::string("0"), std::string("--port-file"), port_file.string(), std::string("--snapshot-after-mb"),
                          std::string("0")})
      args.push_back(a);
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string lp = log.string();
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    if (!extra_env.empty()) env_strings.push_back(extra_env);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::setpgid(0, 0);
      const int out = ::open(lp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(out, STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    if (!wait_listening) return;
    for (int i = 0; i < 1200; ++i) {  // mpirun on a loaded 2-core machine: allow 60 s
      if (const auto p = read_port_file(port_file)) {
        port = *p;
        std::filesystem::remove(port_file);
        return;
      }
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = 0;
        FAIL("the server exited before listening: " << read_file(log));
      }
      std::this_thread::sleep_for(50ms);
    }
    kill_group();
    FAIL("the server did not start listening: " << read_file(log));
  }
  ~Job() {
    if (pid > 0) stop(SIGTERM);
  }
  // Waits up to 60 s for the job to end (SIGKILL to the group after that); its wait status, or -1.
  int wait() {
    for (int i = 0; i < 1200; ++i) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = 0;
        return status;
      }
      std::this_thread::sleep_for(50ms);
    }
    kill_group();
    return -1;
  }
  int stop(int sig) {
    ::kill(pid, sig);
    return wait();
  }
  // The pid of rank r (mpirun's child whose environment says OMPI_COMM_WORLD_RANK=r), or 0.
  [[nodiscard]] pid_t rank_pid(std::size_t r) const {
    for (const auto& e : std::filesystem::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string stat = read_file(e.path() / "stat");
      const std::size_t comm_end = stat.rfind(')');
      if (comm_end == std::string::npos || comm_end + 2 > stat.size()) continue;  // the process ended as we looked
      std::istringstream fields(stat.substr(comm_end + 2));  // after "pid (comm) "
      std::string state;
      pid_t ppid = 0;
      fields >> state >> ppid;
      if (ppid != pid) continue;
      std::string env = read_file(e.path() / "environ");
      std::replace(env.begin(), env.end(), '\0', '\n');
      if (("\n" + env).find("\nOMPI_COMM_WORLD_RANK=" + std::to_string(r) + "\n") != std::string::npos)
        return static_cast<pid_t>(std::stol(name));
    }
    return 0;
  }
  // Stops the job as an operator would: SIGTERM to rank 0, which stops every rank (mpirun itself would
  // forward the signal but then exit 1); its wait status.
  int stop_rank0() {
    const pid_t r0 = rank_pid(0);
    REQUIRE(r0 > 0);
    ::kill(r0, SIGTERM);
    return wait();
  }
  void kill_group() {
    if (pid <= 0) return;
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = 0;
  }
  [[nodiscard]] ClientOptions client() const { return {"127.0.0.1", port}; }
};

// A single server and a sharded job of `ranks` ranks on dir/single and dir/sharded (logs named with
// suffix, so that restarts keep the earlier ones), and a client of each: cs and cp.
struct Pair {
  Job single, sharded;
  Client cs, cp;
  Pair(const std::filesystem::path& dir, std::size_t ranks, const std::string& suffix = "",
       const std::vector<std::string>& sharded_args = {})
      : single(dir / "single", 0, dir / ("single" + suffix + ".log")),
        sharded(dir / "sharded", ranks, dir / ("sharded" + suffix + ".log"), true, "", sharded_args),
        cs(single.client()),
        cp(sharded.client()) {}
};

// Waits (up to 30 s) until no process holds a shard's lock: the ranks of a killed job may outlive
// mpirun (the group leader the test waits for) by a moment.
void wait_unlocked(const std::filesystem::path& dir, std::size_t ranks) {
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto lock = dir / ("shard-" + std::to_string(r)) / "LOCK";
    const int fd = ::open(lock.c_str(), O_RDWR);
    if (fd < 0) continue;
    bool free = false;
    for (int i = 0; i < 600 && !free; ++i) {
      free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
      if (!free) std::this_thread::sleep_for(50ms);
    }
    ::close(fd);
    REQUIRE(free);
  }
}

struct Data {
  std::size_t d = 6, dv = 5;
  std::map<std::uint64_t, std::pair<std::vector<float>, std::vector<float>>> rows;  // id -> key, value
};

// The same writes into both servers: adds (batches spanning every shard), duplicate keys on ids
// owned by different ranks (hard ties), upserts, removes, a bad write refused by both.
void load(Client& single, Client& sharded, Data& data) {
  CollectionConfig exact{data.d, data.dv};
  CollectionConfig flat{data.d, data.dv};
  flat.index.kind = IndexKind::flat;
  for (Client* c : {&single, &sharded}) {
    c->create_collection("exact", exact);
    c->create_collection("flat", flat);
    c->create_collection("empty", exact);
  }
  for (int batch = 0; batch < 4; ++batch) {
    const std::size_t n = 37;
    std::vector<float> keys = test::integer_floats(n * data.d, 100 + batch), values = test::normal_floats(n * data.dv, 200 + batch);
    if (batch == 1)  // rows 0..3 (ids 37..40, on different ranks) share the key 10 e0: the best for e0, tied
      for (std::size_t i = 0; i < 4; ++i)
        for (std::size_t j = 0; j < data.d; ++j) keys[i * data.d + j] = j == 0 ? 10.0f : 0.0f;
    for (const char* name : {"exact", "flat"}) {
      const auto ids = single.add(name, keys, values);
      REQUIRE(sharded.add(name, keys, values) == ids);
      if (std::string(name) == "exact")
        for (std::size_t i = 0; i < n; ++i)
          data.rows[ids[i]] = {{keys.begin() + i * data.d, keys.begin() + (i + 1) * data.d},
                               {values.begin() + i * data.dv, values.begin() + (i + 1) * data.dv}};
    }
  }
  // Upsert: replace some ids, insert new ones beyond next_id (the next add starts above them).
  const std::vector<std::uint64_t> ids = {3, 4, 5, 400, 401};
  const std::vector<float> keys = test::integer_floats(ids.size() * data.d, 7), values = test::normal_floats(ids.size() * data.dv, 8);
  for (Client* c : {&single, &sharded})
    for (const char* name : {"exact", "flat"}) c->upsert(name, ids, keys, values);
  for (std::size_t i = 0; i < ids.size(); ++i)
    data.rows[ids[i]] = {{keys.begin() + i * data.d, keys.begin() + (i + 1) * data.d},
                         {values.begin() + i * data.dv, values.begin() + (i + 1) * data.dv}};
  const std::vector<float> k1 = test::integer_floats(3 * data.d, 9), v1 = test::normal_floats(3 * data.dv, 10);
  const auto more = single.add("exact", k1, v1);
  REQUIRE(sharded.add("exact", k1, v1) == more);
  REQUIRE(more.front() == 402);
  for (std::size_t i = 0; i < more.size(); ++i)
    data.rows[more[i]] = {{k1.begin() + i * data.d, k1.begin() + (i + 1) * data.d},
                          {v1.begin() + i * data.dv, v1.begin() + (i + 1) * data.dv}};
  const std::vector<std::uint64_t> gone = {0, 7, 8, 9, 401};
  for (Client* c : {&single, &sharded}) c->remove("exact", gone);
  for (auto id : gone) data.rows.erase(id);
  // All or nothing: one unknown id among present ones removes nothing, on either server.
  for (Client* c : {&single, &sharded}) {
    const std::vector<std::uint64_t> bad = {1, 2, 999};
    try {
      c->remove("exact", bad);
      FAIL("remove of an unknown id succeeded");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::unknown_id);
    }
    // A NaN in one row (owned by one rank) refuses the whole batch.
    std::vector<float> k = test::integer_floats(4 * data.d, 11), v = test::normal_floats(4 * data.dv, 12);
    k[3 * data.d] = std::nanf("");
    try {
      (void)c->add("exact", k, v);
      FAIL("add of a NaN key succeeded");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::non_finite);
    }
  }
}

// Compares every kind of answer of the two servers, and the soft values with a double reference.
void compare(Client& single, Client& sharded, const Data& data) {
  CHECK(sharded.list_collections() == single.list_collections());
  CHECK(sharded.describe("exact").size == single.describe("exact").size);
  CHECK(sharded.describe("exact").size == data.rows.size());
  for (const auto& [id, row] : data.rows) {
    const Entry e = sharded.get("exact", id);
    CHECK(e.key == row.first);
    CHECK(e.value == row.second);
  }
  std::vector<float> keys, values;
  for (const auto& [id, row] : data.rows) {
    keys.insert(keys.end(), row.first.begin(), row.first.end());
    values.insert(values.end(), row.second.begin(), row.second.end());
  }
  const std::size_t b = 9;
  std::vector<float> queries = test::normal_floats(b * data.d, 77);
  std::copy(keys.begin(), keys.begin() + 6, queries.begin());  // not a tie-breaker by itself, but a sharp peak
  QueryOptions top;
  top.top_m = 5;
  for (const char* name : {"exact", "flat"}) {
    const auto s1 = single.query_soft_batch(name, queries, top), s2 = sharded.query_soft_batch(name, queries, top);
    const auto h1 = single.query_hard_batch(name, queries), h2 = sharded.query_hard_batch(name, queries);
    REQUIRE(s1.size() == b);
    REQUIRE(s2.size() == b);
    for (std::size_t i = 0; i < b; ++i) {
      CHECK(s2[i].lse == Approx(s1[i].lse).epsilon(1e-5));
      CHECK(test::max_abs_diff(s2[i].value, s1[i].value) <= 1e-5 * (1 + test::max_abs(s1[i].value)));
      REQUIRE(s2[i].top.size() == s1[i].top.size());
      for (std::size_t j = 0; j < s1[i].top.size(); ++j) CHECK(s2[i].top[j].score == Approx(s1[i].top[j].score).epsilon(1e-5));
      CHECK(h2[i].id == h1[i].id);
      CHECK(h2[i].score == Approx(h1[i].score).epsilon(1e-6));
      CHECK(h2[i].value == h1[i].value);
      // Single queries take the same path as batches on both.
      const HardResult one = sharded.query_hard(name, {queries.data() + i * data.d, data.d});
      CHECK(one.id == h1[i].id);
    }
    if (std::string(name) == "exact") {
      const double scale = 1.0 / std::sqrt(double(data.d));
      for (std::size_t i = 0; i < b; ++i) {
        const auto ref = test::soft_reference(queries.data() + i * data.d, keys.data(), values.data(), data.rows.size(),
                                              data.d, data.dv, scale);
        CHECK(s2[i].lse == Approx(ref.lse).epsilon(1e-5));
        for (std::size_t j = 0; j < data.dv; ++j) CHECK(s2[i].value[j] == Approx(ref.value[j]).margin(1e-5));
      }
    }
  }
  // Ties across ranks: ids 37..40 share the key 10 e0; the hard answer is the smallest id.
  for (const char* name : {"exact", "flat"}) {
    std::vector<float> q(data.d, 0.0f);
    q[0] = 1.0f;
    const HardResult h1 = single.query_hard(name, q), h2 = sharded.query_hard(name, q);
    CHECK(h2.id == h1.id);
    CHECK(h2.id == 37);
  }
  // Pruned queries: the global top k, with the tail bound.
  QueryOptions pruned;
  pruned.top_k = 12;
  pruned.top_m = 3;
  for (std::size_t i = 0; i < b; ++i) {
    const std::span<const float> q(queries.data() + i * data.d, data.d);
    const SoftResult p1 = single.query_soft("flat", q, pruned), p2 = sharded.query_soft("flat", q, pruned);
    CHECK(p2.lse == Approx(p1.lse).epsilon(1e-5));
    CHECK(test::max_abs_diff(p2.value, p1.value) <= 1e-5 * (1 + test::max_abs(p1.value)));
    CHECK(p2.tail_bound == Approx(p1.tail_bound).epsilon(1e-4).margin(1e-12));
    CHECK(p2.tail_bound_guaranteed == p1.tail_bound_guaranteed);
    // epsilon: k doubles from 16 on the global figures, as on one collection.
    QueryOptions eps;
    eps.epsilon = 1e-3f;
    const SoftResult e1 = single.query_soft("flat", q, eps), e2 = sharded.query_soft("flat", q, eps);
    CHECK(e2.lse == Approx(e1.lse).epsilon(1e-5));
    CHECK(e2.candidates == e1.candidates);
    CHECK(test::max_abs_diff(e2.value, e1.value) <= 1e-5 * (1 + test::max_abs(e1.value)));
  }
  // A top list longer than the collection: every entry, as on one server.
  QueryOptions long_top;
  long_top.top_m = 1u << 30;
  const SoftResult l1 = single.query_soft("exact", {queries.data(), data.d}, long_top);
  const SoftResult l2 = sharded.query_soft("exact", {queries.data(), data.d}, long_top);
  CHECK(l2.top.size() == data.rows.size());
  CHECK(l2.top.size() == l1.top.size());
}

using test::error_of;

}  // namespace

TEST_CASE("sharded server answers as a single server and recovers every write after a restart", "[sharded_server][answers]") {
  const std::size_t ranks = test_ranks();
  test::TempDir dir;
  std::filesystem::create_directories(dir.path);
  Data data;
  {
    Pair pair(dir.path, ranks);
    auto& [single, sharded, cs, cp] = pair;
    load(cs, cp, data);
    compare(cs, cp, data);

    // Errors are typed and lose nothing.
    const std::vector<float> q(data.d, 0.5f), bad(data.d + 1, 0.5f);
    CHECK(error_of([&] { (void)cp.query_soft("nope", q); }) == ErrorCode::unknown_collection);
    CHECK(error_of([&] { (void)cp.query_soft("exact", bad); }) == ErrorCode::dimension_mismatch);
    CHECK(error_of([&] { (void)cp.query_soft("empty", q); }) == ErrorCode::empty_collection);
    CHECK(error_of([&] { (void)cp.get("exact", 0); }) == ErrorCode::unknown_id);
    CHECK(error_of([&] { cp.create_collection("exact", {data.d, data.dv}); }) == ErrorCode::collection_exists);
    CHECK(error_of([&] { (void)cp.query_stats("nope"); }) == ErrorCode::unknown_collection);
    try {  // the code name once, as from a single server (it crossed ranks as a message)
      (void)cp.get("exact", 1u << 30);
      FAIL("no error");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).rfind("unknown_id: no entry", 0) == 0);
    }
    cp.create_collection("square", {6, 6});  // iterations need dv == d: asked where they could run
    QueryOptions iterated;
    iterated.iterations = 3;
    CHECK(error_of([&] { (void)cp.query_soft("square", std::vector<float>(6, 0.5f), iterated); }) == ErrorCode::unsupported);
    cp.drop_collection("square");
    CollectionConfig two_heads{6, 6};
    two_heads.heads = 2;
    CHECK(error_of([&] { cp.create_collection("heads", two_heads); }) == ErrorCode::unsupported);
    CHECK(error_of([&] { (void)cp.describe("heads"); }) == ErrorCode::unknown_collection);  // nothing was created
    CHECK(cp.describe("exact").size == data.rows.size());
    CHECK(cp.stats().last_sequence > 0);
    cp.drop_collection("empty");
    cs.drop_collection("empty");
    cp.snapshot();
    // More writes after the snapshot: recovered from the logs.
    const std::vector<float> k = test::integer_floats(5 * data.d, 21), v = test::normal_floats(5 * data.dv, 22);
    const auto ids = cs.add("exact", k, v);
    REQUIRE(cp.add("exact", k, v) == ids);
    for (std::size_t i = 0; i < ids.size(); ++i)
      data.rows[ids[i]] = {{k.begin() + i * data.d, k.begin() + (i + 1) * data.d}, {v.begin() + i * data.dv, v.begin() + (i + 1) * data.dv}};
    // The sharded job is killed (every rank, no snapshot at exit): every acknowledged write is in the logs.
    sharded.kill_group();
  }
  wait_unlocked(dir.path / "sharded", ranks);
  CHECK(read_file(dir.path / "sharded" / "shards").rfind("softkv sharded job\nversion 1\nshards " + std::to_string(ranks) + "\njob ", 0) == 0);
  for (std::size_t r = 0; r < ranks; ++r) CHECK(std::filesystem::is_directory(dir.path / "sharded" / ("shard-" + std::to_string(r))));
  {
    Pair pair(dir.path, ranks, "2");
    auto& [single, sharded, cs, cp] = pair;
    compare(cs, cp, data);
    CHECK(sharded.stop_rank0() == 0);  // a clean stop: every rank snapshots, mpirun exits 0
  }
  {  // and once more after that clean stop (snapshots only)
    Pair pair(dir.path, ranks, "3");
    auto& [single, sharded, cs, cp] = pair;
    compare(cs, cp, data);
  }
  {  // another rank count is refused with a clear message, and so is a plain server on sharded data
    Job other(dir.path / "sharded", ranks + 1, dir.path / "other.log", /*wait_listening=*/false);
    const int status = other.wait();
    CHECK(status != 0);
    CHECK(read_file(dir.path / "other.log").find("resharding") != std::string::npos);
    Job plain(dir.path / "sharded", 0, dir.path / "plain.log", /*wait_listening=*/false);
    CHECK(plain.wait() != 0);
    CHECK(read_file(dir.path / "plain.log").find("mpirun -np " + std::to_string(ranks)) != std::string::npos);
  }
}

namespace {

// Copies the job directory src to dst (every shard, the manifest, the progress record, the commit log).
void copy_job(const std::filesystem::path& src, const std::filesystem::path& dst) {
  std::filesystem::remove_all(dst);
  std::filesystem::copy(src, dst, std::filesystem::copy_options::recursive);
}

// Starts a job on data that must refuse to start; its log, which must name the problem.
std::string refused_start(const std::filesystem::path& data, std::size_t ranks, const std::filesystem::path& log) {
  Job job(data, ranks, log, /*wait_listening=*/false);
  const int status = job.wait();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);  // every refused start exits with 2 (docs/SHARDING.md)
  return read_file(log);
}

// Writes rows 0 .. n-1 (ids spread over every shard) with keys e_(id mod 4) and values id.
void write_rows(Client& c, std::size_t first, std::size_t n) {
  std::vector<std::uint64_t> ids(n);
  std::vector<float> keys(n * 4, 0.0f), values(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    ids[i] = first + i;
    keys[i * 4 + (first + i) % 4] = 1.0f;
    values[i * 2] = values[i * 2 + 1] = static_cast<float>(first + i);
  }
  c.upsert("t", ids, keys, values);
}

}  // namespace

TEST_CASE("sharded server refuses a job directory whose shards are not the job's: deleted, emptied, swapped, older, or its files damaged",
          "[sharded_server][identity]") {
  const std::size_t ranks = test_ranks();
  test::TempDir dir;
  const auto good = dir.path / "good", old_copy = dir.path / "old-shard-1", work = dir.path / "work";
  {
    Job job(good, ranks, dir.path / "first.log");
    Client c(job.client());
    c.create_collection("t", {4, 2});
    write_rows(c, 0, 8 * ranks);
    CHECK(job.stop_rank0() == 0);
  }
  for (std::size_t r = 0; r < ranks; ++r) {  // every shard knows its job, rank and the shard count
    const std::string id = read_file(good / ("shard-" + std::to_string(r)) / "IDENTITY");
    CHECK(id.find("rank " + std::to_string(r) + "\nshards " + std::to_string(ranks) + "\n") != std::string::npos);
  }
  std::filesystem::copy(good / "shard-1", old_copy, std::filesystem::copy_options::recursive);
  {  // more writes after the copy, then a clean stop records how far every shard got
    Job job(good, ranks, dir.path / "second.log");
    Client c(job.client());
    write_rows(c, 8 * ranks, 8 * ranks);
    CHECK(job.stop_rank0() == 0);
  }
  const auto expect_refused = [&](const std::string& what, const std::string& needle) {
    INFO(what);
    const std::string log = refused_start(work, ranks, dir.path / "refused.log");
    INFO(log);
    CHECK(log.find(needle) != std::string::npos);
  };
  const std::string last = "shard-" + std::to_string(ranks - 1);
  copy_job(good, work);
  std::filesystem::remove_all(work / last);
  expect_refused("a deleted shard", "shard " + std::to_string(ranks - 1) + " (" + (work / last).string() + ") has no IDENTITY file");
  copy_job(good, work);
  for (const auto& e : std::filesystem::directory_iterator(work / last)) std::filesystem::remove_all(e.path());
  expect_refused("an emptied shard", "has no IDENTITY file");
  copy_job(good, work);
  std::filesystem::rename(work / "shard-0", work / "swap");
  std::filesystem::rename(work / "shard-1", work / "shard-0");
  std::filesystem::rename(work / "swap", work / "shard-1");
  expect_refused("swapped shards", "holds this job's shard 1: shard directories were swapped");
  copy_job(good, work);
  std::filesystem::rename(work / last, work / ("shard-" + std::to_string(ranks + 2)));
  expect_refused("a renamed shard", "shard-" + std::to_string(ranks + 2) + " is not a shard of this job");
  copy_job(good, work);
  std::filesystem::remove_all(work / "shard-1");
  std::filesystem::copy(old_copy, work / "shard-1", std::filesystem::copy_options::recursive);
  expect_refused("a shard restored from an older copy", "shard 1 has applied");
  copy_job(good, work);
  std::filesystem::remove(work / "commits");
  expect_refused("a deleted commit log", "commits (the commit log of cross-shard writes) is missing");
  copy_job(good, work);
  {
    const auto size = std::filesystem::file_size(work / "commits");
    std::ofstream(work / "commits", std::ios::binary | std::ios::trunc) << std::string(size, '\xA5');
  }
  expect_refused("a commit log with every byte damaged", "commit log of cross-shard writes) has a damaged header");
  copy_job(good, work);
  std::filesystem::resize_file(work / "commits", 20);
  expect_refused("a truncated commit log", "has 20 bytes, not 48");
  for (const char* file : {"shards", "progress"}) {
    copy_job(good, work);
    std::string text = read_file(work / file);
    text[text.find('\n') + 3] ^= 1;
    std::ofstream(work / file, std::ios::binary | std::ios::trunc) << text;
    expect_refused(std::string("a damaged ") + file, "is damaged (its CRC-32 does not match)");
  }
  copy_job(good, work);
  std::filesystem::resize_file(work / "commits", 49);
  expect_refused("a commit log one byte too long", "has 49 bytes, not 48");
  {  // each rank's marker of the last cross-shard write stays until the next one commits; one naming a
     // later write than the commit log's says the log lost a commit point (damaged, or an older copy)
    copy_job(good, work);
    std::size_t markers = 0;
    for (const auto& e : std::filesystem::directory_iterator(work)) {
      unsigned long long r = 0, txn = 0;
      if (std::sscanf(e.path().filename().c_str(), "applied-%llu-%llu", &r, &txn) != 2) continue;
      ++markers;
      if (r == 0) std::filesystem::rename(e.path(), work / ("applied-0-" + std::to_string(txn + 5)));
    }
    CHECK(markers == ranks);  // the last write spanned every rank
    expect_refused("an applied marker of a write the commit log does not have", "but the commit log's last commit point is");
  }
  {  // a commit log of format 1 (slots without the owner count, as the build before wrote them) is read
     // and its header rewritten as format 2
    copy_job(good, work);
    std::uint64_t last = 0;
    for (const auto& e : std::filesystem::directory_iterator(work)) {
      unsigned long long r = 0, txn = 0;
      if (std::sscanf(e.path().filename().c_str(), "applied-%llu-%llu", &r, &txn) == 2) last = txn;
    }
    REQUIRE(last > 0);
    const auto check_word = [](std::uint64_t txn) { return txn * 0x9E3779B97F4A7C15ull + 0x736f66746b76ull; };  // the file format's
    std::uint64_t words[6] = {0, 0, last, check_word(last), last, check_word(last)};
    std::memcpy(words, "softkv-commits1", 16);
    std::ofstream(work / "commits", std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(words), sizeof words);
    Job job(work, ranks, dir.path / "format1.log");
    Client c(job.client());
    CHECK(c.describe("t").size == 16 * ranks);
    CHECK(job.stop_rank0() == 0);
    CHECK(read_file(work / "commits").rfind("softkv-commits2", 0) == 0);
  }
  {  // part files of committed write 1 (the create): each must be this job's, this rank's and this write's
    const std::string manifest = read_file(good / "shards");
    const std::string job_id = manifest.substr(manifest.find("\njob ") + 5, 32);
    const auto part = [&](std::size_t rank, std::uint64_t id, std::string job) {  // an upsert of one row rank owns
      return detail::encode_part(detail::mutation::Upsert{"t", Rows{{id}, {1, 0, 0, 0}, {7, 7}, {}}, true},
                                 {std::move(job), static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(ranks), 1});
    };
    const auto put = [&](const std::string& name, const std::vector<std::byte>& bytes) {
      std::ofstream(work / name, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(bytes.data()),
                                                                           static_cast<std::streamsize>(bytes.size()));
    };
    const std::uint64_t id0 = 1000 * ranks, id1 = 1000 * ranks + 1;  // owned by rank 0 and rank 1
    copy_job(good, work);
    put("part-0-1", part(1, id1, job_id));  // rank 1's part where rank 0's belongs
    expect_refused("a part file of rank 1 in rank 0's name", "it belongs to rank 1 of " + std::to_string(ranks));
    CHECK(std::filesystem::exists(work / "part-0-1"));  // refused as it was: nothing applied, nothing deleted
    copy_job(good, work);
    put("part-1-1", part(1, id1, std::string(32, 'f')));
    expect_refused("a part file of another job", "job '" + std::string(32, 'f') + "'");
    copy_job(good, work);
    put("part-0-1", part(0, id0, job_id));  // a good part on rank 0 beside a damaged one on rank 1
    std::vector<std::byte> damaged = part(1, id1, job_id);
    damaged.back() ^= std::byte{1};
    put("part-1-1", damaged);
    expect_refused("a damaged part of a committed write", "part-1-1 (the part of committed write 1) cannot be used");
    CHECK(std::filesystem::exists(work / "part-0-1"));  // no rank completed its part before every part was read
    copy_job(good, work);
    put("part-" + std::to_string(ranks) + "-1", part(0, id0, job_id));
    expect_refused("a part file of a rank the job does not have", "but this job has " + std::to_string(ranks) + " ranks");
    copy_job(good, work);  // the good parts alone: completed at start (an upsert applied again is the same rows)
    put("part-0-1", part(0, id0, job_id));
    put("part-1-1", part(1, id1, job_id));
    Job job(work, ranks, dir.path / "parts.log");
    Client c(job.client());
    CHECK(c.get("t", id0).value == std::vector<float>{7, 7});
    CHECK(c.get("t", id1).value == std::vector<float>{7, 7});
    CHECK(job.stop_rank0() == 0);
    CHECK_FALSE(std::filesystem::exists(work / "part-0-1"));
  }
  copy_job(good, work);
  std::filesystem::remove(work / "progress");
  expect_refused("a deleted progress record", "progress is missing");
  copy_job(good, work);
  std::filesystem::remove(work / "shards");
  expect_refused("a deleted manifest", "but no " + (work / "shards").string());
  {  // the untouched directory starts and serves every row
    Job job(good, ranks, dir.path / "third.log");
    Client c(job.client());
    CHECK(c.describe("t").size == 16 * ranks);
    CHECK(c.get("t", 16 * ranks - 1).value == std::vector<float>{static_cast<float>(16 * ranks - 1), static_cast<float>(16 * ranks - 1)});
    CHECK(job.stop_rank0() == 0);
  }
  {  // a directory of the format before identities (a bare count, a headerless commit log) is upgraded
    copy_job(good, work);
    std::ofstream(work / "shards", std::ios::trunc) << ranks << "\n";
    std::filesystem::remove(work / "progress");
    for (std::size_t r = 0; r < ranks; ++r) std::filesystem::remove(work / ("shard-" + std::to_string(r)) / "IDENTITY");
    std::filesystem::resize_file(work / "commits", 0);
    for (const auto& e : std::filesystem::directory_iterator(work))  // nor applied markers (not written then)
      if (e.path().filename().string().rfind("applied-", 0) == 0) std::filesystem::remove(e.path());
    Job job(work, ranks, dir.path / "upgrade.log");
    Client c(job.client());
    CHECK(c.describe("t").size == 16 * ranks);
    CHECK(job.stop_rank0() == 0);
    CHECK(read_file(work / "shards").rfind("softkv sharded job\n", 0) == 0);
    for (std::size_t r = 0; r < ranks; ++r) CHECK(std::filesystem::exists(work / ("shard-" + std::to_string(r)) / "IDENTITY"));
    CHECK(std::filesystem::file_size(work / "commits") == 48);
  }
}

namespace {

// Batch b of the crash tests: ids b*S .. b*S+S-1 with S = 2P rows (every rank owns two), values all b.
void write_batch(Client& c, std::size_t b, std::size_t rows) {
  std::vector<std::uint64_t> ids(rows);
  std::vector<float> keys(rows * 4), values(rows * 2, static_cast<float>(b));
  for (std::size_t i = 0; i < rows; ++i) {
    ids[i] = b * rows + i;
    keys[i * 4 + i % 4] = 1.0f + static_cast<float>(b % 7);
  }
  c.upsert("c", ids, keys, values);
}

// How many rows of batch b exist (each with its batch's values).
std::size_t rows_of(Client& c, std::size_t b, std::size_t rows) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < rows; ++i) {
    try {
      const Entry e = c.get("c", b * rows + i);
      CHECK(e.value == std::vector<float>(2, static_cast<float>(b)));
      ++n;
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::unknown_id);
    }
  }
  return n;
}

// Rewrites a part file as the release before format "skvpart1" wrote it (a request frame), so that
// recovery's reader of those is tested on the parts of a real crash.
void rewrite_as_legacy_part(const std::filesystem::path& path, const std::string& text) {
  const detail::Mutation part = detail::decode_part(std::as_bytes(std::span(text.data(), text.size())), path.string()).mutation;
  const auto& u = std::get<detail::mutation::Upsert>(part);
  const std::vector<std::byte> frame =
      wire::encode_request(wire::Upsert{u.name, u.rows.ids, u.rows.keys, u.rows.values, u.rows.tags}, 0, wire::kProtocolVersion);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(frame.data()), static_cast<std::streamsize>(frame.size()));
}

bool failed_exit(int status) { return status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

}  // namespace

TEST_CASE("sharded server keeps a batch that spans shards all or nothing when a rank dies at the commit point", "[sharded_server][commit_point]") {
  const std::size_t ranks = test_ranks(), rows = 2 * ranks;
  for (const std::size_t victim : {std::size_t{0}, ranks - 1})
    for (const std::string point : {"write", "parts", "commit"}) {
      INFO("rank " << victim << " killed at " << point);
      test::TempDir dir;
      std::filesystem::create_directories(dir.path);
      {
        // Cross-shard writes: 1 create, 2 batch 0, 3 batch 1 (the victim dies in it).
        Job job(dir.path / "data", ranks, dir.path / "crash.log", true,
                "SOFTKV_TEST_CRASH=" + std::to_string(victim) + ":" + point + ":3");
        Client c(job.client());
        c.create_collection("c", {4, 2});
        write_batch(c, 0, rows);
        CHECK_THROWS_AS(write_batch(c, 1, rows), Error);
        CHECK(failed_exit(job.wait()));  // a dead rank ends the job, non-zero
      }
      wait_unlocked(dir.path / "data", ranks);
      if (point == "commit" && victim == 0) {  // rank 0's part of the committed batch deleted by hand: refused
        copy_job(dir.path / "data", dir.path / "deleted");
        std::size_t removed = 0;
        for (const auto& e : std::filesystem::directory_iterator(dir.path / "deleted"))
          if (e.path().filename().string().rfind("part-0-", 0) == 0) removed += std::filesystem::remove(e.path()) ? 1 : 0;
        CHECK(removed == 1);
        const std::string log = refused_start(dir.path / "deleted", ranks, dir.path / "deleted.log");
        INFO(log);
        CHECK(log.find("hold their part") != std::string::npos);
        CHECK(log.find("was committed with parts on " + std::to_string(ranks) + " ranks") != std::string::npos);
      }
      std::size_t part_files = 0;  // parts are checked blobs of log-record payloads (format "skvpart1")
      for (const auto& e : std::filesystem::directory_iterator(dir.path / "data"))
        if (e.path().filename().string().rfind("part-", 0) == 0) {
          ++part_files;
          std::ifstream in(e.path(), std::ios::binary);
          const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          CHECK(text.rfind("skvpart1", 0) == 0);
          if (point == "commit" && victim == 0) rewrite_as_legacy_part(e.path(), text);  // as the release before wrote it
        }
      if (point == "commit") CHECK(part_files >= 1);  // the victim's own part at least stays for recovery
      Job job(dir.path / "data", ranks, dir.path / "restart.log");
      Client c(job.client());
      CHECK(rows_of(c, 0, rows) == rows);
      // A part missing: dropped. Every part durable: committed unless rank 0 died before logging the
      // commit point (another rank's death races with rank 0's commit). Committed: completed by recovery.
      const std::size_t batch1 = rows_of(c, 1, rows);
      if (point == "write" || (point == "parts" && victim == 0)) CHECK(batch1 == 0);
      else if (point == "commit") CHECK(batch1 == rows);
      else CHECK((batch1 == 0 || batch1 == rows));
      write_batch(c, 2, rows);  // transaction numbers go on without reusing a dropped part's
      CHECK(rows_of(c, 2, rows) == rows);
      CHECK(c.describe("c").size == 2 * rows + batch1);
    }
}

TEST_CASE("sharded server keeps every acknowledged write when a rank is killed during a stream of writes", "[sharded_server][stream]") {
  const std::size_t ranks = test_ranks(), rows = 2 * ranks;
  for (const std::size_t victim : {ranks - 1, std::size_t{0}}) {
    INFO("rank " << victim << " killed");
    test::TempDir dir;
    std::filesystem::create_directories(dir.path);
    std::size_t acked = 0;
    {
      Job job(dir.path / "data", ranks, dir.path / "stream.log");
      const pid_t pid = job.rank_pid(victim);
      REQUIRE(pid > 0);
      Client c(job.client());
      c.create_collection("c", {4, 2});
      std::thread killer;
      try {
        for (std::size_t b = 0; b < 100000; ++b) {
          write_batch(c, b, rows);
          acked = b + 1;
          if (b == 20)
            killer = std::thread([pid] {
              std::this_thread::sleep_for(30ms);
              ::kill(pid, SIGKILL);
            });
        }
      } catch (const Error&) {  // the job died under the write in flight
      }
      if (killer.joinable()) killer.join();
      CHECK(acked > 20);
      CHECK(failed_exit(job.wait()));
    }
    wait_unlocked(dir.path / "data", ranks);
    Job job(dir.path / "data", ranks, dir.path / "restart.log");
    Client c(job.client());
    for (std::size_t b = 0; b < acked; ++b) CHECK(rows_of(c, b, rows) == rows);
    const std::size_t in_flight = rows_of(c, acked, rows);  // the write that was not acknowledged
    CHECK((in_flight == 0 || in_flight == rows));
    CHECK(c.describe("c").size == acked * rows + in_flight);
  }
}

namespace {

// Soft answers of the two servers agree (values, lse, candidates, top list, tail bound).
void check_soft_close(const SoftResult& got, const SoftResult& want) {
  CHECK(got.lse == Approx(want.lse).epsilon(1e-5));
  CHECK(got.candidates == want.candidates);
  CHECK(test::max_abs_diff(got.value, want.value) <= 1e-5 * (1 + test::max_abs(want.value)));
  CHECK(got.tail_bound == Approx(want.tail_bound).epsilon(1e-4).margin(1e-12));
  CHECK(got.mask_filtered_after_search == want.mask_filtered_after_search);
  REQUIRE(got.top.size() == want.top.size());
  for (std::size_t j = 0; j < want.top.size(); ++j) {
    CHECK(got.top[j].id == want.top[j].id);
    CHECK(got.top[j].score == Approx(want.top[j].score).epsilon(1e-5));
  }
}

}  // namespace

TEST_CASE("sharded server: masked queries and an f16 collection answer as a single server", "[sharded_server][masks]") {
  const std::size_t ranks = test_ranks();
  test::TempDir dir;
  std::filesystem::create_directories(dir.path);
  Pair pair(dir.path, ranks);
  auto& [single, sharded, cs, cp] = pair;
  const std::size_t d = 6, dv = 5, n = 240;
  CollectionConfig flat{d, dv};
  flat.index.kind = IndexKind::flat;
  CollectionConfig compact{d, dv};
  compact.key_precision = Precision::f16;
  compact.value_precision = Precision::bf16;
  compact.index.kind = IndexKind::flat;
  const std::vector<float> keys = test::normal_floats(n * d, 501), values = test::normal_floats(n * dv, 502);
  std::vector<std::uint64_t> tags(n);
  for (std::size_t i = 0; i < n; ++i) tags[i] = i % 5;
  tags[17] = 9;  // one entry alone with its tag
  std::vector<std::uint64_t> ids;
  for (Client* c : {&cs, &cp}) {
    c->create_collection("tagged", flat);
    c->create_collection("compact", compact);
    ids = c->add("tagged", keys, values, tags);
    (void)c->add("compact", keys, values, tags);
  }
  // Upserted tags replace the old ones on the owner rank too.
  const std::vector<std::uint64_t> re_ids = {ids[1], ids[2]}, re_tags = {9, 9};
  const std::vector<float> re_keys(keys.begin(), keys.begin() + 2 * d), re_values(values.begin(), values.begin() + 2 * dv);
  for (Client* c : {&cs, &cp}) c->upsert("tagged", re_ids, re_keys, re_values, re_tags);
  CHECK(cp.get("tagged", ids[1]).tag == 9);
  CHECK(cp.get("tagged", ids[3]).tag == tags[3]);

  std::vector<QueryOptions> masks(5);
  masks[0].tags_any = {1, 3};
  masks[1].tag_range = TagRange{2, 3};
  for (std::size_t i = 0; i < n; i += 4) masks[2].exclude_ids.push_back(ids[i]);
  masks[3].tags_any = {9};  // three entries (17, and the two upserted)
  masks[4].tag_range = TagRange{0, 100};  // every entry
  const std::vector<float> queries = test::normal_floats(4 * d, 503, 2.0f);
  for (std::size_t m = 0; m < masks.size(); ++m) {
    for (const char* name : {"tagged", "compact"}) {
      INFO("mask " << m << " on " << name);
      QueryOptions o = masks[m];
      o.top_m = 4;
      const std::span<const float> q(queries.data(), d);
      const SoftResult s1 = cs.query_soft(name, q, o), s2 = cp.query_soft(name, q, o);
      check_soft_close(s2, s1);
      for (const Contributor& c : s2.top) {  // every contributor passes the mask
        const Entry e = cp.get(name, c.id);
        if (!masks[m].tags_any.empty())
          CHECK(std::find(masks[m].tags_any.begin(), masks[m].tags_any.end(), e.tag) != masks[m].tags_any.end());
        if (masks[m].tag_range) CHECK((e.tag >= masks[m].tag_range->lo && e.tag <= masks[m].tag_range->hi));
        CHECK(std::find(masks[m].exclude_ids.begin(), masks[m].exclude_ids.end(), c.id) == masks[m].exclude_ids.end());
      }
      const HardResult h1 = cs.query_hard(name, q, masks[m]), h2 = cp.query_hard(name, q, masks[m]);
      CHECK(h2.id == h1.id);
      CHECK(h2.value == h1.value);
      const auto b1 = cs.query_soft_batch(name, queries, masks[m]), b2 = cp.query_soft_batch(name, queries, masks[m]);
      const auto hb1 = cs.query_hard_batch(name, queries, masks[m]), hb2 = cp.query_hard_batch(name, queries, masks[m]);
      REQUIRE(b2.size() == 4);
      REQUIRE(hb2.size() == 4);
      for (std::size_t i = 0; i < 4; ++i) {
        check_soft_close(b2[i], b1[i]);
        CHECK(hb2[i].id == hb1[i].id);
      }
      for (std::size_t k : {std::size_t{1}, std::size_t{6}, std::size_t{500}}) {  // pruned: the global eligible N
        QueryOptions pruned = masks[m];
        pruned.top_k = k;
        pruned.top_m = 3;
        check_soft_close(cp.query_soft(name, q, pruned), cs.query_soft(name, q, pruned));
      }
      QueryOptions eps = masks[m];
      eps.epsilon = 1e-3f;
      check_soft_close(cp.query_soft(name, q, eps), cs.query_soft(name, q, eps));
    }
  }
  // A mask keeping nothing is empty_collection, as on one server; limits are checked the same way.
  QueryOptions none;
  none.tags_any = {12345};
  CHECK(error_of([&] { (void)cs.query_soft("tagged", {queries.data(), d}, none); }) == ErrorCode::empty_collection);
  CHECK(error_of([&] { (void)cp.query_soft("tagged", {queries.data(), d}, none); }) == ErrorCode::empty_collection);
  CHECK(error_of([&] { (void)cp.query_hard_batch("tagged", queries, none); }) == ErrorCode::empty_collection);
  QueryOptions bad_range;
  bad_range.tag_range = TagRange{4, 3};
  CHECK(error_of([&] { (void)cp.query_soft("tagged", {queries.data(), d}, bad_range); }) == ErrorCode::invalid_argument);
  // The server still answers afterwards.
  CHECK(cp.query_hard("tagged", {queries.data(), d}).id == cs.query_hard("tagged", {queries.data(), d}).id);
  CHECK(sharded.stop_rank0() == 0);
}

namespace {

// The rows of the coalescing tests: tagged random rows in "exact" (coalesced queries) and in "flat"
// (pruned queries, never coalesced), the same in both servers.
struct CoalesceData {
  std::size_t d = 16, dv = 8, n = 1500;
  std::vector<float> keys, values;
  std::vector<std::uint64_t> tags;
};

void load_coalesce(Client& c, const CoalesceData& data) {
  CollectionConfig exact{data.d, data.dv}, flat{data.d, data.dv};
  flat.index.kind = IndexKind::flat;
  c.create_collection("exact", exact);
  c.create_collection("flat", flat);
  (void)c.add("exact", data.keys, data.values, data.tags);
  (void)c.add("flat", data.keys, data.values, data.tags);
}

// What a client asks in one turn. The first five are coalesced on "exact" (batch: 3 queries in one request).
enum class Ask { soft, soft_warm, hard, batch, masked, top_m, pruned, wrong_dim, nan, count };
constexpr std::size_t kCoalescedPerTurn[] = {1, 1, 1, 3, 1, 0, 0, 0, 0};

// An answer or the error it got.
struct Answer {
  std::vector<SoftResult> soft;
  std::vector<HardResult> hard;
  ErrorCode error{};
  std::string message;
};

QueryOptions options_of(Ask ask) {
  QueryOptions o;
  if (ask == Ask::soft_warm) o.temperature = 0.5f;
  if (ask == Ask::masked) o.tags_any = {1, 2};
  if (ask == Ask::top_m) o.top_m = 3;
  if (ask == Ask::pruned) o.top_k = 40;
  return o;
}

// Client t's query for turn i: 3 rows for a batch, a wrong length or a NaN where the turn asks for it.
std::vector<float> query_of(const CoalesceData& data, Ask ask, std::size_t t, std::size_t i) {
  std::vector<float> q = test::normal_floats((ask == Ask::batch ? 3 : 1) * data.d, 9000 + t * 100 + i);
  if (ask == Ask::wrong_dim) q.push_back(0.5f);
  if (ask == Ask::nan) q[data.d / 2] = std::nanf("");
  return q;
}

Answer ask(Client& c, Ask a, std::span<const float> q) {
  Answer r;
  const QueryOptions o = options_of(a);
  try {
    switch (a) {
      case Ask::hard: r.hard.push_back(c.query_hard("exact", q, o)); break;
      case Ask::batch: r.soft = c.query_soft_batch("exact", q, o); break;
      case Ask::pruned: r.soft.push_back(c.query_soft("flat", q, o)); break;
      default: r.soft.push_back(c.query_soft("exact", q, o)); break;
    }
  } catch (const Error& e) {
    r.error = e.code();
    r.message = e.what();
  }
  return r;
}

// Why got is not the answer to the query (empty when it is): against the single server's answer
// (want) and, for the coalesced soft queries, the float64 reference.
std::string check_answer(const CoalesceData& data, Ask a, std::span<const float> q, const Answer& got, const Answer& want) {
  std::ostringstream why;
  if (a == Ask::wrong_dim || a == Ask::nan) {
    const ErrorCode code = a == Ask::nan ? ErrorCode::non_finite : ErrorCode::dimension_mismatch;
    if (got.error != code) why << "error " << to_string(got.error) << " (" << got.message << "), not " << to_string(code);
    // Its own row: an error raised by a batch of several clients' queries would name another row.
    else if (a == Ask::nan && got.message.find("row 0, element " + std::to_string(data.d / 2)) == std::string::npos)
      why << "the error names another row: " << got.message;
    return why.str();
  }
  if (got.error != ErrorCode{}) return "error " + std::string(to_string(got.error)) + ": " + got.message;
  if (want.error != ErrorCode{}) return "the single server failed: " + want.message;
  if (got.soft.size() != want.soft.size() || got.hard.size() != want.hard.size()) return "the wrong number of answers";
  for (std::size_t b = 0; b < got.hard.size(); ++b) {
    const HardResult &g = got.hard[b], &w = want.hard[b];
    if (g.id != w.id || g.value != w.value || std::fabs(g.score - w.score) > 1e-5 * (1 + std::fabs(w.score)))
      why << "hard " << g.id << " (" << g.score << "), single server " << w.id << " (" << w.score << "); ";
  }
  const QueryOptions o = options_of(a);
  const double scale = 1.0 / (std::sqrt(double(data.d)) * o.temperature.value_or(1.0f));
  for (std::size_t b = 0; b < got.soft.size(); ++b) {
    const SoftResult &g = got.soft[b], &w = want.soft[b];
    if (std::fabs(g.lse - w.lse) > 1e-5 * (1 + std::fabs(w.lse)) || g.candidates != w.candidates ||
        test::max_abs_diff(g.value, w.value) > 1e-5 * (1 + test::max_abs(w.value)) || g.top.size() != w.top.size() ||
        std::fabs(g.tail_bound - w.tail_bound) > 1e-4 * w.tail_bound + 1e-12)
      why << "soft " << b << " differs from the single server's (lse " << g.lse << " vs " << w.lse << "); ";
    for (std::size_t j = 0; j < std::min(g.top.size(), w.top.size()); ++j)
      if (g.top[j].id != w.top[j].id) why << "contributor " << j << " differs; ";
    if (a == Ask::pruned || a == Ask::top_m) continue;
    // The float64 reference over the rows the query may see (its mask's tags).
    std::vector<float> keys, values;
    for (std::size_t i = 0; i < data.n; ++i) {
      if (!o.tags_any.empty() && std::find(o.tags_any.begin(), o.tags_any.end(), data.tags[i]) == o.tags_any.end()) continue;
      keys.insert(keys.end(), data.keys.begin() + i * data.d, data.keys.begin() + (i + 1) * data.d);
      values.insert(values.end(), data.values.begin() + i * data.dv, data.values.begin() + (i + 1) * data.dv);
    }
    const auto ref = test::soft_reference(q.data() + b * data.d, keys.data(), values.data(), keys.size() / data.d, data.d, data.dv, scale);
    if (g.candidates != keys.size() / data.d || std::fabs(g.lse - ref.lse) > 1e-5 * (1 + std::fabs(ref.lse)) ||
        test::max_abs_diff(g.value, ref.value) > 1e-5 * (1 + test::max_abs(g.value)))
      why << "soft " << b << " differs from the float64 reference (lse " << g.lse << " vs " << ref.lse << "); ";
  }
  return why.str();
}

// Every client's answers in turn order, and the first few failures.
struct Outcome {
  std::vector<std::vector<Answer>> answers;  // [client][turn]
  std::atomic<int> failures{0};
  std::mutex mutex;
  std::string first_failures;
  std::size_t coalescable = 0;  // queries on "exact" that every shard answers in one pass
};

constexpr std::size_t kCoalesceClients = 16, kCoalesceTurns = 18;

Ask ask_of(std::size_t t, std::size_t i) { return static_cast<Ask>((t + i) % static_cast<std::size_t>(Ask::count)); }

// kCoalesceClients connections to the sharded server at once, each asking kCoalesceTurns questions of
// every kind, each answer checked against the single server's and the float64 reference.
// Meanwhile one more connection writes to the collection "side" (other requests in the queue between
// the queries); it returns the rows written.
std::size_t run_clients(const ClientOptions& sharded, const ClientOptions& single, const CoalesceData& data, Outcome& out) {
  out.answers.assign(kCoalesceClients, {});
  std::atomic<std::size_t> ready{0}, finished{0}, side_rows{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    Client writer(sharded);
    writer.create_collection("side", {data.d, data.dv});
    ++ready;
    while (ready.load() < kCoalesceClients + 1) std::this_thread::yield();
    for (std::uint64_t b = 0; b == 0 || finished.load() < kCoalesceClients; ++b) {
      (void)writer.add("side", test::normal_floats(3 * data.d, 700 + b), test::normal_floats(3 * data.dv, 800 + b));
      side_rows += 3;
    }
  });
  for (std::size_t t = 0; t < kCoalesceClients; ++t)
    threads.emplace_back([&, t] {
      Client cp(sharded), cs(single);
      ++ready;
      while (ready.load() < kCoalesceClients + 1) std::this_thread::yield();  // start together: the queue fills
      for (std::size_t i = 0; i < kCoalesceTurns; ++i) out.answers[t].push_back(ask(cp, ask_of(t, i), query_of(data, ask_of(t, i), t, i)));
      ++finished;
      for (std::size_t i = 0; i < kCoalesceTurns; ++i) {  // the single server's answers once the load is over
        const Ask a = ask_of(t, i);
        const std::vector<float> q = query_of(data, a, t, i);
        const std::string why = check_answer(data, a, q, out.answers[t][i], ask(cs, a, q));
        if (why.empty()) continue;
        ++out.failures;
        std::lock_guard lock(out.mutex);
        if (out.first_failures.size() < 2000) out.first_failures += "client " + std::to_string(t) + " turn " + std::to_string(i) + ": " + why + "\n";
      }
    });
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < kCoalesceClients; ++t)
    for (std::size_t i = 0; i < kCoalesceTurns; ++i) out.coalescable += kCoalescedPerTurn[static_cast<std::size_t>(ask_of(t, i))];
  return side_rows.load();
}

CoalesceData coalesce_data() {
  CoalesceData data;
  data.keys = test::normal_floats(data.n * data.d, 801);
  data.values = test::normal_floats(data.n * data.dv, 802);
  data.tags.resize(data.n);
  for (std::size_t i = 0; i < data.n; ++i) data.tags[i] = i % 4;
  return data;
}

}  // namespace

TEST_CASE("sharded server coalesces concurrent queries: each client gets its own answer, bad queries their own error", "[sharded_server][coalesce]") {
  const std::size_t ranks = test_ranks();
  test::TempDir dir;
  std::filesystem::create_directories(dir.path);
  Pair pair(dir.path, ranks);
  auto& [single, sharded, cs, cp] = pair;
  const CoalesceData data = coalesce_data();
  load_coalesce(cs, data);
  load_coalesce(cp, data);
  CHECK(cp.query_stats("exact").queries == 0);

  Outcome out;
  const std::size_t side_rows = run_clients(sharded.client(), single.client(), data, out);
  INFO(out.first_failures);
  CHECK(out.failures.load() == 0);
  CHECK(side_rows > 0);
  CHECK(cp.describe("side").size == side_rows);  // the writes queued among the queries all landed
  // Every query of the coalesced kinds was counted, in fewer passes than queries: coalescing happened.
  const CoalescingStats stats = cp.query_stats("exact");
  INFO("coalesced: " << stats.queries << " queries in " << stats.passes << " passes, largest " << stats.max_batch);
  CHECK(stats.queries == out.coalescable);
  CHECK(stats.passes < stats.queries);
  CHECK(stats.max_batch > 1);
  CHECK(stats.max_batch <= 64);
  // Pruned queries (on "flat") run alone and are not counted.
  CHECK(cp.query_stats("flat").queries == 0);
  CHECK(error_of([&] { (void)cp.query_stats("missing"); }) == ErrorCode::unknown_collection);
  // A dropped and re-created collection starts from zero, as on one server.
  cp.drop_collection("exact");
  CHECK(error_of([&] { (void)cp.query_stats("exact"); }) == ErrorCode::unknown_collection);
  cp.create_collection("exact", {data.d, data.dv});
  CHECK(cp.query_stats("exact").queries == 0);
  CHECK(sharded.stop_rank0() == 0);
}

TEST_CASE("sharded server with --coalesce off runs one query at a time and counts none, as a single server", "[sharded_server][coalesce]") {
  const std::size_t ranks = test_ranks();
  test::TempDir dir;
  std::filesystem::create_directories(dir.path);
  Pair pair(dir.path, ranks, "", {"--coalesce", "off"});
  auto& [single, sharded, cs, cp] = pair;
  const CoalesceData data = coalesce_data();
  load_coalesce(cs, data);
  load_coalesce(cp, data);

  Outcome out;
  const std::size_t side_rows = run_clients(sharded.client(), single.client(), data, out);
  INFO(out.first_failures);
  CHECK(out.failures.load() == 0);
  CHECK(cp.describe("side").size == side_rows);
  // Each query ran alone: bit for bit the answer it gets on an idle server (a coalesced one is the batched kernel's).
  int differ = 0;
  for (std::size_t t = 0; t < kCoalesceClients; ++t)
    for (std::size_t i = 0; i < kCoalesceTurns; ++i) {
      const Ask a = ask_of(t, i);
      const Answer again = ask(cp, a, query_of(data, a, t, i)), &got = out.answers[t][i];
      for (std::size_t b = 0; b < got.soft.size() && b < again.soft.size(); ++b)
        if (got.soft[b].value != again.soft[b].value || got.soft[b].lse != again.soft[b].lse) ++differ;
      for (std::size_t b = 0; b < got.hard.size() && b < again.hard.size(); ++b)
        if (got.hard[b].id != again.hard[b].id || got.hard[b].score != again.hard[b].score) ++differ;
      if (got.error != again.error) ++differ;
    }
  CHECK(differ == 0);
  // Off: no query is served through coalescing, so none is counted (queries == passes == 0), as Collection::set_coalescing(false).
  const CoalescingStats stats = cp.query_stats("exact");
  CHECK(stats.queries == 0);
  CHECK(stats.passes == stats.queries);
  CHECK(stats.max_batch == 0);
  CHECK(sharded.stop_rank0() == 0);
}
