"""The GIL is released while the library works: another Python thread keeps running during a long call."""

import sys
import threading
import time

import numpy as np
import pytest

import softkv


class Ticker:
    """A Python thread recording time stamps every ~0.1 ms; it can only stamp while it holds the GIL.

    The switch interval is raised to 10 s meanwhile, so the interpreter never takes the GIL from the
    main thread by itself: the ticker runs only when the main thread gives the GIL up (a sleep, or a
    C call that releases it). A call that keeps the GIL therefore has no stamp inside it at all."""

    def __init__(self):
        self.stamps = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.interval = sys.getswitchinterval()

    def run(self):
        while not self.stop.is_set():
            self.stamps.append(time.perf_counter())
            time.sleep(0.0001)  # gives the GIL back at once, so the main thread resumes without waiting

    def __enter__(self):
        sys.setswitchinterval(10.0)
        self.thread.start()
        while not self.stamps:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.interval)

    def ticks_inside(self, t0, t1):
        return sum(1 for s in self.stamps if t0 < s < t1)


def ticks_during(fn, min_seconds=0.05):
    """Runs fn (repeatedly, until min_seconds passed) beside a Ticker; returns the ticks stamped strictly
    inside calls. A call that held the GIL throughout would leave none: the ticker could not run. So one
    tick is already proof; a busy machine only lowers the count."""
    inside, calls = 0, 0
    with Ticker() as ticker:
        start = time.perf_counter()
        while time.perf_counter() - start < min_seconds or calls == 0:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            calls += 1
            inside += ticker.ticks_inside(t0, t1)
    return inside


@pytest.fixture(scope="module")
def big():
    rng = np.random.default_rng(3)
    n, d = 200_000, 64
    keys = rng.standard_normal((n, d), dtype=np.float32)
    c = softkv.Collection(d, d)
    c.add_batch(keys, keys)
    return c, keys


def test_the_ticker_tells_a_call_that_keeps_the_gil_from_one_that_releases_it():
    assert ticks_during(lambda: sum(range(3_000_000))) == 0  # a C loop that keeps the GIL
    assert ticks_during(lambda: time.sleep(0.01)) > 0  # a call that releases it


@pytest.mark.parametrize("call", ["query_soft", "query_hard", "query_soft_batch", "query_hard_batch", "query_soft_top_m"])
def test_queries_release_the_gil(big, call):
    c, keys = big
    q = keys[:1] if "batch" in call else keys[0]
    fn = {"query_soft_top_m": lambda: c.query_soft(keys[0], top_m=5, threads=1)}.get(call, lambda: getattr(c, call)(q, threads=1))
    assert ticks_during(fn) > 0


def test_writes_release_the_gil():
    rng = np.random.default_rng(4)
    keys = rng.standard_normal((100_000, 64), dtype=np.float32)
    c = softkv.Collection(64, 64, metric="cosine")
    assert ticks_during(lambda: c.add_batch(keys, keys)) > 0


def test_two_threads_query_at_once(big):
    c, keys = big
    running, overlap = [0], [0]
    lock = threading.Lock()

    def worker():
        for _ in range(4):
            with lock:
                running[0] += 1
            c.query_soft(keys[1], threads=1)
            with lock:
                overlap[0] = max(overlap[0], running[0])
                running[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(2)]
    with Ticker() as ticker:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t1 = time.perf_counter()
    assert overlap[0] == 2  # both were inside query_soft at the same time
    assert ticker.ticks_inside(t0, t1) > 0


def test_database_writes_snapshots_and_index_builds_release_the_gil(tmp_path):
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((60_000, 64), dtype=np.float32)
    with softkv.Database(str(tmp_path / "db"), fsync="always") as db:
        db.create_collection("m", 64, 64)
        assert ticks_during(lambda: db.add("m", keys, keys), min_seconds=0.01) > 0
        assert ticks_during(db.snapshot, min_seconds=0.01) > 0
    c = softkv.Collection(64, 64, index="ivf", ivf_nlist=256, ivf_train_size=20_000)
    with Ticker() as ticker:
        c.add_batch(keys, keys)  # IVF training (k-means, ~1 s here) starts in the background
        assert c.index_building
        t0 = time.perf_counter()
        c.wait_until_indexed()
        t1 = time.perf_counter()
    assert not c.index_building and ticker.ticks_inside(t0, t1) > 0


def test_threads_querying_one_collection_share_passes(big):
    """Coalescing: single queries from Python threads (the GIL released) wait for and share passes."""
    c, _ = big
    c.coalescing = True
    before = c.coalescing_stats()
    queries = np.random.default_rng(5).standard_normal((32, c.dim)).astype(np.float32)
    threads = [threading.Thread(target=lambda q=q: c.query_soft(q)) for q in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = c.coalescing_stats()
    assert after["queries"] - before["queries"] == 32
    assert after["passes"] - before["passes"] <= 32
    c.coalescing = False
    assert not c.coalescing
    c.query_soft(queries[0])
    assert c.coalescing_stats()["queries"] == after["queries"]  # off: not coalesced
    c.coalescing = True
