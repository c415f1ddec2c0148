// Coalesced queries: the hand-off of the coalescer itself, and concurrent queries on a collection
// served in shared passes with answers equal to the double-precision reference of a consistent state.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "coalescer.hpp"
#include "reference.hpp"
#include "softkv/softkv.hpp"

using namespace softkv;
using namespace std::chrono_literals;

namespace {

struct TestQuery : detail::CoalescedQuery {
  int input = 0;
  int output = 0;
  int pass = 0;  // which pass served it
};

}  // namespace

TEST_CASE("coalescer: an idle coalescer runs a query at once, and queries arriving during a pass share the next one", "[coalescing]") {
  detail::Coalescer<TestQuery> c(64);
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> passes{0};
  std::vector<std::size_t> batch_sizes;
  const std::function<void(TestQuery&)> alone = [&](TestQuery& q) {
    q.pass = ++passes;
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return release; });  // the first pass stays open until every other query waits
    q.output = q.input * 2;
  };
  const std::function<void(std::span<TestQuery* const>)> batch = [&](std::span<TestQuery* const> qs) {
    const int pass = ++passes;
    batch_sizes.push_back(qs.size());
    for (TestQuery* q : qs) q->output = q->input * 2, q->pass = pass;
  };

  // Idle: one query, one pass, no waiting.
  TestQuery solo;
  solo.input = 5;
  release = true;
  c.run(solo, alone, batch);
  CHECK(solo.output == 10);
  CHECK(c.stats().passes == 1);
  CHECK(c.stats().max_batch == 1);

  release = false;
  TestQuery first;
  first.input = 1;
  std::thread leader([&] { c.run(first, alone, batch); });
  while (passes.load() < 2) std::this_thread::yield();  // first is inside its pass
  constexpr int kWaiting = 20;
  std::vector<TestQuery> queued(kWaiting);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWaiting; ++i) {
    queued[i].input = 100 + i;
    threads.emplace_back([&, i] { c.run(queued[i], alone, batch); });
  }
  while (c.waiting() < kWaiting) std::this_thread::yield();
  {
    std::lock_guard lock(m);
    release = true;
  }
  cv.notify_all();
  leader.join();
  for (auto& t : threads) t.join();
  CHECK(first.output == 2);
  for (int i = 0; i < kWaiting; ++i) {
    CHECK(queued[i].output == 2 * (100 + i));
    CHECK(queued[i].pass == 3);  // all of them in the one pass after first's
    CHECK(!queued[i].error);
  }
  REQUIRE(batch_sizes.size() == 1);
  CHECK(batch_sizes[0] == kWaiting);
  const CoalescingStats s = c.stats();
  CHECK(s.queries == 2 + kWaiting);
  CHECK(s.passes == 3);
  CHECK(s.max_batch == kWaiting);
}

TEST_CASE("coalescer: a pass that fails gives each of its queries the error and the next pass runs", "[coalescing]") {
  detail::Coalescer<TestQuery> c(4);
  TestQuery q;
  c.run(q, [](TestQuery&) { throw Error(ErrorCode::empty_collection, "nothing"); }, [](std::span<TestQuery* const>) {});
  REQUIRE(q.error);
  CHECK_THROWS_AS(std::rethrow_exception(q.error), Error);
  TestQuery again;
  c.run(again, [](TestQuery& t) { t.output = 7; }, [](std::span<TestQuery* const>) {});
  CHECK(again.output == 7);
  CHECK(!again.error);
}

TEST_CASE("an idle collection answers a single query at once, bit for bit as without coalescing", "[coalescing]") {
  constexpr std::size_t n = 3000, d = 32, dv = 8;
  Collection c({d, dv, Metric::dot, {}, {}});
  c.add_batch(test::normal_floats(n * d, 1), test::normal_floats(n * dv, 2));
  const auto q = test::normal_floats(d, 3);
  const SoftResult on = c.query_soft(q, {.temperature = 0.5f, .top_m = 3});
  const HardResult hard_on = c.query_hard(q);
  CHECK(c.coalescing_stats().passes == 2);
  CHECK(c.coalescing_stats().max_batch == 1);
  c.set_coalescing(false);
  CHECK(!c.coalescing());
  const SoftResult off = c.query_soft(q, {.temperature = 0.5f, .top_m = 3});
  CHECK(on.value == off.value);
  CHECK(on.lse == off.lse);
  REQUIRE(on.top.size() == 3);
  CHECK(on.top[0].id == off.top[0].id);
  CHECK(hard_on.id == c.query_hard(q).id);
  CHECK(c.coalescing_stats().queries == 2);  // off: not counted
}

TEST_CASE("concurrent mixed queries share passes and each equals the float64 reference of a consistent state, while a writer toggles the values", "[coalescing]") {
  constexpr std::size_t n = 20000, d = 64, dv = 16;
  Collection c({d, dv, Metric::dot, {}, {}});
  const auto keys = test::normal_floats(n * d, 11);
  const auto values = test::normal_floats(n * dv, 12);
  std::vector<float> doubled(values);
  for (float& v : doubled) v *= 2.0f;
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = i;
  c.upsert_batch(ids, keys, values);

  // The writer flips every value between v and 2v in one batch (one state or the other, never a mix).
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (bool twice = true; !stop.load(); twice = !twice) {
      c.upsert_batch(ids, keys, twice ? doubled : values);
      std::this_thread::sleep_for(2ms);
    }
  });
  constexpr int kThreads = 12, kQueries = 12;
  std::atomic<int> failures{0};
  std::atomic<int> checked{0};
  double worst = 0;
  std::mutex worst_mutex;
  std::vector<std::thread> readers;
  for (int t = 0; t < kThreads; ++t) {
    readers.emplace_back([&, t] {
      for (int i = 0; i < kQueries; ++i) {
        const auto q = test::normal_floats(d, 1000 + t * 100 + i);
        const float temperature = 0.25f + 0.25f * float((t + i) % 4);
        const double scale = 1.0 / (std::sqrt(double(d)) * temperature);
        const test::SoftReference ref = test::soft_reference(q.data(), keys.data(), values.data(), n, d, dv, scale);
        if ((t + i) % 3 == 0) {  // hard
          const HardResult h = c.query_hard(q, {.temperature = temperature});
          const std::size_t best = std::size_t(std::max_element(ref.scores.begin(), ref.scores.end()) - ref.scores.begin());
          const bool value_ok = h.value == std::vector<float>(values.begin() + best * dv, values.begin() + (best + 1) * dv) ||
                                h.value == std::vector<float>(doubled.begin() + best * dv, doubled.begin() + (best + 1) * dv);
          if (h.id != best || !value_ok) ++failures;
        } else {  // soft with its own temperature and top_m
          const std::size_t top_m = std::size_t(i % 3);
          const SoftResult s = c.query_soft(q, {.temperature = temperature, .top_m = top_m});
          double err1 = 0, err2 = 0, scale_v = 0;
          for (std::size_t j = 0; j < dv; ++j) {
            err1 = std::max(err1, std::fabs(s.value[j] - ref.value[j]));
            err2 = std::max(err2, std::fabs(s.value[j] - 2 * ref.value[j]));
            scale_v = std::max(scale_v, std::fabs(ref.value[j]));
          }
          const double err = std::min(err1, err2) / std::max(scale_v, 1e-3);
          {
            std::lock_guard lock(worst_mutex);
            worst = std::max(worst, err);
          }
          if (err > 1e-4 || std::fabs(s.lse - ref.lse) > 1e-4 * std::max(1.0, std::fabs(ref.lse)) || s.top.size() != top_m) ++failures;
          if (top_m > 0 && s.top[0].id != std::size_t(std::max_element(ref.scores.begin(), ref.scores.end()) - ref.scores.begin()))
            ++failures;
        }
        ++checked;
      }
    });
  }
  for (auto& r : readers) r.join();
  stop = true;
  writer.join();
  CHECK(failures.load() == 0);
  CHECK(checked.load() == kThreads * kQueries);
  const CoalescingStats s = c.coalescing_stats();
  CHECK(s.queries == std::uint64_t(kThreads * kQueries));
  CHECK(s.passes < s.queries);  // some queries shared a pass
  CHECK(s.max_batch > 1);
  WARN("coalesced: " << s.queries << " queries in " << s.passes << " passes, largest " << s.max_batch
                     << "; worst relative value error vs float64 " << worst);
}

TEST_CASE("a collection whose pass reads under 4 MiB answers each query at once, counted as a pass of one", "[coalescing]") {
  // N = 1,000, d = dv = 128: a soft pass reads 1 MB, a hard one 0.5 MB. Concurrent queries never wait
  // for each other's pass (waking a waiter would cost more than the pass), and each answer is bit for
  // bit the one the query gets with coalescing off.
  constexpr std::size_t n = 1000, d = 128, dv = 128;
  Collection c({d, dv, Metric::dot, {}, {}});
  c.add_batch(test::normal_floats(n * d, 21), test::normal_floats(n * dv, 22));
  constexpr int kThreads = 8, kQueries = 25;
  std::vector<SoftResult> soft(kThreads * kQueries);
  std::vector<HardResult> hard(kThreads * kQueries);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kQueries; ++i) {
        const auto q = test::normal_floats(d, 7000 + t * 100 + i);
        soft[t * kQueries + i] = c.query_soft(q, {.temperature = 0.5f});
        hard[t * kQueries + i] = c.query_hard(q);
      }
    });
  for (auto& t : threads) t.join();
  const CoalescingStats s = c.coalescing_stats();
  CHECK(s.queries == std::uint64_t(2 * kThreads * kQueries));
  CHECK(s.passes == s.queries);
  CHECK(s.max_batch == 1);
  c.set_coalescing(false);
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kQueries; ++i) {
      const auto q = test::normal_floats(d, 7000 + t * 100 + i);
      const SoftResult off = c.query_soft(q, {.temperature = 0.5f});
      CHECK(soft[t * kQueries + i].value == off.value);
      CHECK(soft[t * kQueries + i].lse == off.lse);
      CHECK(hard[t * kQueries + i].id == c.query_hard(q).id);
    }
}

TEST_CASE("coalescer: closed-loop clients are gathered into whole passes instead of alternating small ones", "[coalescing][timing]") {
  // C clients, each sending its next query as soon as its last is answered (a server's connections);
  // every pass takes about the same time whatever its size, as a memory-bound scan does.
  constexpr int kClients = 4, kRounds = 25;
  detail::Coalescer<TestQuery> c(64);
  const auto pass = [] { std::this_thread::sleep_for(std::chrono::milliseconds(4)); };
  const std::function<void(TestQuery&)> alone = [&](TestQuery& q) {
    pass();
    q.output = q.input * 2;
  };
  const std::function<void(std::span<TestQuery* const>)> batch = [&](std::span<TestQuery* const> qs) {
    pass();
    for (TestQuery* q : qs) q->output = q->input * 2;
  };
  std::vector<std::thread> clients;
  std::atomic<int> wrong{0};
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      for (int r = 0; r < kRounds; ++r) {
        TestQuery q;
        q.input = i * 1000 + r;
        c.run(q, alone, batch);
        if (q.output != 2 * q.input || q.error) ++wrong;
      }
    });
  for (auto& t : clients) t.join();
  CHECK(wrong.load() == 0);
  const CoalescingStats s = c.stats();
  CHECK(s.queries == static_cast<std::uint64_t>(kClients * kRounds));
  // Without gathering, passes alternate between the query that arrived first and the rest (about 2
  // queries a pass for 4 clients); gathered, nearly every pass holds all 4.
  INFO("passes " << s.passes << " for " << s.queries << " queries");
  CHECK(static_cast<double>(s.queries) / static_cast<double>(s.passes) >= 3.0);
  // A lone client afterwards is not made to wait: each query at once, a pass of one.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // idle for longer than a pass
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 5; ++r) {
    TestQuery q;
    q.input = r;
    c.run(q, alone, batch);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(seconds < 5 * 0.004 * 1.25 + 0.05);  // five passes, no gathering waits worth a quarter pass each
  CHECK(c.stats().passes == s.passes + 5);
}
