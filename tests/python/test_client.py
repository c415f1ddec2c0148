"""The Python client (softkv.Client) against a live softkv-server (run by ctest).

Usage: PYTHONPATH=BUILD/python test_client.py --server PATH/softkv-server --cli PATH/softkv
Checks answers against a float64 numpy reference, bit-for-bit against the C++ client (through the
softkv command-line tool writing .npy) and against the native module on the same data, typed errors
(the same softkv.Error subclasses the module raises), and the CLI's .npy/.fvecs loading.
"""

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import softkv
import softkv.client
from softkv import Error as SoftkvError
from server_process import start_server

Client = softkv.Client  # held to --protocol in main()

ARGS = None
PORT = None
SERVER = None
WORK = None


def reference_soft(keys, values, q, scale):
    s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
    w = np.exp(s - s.max())
    w /= w.sum()
    return w @ values.astype(np.float64), s


def cli(*args):
    out = subprocess.run([ARGS.cli, "--port", str(PORT), *args], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"softkv {' '.join(args)} failed: {out.stderr}")
    return out.stdout


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        rng = np.random.default_rng(7)
        cls.d, cls.dv, cls.n = 16, 5, 2000
        cls.keys = rng.standard_normal((cls.n, cls.d), dtype=np.float32)
        cls.values = rng.standard_normal((cls.n, cls.dv), dtype=np.float32)
        cls.queries = rng.standard_normal((7, cls.d), dtype=np.float32)
        with Client(port=PORT) as c:
            c.create_collection("py", dim=cls.d, value_dim=cls.dv)
            cls.ids = c.add("py", cls.keys, cls.values)

    def test_out_of_range_ids_tags_and_floats_raise_the_modules_error_classes(self):
        """Each id, tag and float argument at and past its extremes: the client raises the softkv.Error
        subclass the module raises for it (never OverflowError or struct.error, never a wrapped or
        truncated value stored), and the connection stays usable."""
        module = softkv.Collection(self.d, self.dv)
        k, v, q = self.keys[:1], self.values[:1], self.queries[0]
        with Client(port=PORT) as c:
            size = c.describe("py")["size"]
            cases = [("get(-1)", lambda: c.get("py", -1), lambda: module.get(-1)),
                     ("get(2**64)", lambda: c.get("py", 1 << 64), lambda: module.get(1 << 64)),
                     ("get(1.5)", lambda: c.get("py", 1.5), lambda: module.get(1.5)),
                     ("remove([-1])", lambda: c.remove("py", [-1]), lambda: module.remove_batch([-1])),
                     ("upsert ids [2**64]", lambda: c.upsert("py", [1 << 64], k, v), lambda: module.upsert_batch([1 << 64], k, v))]
            if c.protocol_version >= 2:
                for tags in ([-1], [1.5], [1 << 64], np.array([-1]), np.array([1.5])):
                    cases.append((f"add tags={tags!r}", functools.partial(c.add, "py", k, v, tags=tags),
                                  functools.partial(module.add_batch, k, v, tags=tags)))
                for mask in ({"tags_any": [-1]}, {"tags_any": [1.5]}, {"tag_range": (-1, 5)}, {"tag_range": (0, 1 << 64)},
                             {"exclude": [-1]}, {"tolerance": 1e39}, {"tolerance": float("nan")}):
                    cases.append((f"query {mask}", functools.partial(c.query_soft, "py", q, **mask),
                                  functools.partial(module.query_soft, q, **mask)))
            for label, client_call, module_call in cases:
                with self.subTest(label):
                    with self.assertRaises(SoftkvError) as expected:
                        module_call()
                    with self.assertRaises(type(expected.exception)):
                        client_call()
            self.assertEqual(c.get("py", int(self.ids[0]))[1].tolist(), self.values[0].tolist())  # still usable
            self.assertEqual(c.describe("py")["size"], size)  # nothing was stored

    def test_hello_settles_the_protocol_version_asked_for(self):
        with Client(port=PORT) as c:
            self.assertEqual(c.protocol_version, ARGS.protocol)
        with self.assertRaises(softkv.InvalidArgument):
            softkv.Client(port=PORT, protocol_version=4)

    def test_error_target_over_the_wire(self):
        """(v3) error_target and check_sample travel; the answer is the module's on the same rows, with
        rows_scored and error_estimate; below version 3 they are refused, not dropped."""
        with Client(port=PORT) as c:
            rng = np.random.default_rng(9)
            n, d = 40_000, 16
            keys = rng.standard_normal((n, d), dtype=np.float32)
            values = rng.standard_normal((n, d), dtype=np.float32)
            local = softkv.Collection(d, d)
            local.add_batch(keys, values)
            q = rng.standard_normal(d, dtype=np.float32)
            if c.protocol_version < 3:
                with self.assertRaises(softkv.Unsupported):
                    c.query_soft("nope", q, error_target=0.1)
                with self.assertRaises(softkv.Unsupported):
                    c.query_soft("nope", q, check_sample=8)
                return
            c.create_collection("est", d, d)
            for first in range(0, n, 10_000):
                c.add("est", keys[first:first + 10_000], values[first:first + 10_000])
            got = c.query_soft("est", q, error_target=0.05)
            want = local.query_soft(q, error_target=0.05)
            np.testing.assert_array_equal(got.value, want.value)  # the same blocks: drawn from the query's bytes
            self.assertEqual(got.rows_scored, want.rows_scored)
            self.assertEqual(got.error_estimate, want.error_estimate)
            self.assertLess(got.rows_scored, n)
            self.assertGreater(got.error_estimate, 0.0)
            batch = c.query_soft_batch("est", np.stack([q, q]), error_target=0.05)
            self.assertEqual(list(batch.rows_scored), [want.rows_scored] * 2)
            exact = c.query_soft("est", q)
            self.assertEqual(exact.rows_scored, n)
            self.assertEqual(exact.error_estimate, 0.0)
            with self.assertRaises(softkv.InvalidArgument):
                c.query_soft("est", q, error_target=float("nan"))
            for negative in (-0.5, -1e-300):  # -1e-300: below the float range, still negative (not -0, the exact answer)
                with self.assertRaises(softkv.InvalidArgument):
                    c.query_soft("est", q, error_target=negative)
            with self.assertRaises(softkv.InvalidArgument):
                c.query_soft("est", q, epsilon=-1e-300)
            # check_sample above the wire's u32 means what 2^32 - 1 does (PROTOCOL.md): sent as that.
            self.assertEqual(c.query_soft("est", q, error_target=0.05, check_sample=1 << 40).rows_scored, want.rows_scored)
            with self.assertRaises(softkv.InvalidArgument):
                c.query_soft("est", q, check_sample=-1)
            for field in ("top_m", "ef_search", "nprobe", "top_k"):  # counts above u32: refused, naming the field
                with self.assertRaisesRegex(softkv.InvalidArgument, field):
                    c.query_soft("est", q, **{field: 1 << 32})
            c.drop_collection("est")

    def test_soft_and_hard_match_a_float64_reference(self):
        with Client(port=PORT) as c:
            for q in self.queries:
                r = c.query_soft("py", q, temperature=0.5, top_m=3)
                ref, scores = reference_soft(self.keys, self.values, q, 1.0 / (np.sqrt(self.d) * 0.5))
                np.testing.assert_allclose(r.value, ref, rtol=1e-4, atol=1e-5)
                self.assertEqual(r.candidates, self.n)
                self.assertEqual([t[0] for t in r.top], list(np.argsort(-scores)[:3]))
                h = c.query_hard("py", q)
                self.assertEqual(h.id, int(np.argmax(self.keys @ q)))
                np.testing.assert_array_equal(h.value, self.values[h.id])
            batch = c.query_soft_batch("py", self.queries)
            self.assertEqual(batch.values.shape, (7, self.dv))

    def test_answers_are_bit_for_bit_those_of_the_cpp_client(self):
        qfile, soft_out, hard_out = (os.path.join(WORK, f) for f in ("q.npy", "soft.npy", "hard.npy"))
        np.save(qfile, self.queries)
        cli("query", "py", "--queries", qfile, "--temperature", "0.25", "--top-m", "0", "--out", soft_out)
        cli("query", "py", "--queries", qfile, "--hard", "--out", hard_out)
        with Client(port=PORT) as c:
            soft = c.query_soft_batch("py", self.queries, temperature=0.25).values
            hard = np.stack([h.value for h in c.query_hard_batch("py", self.queries)])
            single = c.query_soft("py", self.queries[0], temperature=0.25)
        np.testing.assert_array_equal(soft, np.load(soft_out))
        np.testing.assert_array_equal(hard, np.load(hard_out))
        self.assertEqual(single.value.dtype, np.float32)

    def test_answers_are_bit_for_bit_the_native_modules_in_the_same_classes(self):
        local = softkv.Collection(self.d, self.dv)
        np.testing.assert_array_equal(local.add_batch(self.keys, self.values), self.ids)
        with Client(port=PORT) as c:
            for options in ({}, {"temperature": 0.25, "top_m": 4}, {"scale": 3.0}):
                remote, here = c.query_soft("py", self.queries[1], **options), local.query_soft(self.queries[1], **options)
                self.assertIs(type(remote), softkv.SoftResult)
                np.testing.assert_array_equal(remote.value, here.value)
                self.assertEqual((remote.lse, remote.max_score, remote.candidates), (here.lse, here.max_score, here.candidates))
                self.assertEqual(remote.top, here.top)
                np.testing.assert_array_equal(remote.top.ids, here.top.ids)
            remote, here = c.query_soft_batch("py", self.queries), local.query_soft_batch(self.queries)
            self.assertIs(type(remote), softkv.SoftBatchResult)
            for field in ("values", "lse", "max_score", "candidates", "tail_bound", "tail_bound_guaranteed"):
                np.testing.assert_array_equal(getattr(remote, field), getattr(here, field), err_msg=field)
            self.assertEqual(remote.searched_with, here.searched_with)
            remote, here = c.query_hard_batch("py", self.queries), local.query_hard_batch(self.queries)
            self.assertIs(type(remote), softkv.HardBatchResult)
            for field in ("ids", "scores", "values"):
                np.testing.assert_array_equal(getattr(remote, field), getattr(here, field), err_msg=field)
            h = c.query_hard("py", self.queries[2])
            self.assertIs(type(h), softkv.HardResult)
            self.assertEqual((h.id, h.score), (local.query_hard(self.queries[2]).id, local.query_hard(self.queries[2]).score))

    def test_describe_is_the_dict_database_stats_gives(self):
        with Client(port=PORT) as c, tempfile.TemporaryDirectory() as d:
            with softkv.Database(d, fsync="never") as db:
                db.create_collection("py", self.d, self.dv)
                db.add("py", self.keys, self.values)
                local = db.stats("py")
            remote = c.describe("py")
        compact_fields = {"key_precision", "value_precision", "heads"}  # (v2) only
        self.assertEqual(set(remote), set(local) if ARGS.protocol >= 2 else set(local) - compact_fields)
        for key in ("name", "size", "dim", "value_dim", "metric", "index"):
            self.assertEqual(remote[key], local[key], key)

    def test_query_stats_counts_the_collections_coalesced_queries(self):
        with Client(port=PORT) as c:
            before = c.query_stats("py")
            c.query_soft("py", self.queries[0])
            c.query_hard("py", self.queries[1])
            after = c.query_stats("py")
            self.assertEqual(set(after), {"queries", "passes", "max_batch"})
            self.assertEqual(after["queries"], before["queries"] + 2)
            self.assertGreaterEqual(after["passes"], before["passes"] + 1)
            # A batch request answered by one batched pass is not counted; one answered query by query
            # (soft with top_m > 0) counts each of its queries as a single query (PROTOCOL.md).
            c.query_soft_batch("py", self.queries[:3])
            c.query_hard_batch("py", self.queries[:3])
            if ARGS.protocol >= 2:
                c.query_soft("py", self.queries[0], exclude=[0])  # masked: never waits, not counted
            self.assertEqual(c.query_stats("py"), after)
            c.query_soft_batch("py", self.queries[:3], top_m=2)
            self.assertEqual(c.query_stats("py")["queries"], after["queries"] + 3)
            with self.assertRaises(softkv.UnknownCollection):
                c.query_stats("no-such-collection")

    def test_errors_are_the_modules_subclasses(self):
        with Client(port=PORT) as c:
            for call, cls in ((lambda: c.query_soft("py", np.ones(self.d + 1)), softkv.DimensionMismatch),
                              (lambda: c.query_soft("py", np.ones((2, self.d))), softkv.DimensionMismatch),
                              (lambda: c.query_soft("py", np.ones(self.d), temperature=-1.0), softkv.InvalidArgument),
                              (lambda: c.get("py", 10**9), softkv.UnknownId),
                              (lambda: c.query_hard("missing", np.ones(self.d)), softkv.UnknownCollection),
                              (lambda: c.create_collection("py", dim=2, value_dim=2), softkv.CollectionExists)):
                with self.assertRaises(cls) as e:
                    call()
                self.assertEqual(e.exception.code, cls.code)
                self.assertTrue(e.exception.message)
            c.ping()

    def test_errors_are_typed_and_the_connection_survives(self):
        with Client(port=PORT) as c:
            with self.assertRaises(SoftkvError) as e:
                c.query_soft("py", np.ones(self.d - 1, dtype=np.float32))
            self.assertEqual(e.exception.name, "dimension_mismatch")
            bad = np.ones(self.d, dtype=np.float32)
            bad[3] = np.nan
            with self.assertRaises(SoftkvError) as e:
                c.query_soft("py", bad)
            self.assertEqual(e.exception.name, "non_finite")
            with self.assertRaises(SoftkvError) as e:
                c.describe("missing")
            self.assertEqual(e.exception.name, "unknown_collection")
            c.ping()

    def test_a_frame_over_the_limit_raises_frame_too_large_locally_or_from_the_server(self):
        rows = (64 << 20) // (4 * (self.d + self.dv)) + 1000  # ~70 MB: over the server's default 64 MiB limit
        keys = np.ones((rows, self.d), dtype=np.float32)
        values = np.ones((rows, self.dv), dtype=np.float32)
        with Client(port=PORT) as c:  # knows the limit: refused before sending, connection still usable
            with self.assertRaises(SoftkvError) as e:
                c.add("py", keys, values)
            self.assertEqual(e.exception.name, "frame_too_large")
            c.ping()
        for _ in range(2):  # thinks the limit is higher: sends it all, and the server's error still arrives
            with Client(port=PORT, max_frame=128 << 20) as c:
                with self.assertRaises(SoftkvError) as e:
                    c.add("py", keys, values)
                self.assertEqual(e.exception.name, "frame_too_large")
        with Client(port=PORT) as c:
            self.assertEqual(c.describe("py")["size"], self.n)

    def test_writes_reads_and_stats(self):
        with Client(port=PORT) as c:
            c.create_collection("rw", dim=3, value_dim=2, metric="cosine")
            ids = c.add("rw", np.array([[3, 0, 4], [1, 1, 1]], dtype=np.float32), np.array([[1, 2], [3, 4]], dtype=np.float32))
            key, value = c.get("rw", int(ids[0]))
            np.testing.assert_allclose(key, [0.6, 0.0, 0.8], rtol=1e-6)
            np.testing.assert_array_equal(value, [1, 2])
            c.upsert("rw", [int(ids[0])], np.array([[0, 1, 0]], dtype=np.float32), np.array([[9, 9]], dtype=np.float32))
            c.remove("rw", [int(ids[1])])
            self.assertEqual(c.describe("rw")["size"], 1)
            self.assertIn("rw", c.list_collections())
            c.snapshot()
            self.assertGreaterEqual(c.stats()["collections"], 2)
            c.drop_collection("rw")

    def test_compact_collections_over_the_wire_and_the_cli(self):
        with Client(port=PORT) as c:
            if ARGS.protocol < 2:  # a version-1 connection has no fields for it: refused before sending
                with self.assertRaises(SoftkvError) as e:
                    c.create_collection("half", dim=4, value_dim=2, key_precision="f16")
                self.assertEqual(e.exception.name, "unsupported")
                return
            c.create_collection("half", dim=4, value_dim=2, key_precision="i8", value_precision="f16")
            d = c.describe("half")
            self.assertEqual((d["key_precision"], d["value_precision"]), ("i8", "f16"))
            ids = c.add("half", np.array([[1, 2, 3, 4]], dtype=np.float32), np.array([[0.1, -3]], dtype=np.float32))
            _, value = c.get("half", int(ids[0]))
            self.assertEqual(value[0], np.float32(np.float16(0.1)))  # stored as f16, returned widened
            with self.assertRaises(SoftkvError) as e:
                c.add("half", np.zeros((1, 4), dtype=np.float32), np.array([[7e4, 0]], dtype=np.float32))
            self.assertEqual(e.exception.name, "invalid_argument")
            c.drop_collection("half")
        cli("create", "halfcli", "--dim", "3", "--value-dim", "2", "--key-precision", "f16", "--value-precision", "bf16")
        self.assertIn("keys f16, values bf16", cli("stats", "halfcli"))

    def test_cli_loads_npy_and_fvecs(self):
        keys = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
        values = np.ones((4, 2), dtype=np.float32)
        np.save(os.path.join(WORK, "k.npy"), keys)
        np.save(os.path.join(WORK, "v.npy"), values)
        with open(os.path.join(WORK, "k.fvecs"), "wb") as f:
            for row in keys:
                f.write(np.int32(3).tobytes() + row.tobytes())
        cli("create", "loaded", "--dim", "3", "--value-dim", "2")
        cli("load", "loaded", "--keys", os.path.join(WORK, "k.npy"), "--values", os.path.join(WORK, "v.npy"), "--batch", "3")
        cli("load", "loaded", "--keys", os.path.join(WORK, "k.fvecs"), "--values", os.path.join(WORK, "v.npy"))
        with Client(port=PORT) as c:
            self.assertEqual(c.describe("loaded")["size"], 8)
            key, _ = c.get("loaded", 5)
            np.testing.assert_array_equal(key, keys[1])
        self.assertIn("8 entries", cli("stats", "loaded"))


class MaskTest(unittest.TestCase):
    """Tags and masks (protocol 2) through the client, the native module and the CLI; refused on version 1."""

    @classmethod
    def setUpClass(cls):
        rng = np.random.default_rng(11)
        cls.d, cls.dv, cls.n = 8, 3, 600
        cls.keys = rng.standard_normal((cls.n, cls.d), dtype=np.float32)
        cls.values = rng.standard_normal((cls.n, cls.dv), dtype=np.float32)
        cls.tags = (np.arange(cls.n) // 60).astype(np.uint64)  # 10 time steps of 60 rows, stored together
        cls.tags[-1] = 2**64 - 1
        cls.q = rng.standard_normal(cls.d, dtype=np.float32)
        cls.name = f"masks{ARGS.protocol}"
        with Client(port=PORT) as c:
            c.create_collection(cls.name, dim=cls.d, value_dim=cls.dv)
            cls.ids = c.add(cls.name, cls.keys, cls.values, tags=cls.tags if ARGS.protocol >= 2 else None)

    def test_version_1_refuses_tags_and_masks(self):
        if ARGS.protocol >= 2:
            self.skipTest("a version-2 connection")
        with Client(port=PORT) as c:
            with self.assertRaises(softkv.Unsupported):
                c.add(self.name, self.keys[:1], self.values[:1], tags=[1])
            with self.assertRaises(softkv.Unsupported):
                c.query_soft(self.name, self.q, tag_range=(0, 1))
            with self.assertRaises(softkv.Unsupported):
                c.get(self.name, 0, with_tag=True)
            self.assertEqual(c.describe(self.name)["size"], self.n)  # the refused add stored nothing
            self.assertEqual(c.query_soft(self.name, self.q).candidates, self.n)

    def test_masked_answers_match_the_reference_the_native_module_and_the_cli(self):
        if ARGS.protocol < 2:
            self.skipTest("masks need protocol 2")
        local = softkv.Collection(self.d, self.dv)
        local.add_batch(self.keys, self.values, tags=self.tags)
        exclude = [int(self.ids[0]), int(self.ids[130])]
        masks = [dict(tags_any=[3]), dict(tag_range=(0, 4)), dict(exclude=exclude),
                 dict(tags_any=[1, 2, 9, 2**64 - 1], tag_range=(2, 2**64 - 1), exclude=exclude)]
        with Client(port=PORT) as c:
            key, value, tag = c.get(self.name, int(self.ids[-1]), with_tag=True)
            self.assertEqual(tag, 2**64 - 1)
            self.assertEqual(local.get(int(self.ids[-1]), with_tag=True)[2], 2**64 - 1)
            for mask in masks:
                keep = np.ones(self.n, dtype=bool)
                if "tags_any" in mask:
                    keep &= np.isin(self.tags, np.array(mask["tags_any"], dtype=np.uint64))
                if "tag_range" in mask:
                    keep &= (self.tags >= mask["tag_range"][0]) & (self.tags <= mask["tag_range"][1])
                if "exclude" in mask:
                    keep &= ~np.isin(self.ids, exclude)
                ref, scores = reference_soft(self.keys[keep], self.values[keep], self.q, 1.0 / np.sqrt(self.d))
                r = c.query_soft(self.name, self.q, top_m=3, **mask)
                np.testing.assert_allclose(r.value, ref, rtol=1e-4, atol=1e-5)
                self.assertEqual(r.candidates, int(keep.sum()))
                self.assertFalse(r.mask_filtered_after_search)
                self.assertEqual([t[0] for t in r.top], list(self.ids[keep][np.argsort(-scores)[:3]]))
                np.testing.assert_array_equal(r.value, local.query_soft(self.q, **mask).value)
                h = c.query_hard(self.name, self.q, **mask)
                self.assertEqual(h.id, int(self.ids[keep][np.argmax(scores)]))
                batch = c.query_soft_batch(self.name, np.stack([self.q, self.q]), **mask)
                np.testing.assert_allclose(batch.values[1], ref, rtol=1e-4, atol=1e-5)
            with self.assertRaises(softkv.EmptyCollection):
                c.query_soft(self.name, self.q, tags_any=[12345])
            with self.assertRaises(softkv.InvalidArgument):
                c.query_hard(self.name, self.q, tag_range=(5, 4))
            with self.assertRaises(softkv.InvalidArgument):
                c.query_soft(self.name, self.q, tags_any=list(range(1025)))
        # The CLI (the C++ client) gives the same masked answer, bit for bit.
        qfile, out = os.path.join(WORK, "mq.npy"), os.path.join(WORK, "masked.npy")
        np.save(qfile, self.q[None, :])
        cli("query", self.name, "--queries", qfile, "--top-m", "0", "--tags", "1,2,9," + str(2**64 - 1),
            "--tag-range", f"2,{2**64 - 1}", "--exclude", ",".join(map(str, exclude)), "--out", out)
        np.testing.assert_array_equal(np.load(out)[0], local.query_soft(self.q, **masks[3]).value)
        cli("create", "tagged", "--dim", str(self.d), "--value-dim", str(self.dv))
        np.save(os.path.join(WORK, "tk.npy"), self.keys[:4])
        np.save(os.path.join(WORK, "tv.npy"), self.values[:4])
        cli("load", "tagged", "--keys", os.path.join(WORK, "tk.npy"), "--values", os.path.join(WORK, "tv.npy"), "--tag", "42")
        self.assertIn("candidates 4", cli("query", "tagged", "--query", ",".join(["1"] * self.d), "--tags", "42"))


class HeadsTest(unittest.TestCase):
    """Multi-head collections and iterative retrieval (protocol 2) through the client, the native module and
    the CLI; refused on version 1."""

    @classmethod
    def setUpClass(cls):
        rng = np.random.default_rng(13)
        cls.d, cls.h, cls.n = 12, 3, 400
        cls.keys = rng.standard_normal((cls.n, cls.d), dtype=np.float32)
        cls.values = rng.standard_normal((cls.n, cls.d), dtype=np.float32)
        cls.q = rng.standard_normal(cls.d, dtype=np.float32)
        cls.name = f"heads{ARGS.protocol}"
        cls.local = softkv.Collection(cls.d, cls.d, heads=cls.h)
        cls.local.add_batch(cls.keys, cls.values)
        # The collection is created over a version-2 connection whatever --protocol says.
        with softkv.Client(port=PORT) as c:
            if not c.list_collections().count(cls.name):
                c.create_collection(cls.name, dim=cls.d, value_dim=cls.d, heads=cls.h)
                c.add(cls.name, cls.keys, cls.values)

    def test_version_1_refuses_heads_and_iterations(self):
        if ARGS.protocol >= 2:
            self.skipTest("a version-2 connection")
        with Client(port=PORT) as c:
            with self.assertRaises(softkv.Unsupported):
                c.create_collection("h1", dim=4, value_dim=4, heads=2)
            with self.assertRaises(softkv.Unsupported):
                c.query_soft(self.name, self.q)  # a v1 reply cannot carry per-head answers
            with self.assertRaises(softkv.Unsupported):
                c.query_hard(self.name, self.q)
            with self.assertRaises(softkv.Unsupported):
                c.query_soft("py", np.zeros(16, dtype=np.float32), iterations=2)
            self.assertNotIn("heads", c.describe(self.name))

    def test_multi_head_and_iterative_answers_match_the_native_module_and_the_cli(self):
        if ARGS.protocol < 2:
            self.skipTest("heads need protocol 2")
        with Client(port=PORT) as c:
            self.assertEqual(c.describe(self.name)["heads"], self.h)
            r, mine = c.query_soft(self.name, self.q, top_m=2), self.local.query_soft(self.q, top_m=2)
            np.testing.assert_array_equal(r.value, mine.value)
            np.testing.assert_array_equal(r.head_lse, mine.head_lse)
            np.testing.assert_array_equal(r.head_max_score, mine.head_max_score)
            self.assertEqual([list(t) for t in r.head_top], [list(t) for t in mine.head_top])
            self.assertEqual(len(r.head_lse), self.h)
            hard = c.query_hard(self.name, self.q)
            np.testing.assert_array_equal(hard.head_ids, self.local.query_hard(self.q).head_ids)
            batch = c.query_hard_batch(self.name, np.stack([self.q, -self.q]))
            self.assertEqual(batch.head_ids.shape, (2, self.h))
            it = c.query_soft(self.name, self.q, iterations=5, tolerance=1e-5)
            np.testing.assert_array_equal(it.value, self.local.query_soft(self.q, iterations=5, tolerance=1e-5).value)
            self.assertTrue(1 <= it.iterations_run <= 5)
            before = c.query_stats(self.name)["queries"]
            c.query_soft(self.name, self.q, top_m=2)  # multi-head with top_m: never waits, not counted
            self.assertEqual(c.query_stats(self.name)["queries"], before)
            sb = c.query_soft_batch(self.name, np.stack([self.q, self.q]), iterations=3)
            self.assertEqual(sb.head_lse.shape, (2, self.h))
            self.assertEqual(list(sb.iterations_run), [3, 3])
            self.assertEqual(c.query_stats(self.name)["queries"], before + 6)  # each iteration counts as a query
            for bad in (dict(iterations=0), dict(iterations=1001), dict(iterations=2, tolerance=float("nan")),
                        dict(iterations=2, tolerance=-1.0)):
                with self.assertRaises(softkv.InvalidArgument):
                    c.query_soft(self.name, self.q, **bad)
            with self.assertRaises(softkv.Unsupported):
                c.query_soft(self.name, self.q, top_k=3)
            for heads in (0, 1025, 5):
                with self.assertRaises(softkv.InvalidArgument):
                    c.create_collection("badheads", dim=12, value_dim=12, heads=heads)
        # The CLI (the C++ client): the same answer bit for bit, per-head lines, and --heads at creation.
        qfile, out = os.path.join(WORK, "hq.npy"), os.path.join(WORK, "heads.npy")
        np.save(qfile, self.q[None, :])
        text = cli("query", self.name, "--queries", qfile, "--iterations", "5", "--tolerance", "1e-5", "--out", out)
        self.assertIn("iterations run", text)
        np.testing.assert_array_equal(np.load(out)[0], self.local.query_soft(self.q, iterations=5, tolerance=1e-5).value)
        self.assertIn("head 2:", cli("query", self.name, "--queries", qfile, "--hard"))
        self.assertIn("heads 4", cli("create", "cliheads", "--dim", "8", "--value-dim", "8", "--heads", "4"))
        self.assertIn("heads 4", cli("stats", "cliheads"))


def main():
    global ARGS, PORT, SERVER, WORK
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--protocol", type=int, default=softkv.client.PROTOCOL_VERSION,
                        help="the protocol version every Client here speaks (1: as a client before version 2)")
    ARGS, rest = parser.parse_known_args()
    global Client
    Client = functools.partial(softkv.Client, protocol_version=ARGS.protocol)
    with tempfile.TemporaryDirectory() as work:
        WORK = work
        SERVER, PORT = start_server([ARGS.server, "--data", os.path.join(work, "data"), "--fsync", "never"],
                                    os.path.join(work, "server.log"))
        try:
            result = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2).result
        finally:
            SERVER.terminate()
            SERVER.wait(timeout=30)
        sys.exit(0 if result.wasSuccessful() and SERVER.returncode == 0 else 1)


if __name__ == "__main__":
    main()
