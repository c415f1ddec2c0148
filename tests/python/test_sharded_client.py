"""The Python client (softkv.Client) against a sharded server (mpirun -np P softkv-server) and a
single server holding the same data (run by ctest).

Usage: PYTHONPATH=BUILD/python test_sharded_client.py --server PATH/softkv-server --mpirun PATH/mpirun --ranks P
Both servers must give the same answers (soft values and lse to float rounding, hard ids exactly,
ties across ranks to the smallest id, pruned answers), and both must match a float64 reference.
"""

import argparse
import os
import signal
import sys
import tempfile
import unittest

import numpy as np

import softkv
from server_process import start_server

ARGS = None


def reference_soft(keys, values, q, scale):
    s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
    w = np.exp(s - s.max())
    lse = s.max() + np.log(w.sum())
    w /= w.sum()
    return w @ values.astype(np.float64), lse


class ShardedClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.TemporaryDirectory()
        w = cls.work.name
        cls.procs = []
        single, cls.single_port = start_server([ARGS.server, "--data", os.path.join(w, "single")], os.path.join(w, "single.log"))
        cls.procs.append(single)
        sharded, cls.sharded_port = start_server([ARGS.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ARGS.ranks),
                                           ARGS.server, "--data", os.path.join(w, "sharded")], os.path.join(w, "sharded.log"))
        cls.procs.append(sharded)

    @classmethod
    def tearDownClass(cls):
        for p in cls.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        cls.work.cleanup()

    def test_same_answers(self):
        rng = np.random.default_rng(5)
        d, dv, n = 16, 5, 500
        keys = rng.standard_normal((n, d), dtype=np.float32)
        values = rng.standard_normal((n, dv), dtype=np.float32)
        keys[10:14] = 0.0
        keys[10:14, 0] = 20.0  # ids 10..13 (on different ranks) tie as the best match of e0
        clients = [softkv.Client(port=self.single_port), softkv.Client(port=self.sharded_port)]
        for c in clients:
            c.create_collection("m", d, dv)
            c.create_collection("f", d, dv, index="flat")
            for name in ("m", "f"):
                ids = c.add(name, keys, values)
                self.assertEqual(list(ids), list(range(n)))
            c.remove("m", [3, 4, 5])
        live = np.array([i for i in range(n) if i not in (3, 4, 5)])
        queries = rng.standard_normal((6, d), dtype=np.float32)
        queries[0] = 0.0
        queries[0, 0] = 1.0
        single, sharded = clients
        self.assertEqual(sharded.list_collections(), single.list_collections())
        self.assertEqual(sharded.describe("m")["size"], n - 3)
        for name, rows in (("m", live), ("f", np.arange(n))):
            a = single.query_soft_batch(name, queries, top_m=4)
            b = sharded.query_soft_batch(name, queries, top_m=4)
            np.testing.assert_allclose(b.values, a.values, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b.lse, a.lse, rtol=1e-6)
            for i, q in enumerate(queries):
                ref, lse = reference_soft(keys[rows], values[rows], q, 1 / np.sqrt(d))
                np.testing.assert_allclose(b.values[i], ref, rtol=1e-4, atol=1e-5)
                self.assertAlmostEqual(float(b.lse[i]), lse, delta=1e-4 * max(1.0, abs(lse)))
            ha = single.query_hard_batch(name, queries)
            hb = sharded.query_hard_batch(name, queries)
            self.assertEqual(list(hb.ids), list(ha.ids))
            self.assertEqual(int(hb.ids[0]), 10)  # the tie across ranks goes to the smallest id
            np.testing.assert_array_equal(hb.values, ha.values)
        for q in queries:
            a = single.query_soft("f", q, top_k=20, top_m=3)
            b = sharded.query_soft("f", q, top_k=20, top_m=3)
            np.testing.assert_allclose(b.value, a.value, rtol=1e-5, atol=1e-6)
            self.assertAlmostEqual(b.tail_bound, a.tail_bound, delta=1e-4 * max(a.tail_bound, 1e-12))
            self.assertEqual(list(b.top.ids), list(a.top.ids))
        e = sharded.get("m", 17)
        np.testing.assert_array_equal(e[0], keys[17])
        np.testing.assert_array_equal(e[1], values[17])
        with self.assertRaises(softkv.Error):
            sharded.query_soft("nope", queries[0])
        with self.assertRaises(softkv.Error):
            sharded.query_soft("m", queries[0], tags_any=[1])  # every tag is 0: the mask keeps nothing
        for mask in ({"exclude": [10, 11, 17]}, {"tag_range": (0, 0), "exclude": [10, 12]}):
            a = single.query_soft("m", queries[0], top_m=3, **mask)
            b = sharded.query_soft("m", queries[0], top_m=3, **mask)
            np.testing.assert_allclose(b.value, a.value, rtol=1e-5, atol=1e-6)
            self.assertEqual(list(b.top.ids), list(a.top.ids))
            self.assertNotIn(10, list(b.top.ids))  # the best match of e0, masked out
        # Rank 0's coalescing counters: on "m", the hard batch (6 queries, one pass) and the masked soft
        # query that found nothing (a pass of one); top-m queries are answered query by query, not counted.
        self.assertEqual(sharded.query_stats("m"), {"queries": 7, "passes": 2, "max_batch": 6})
        with self.assertRaises(softkv.Error):
            sharded.query_stats("nope")
        for c in clients:
            c.close()


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
