"""Multi-head collections and iterative (Hopfield) retrieval in the native module: against numpy float64
references, per-head result fields, persistence and typed errors."""

import numpy as np
import pytest

import softkv

from conftest import reference_soft


def heads_reference(keys, values, q, h, scale):
    """Head j: the single-head float64 reference on key slice j and value slice j."""
    dh, dvh = keys.shape[1] // h, values.shape[1] // h
    parts = [reference_soft(keys[:, j * dh:(j + 1) * dh], values[:, j * dvh:(j + 1) * dvh], q[j * dh:(j + 1) * dh], scale)
             for j in range(h)]
    return np.concatenate([p[0] for p in parts]), np.array([p[1] for p in parts]), np.array([p[3] for p in parts])


@pytest.fixture
def multi():
    rng = np.random.default_rng(15)
    n, d, dv, h = 800, 32, 16, 4
    keys = rng.standard_normal((n, d)).astype(np.float32)
    values = rng.standard_normal((n, dv)).astype(np.float32)
    c = softkv.Collection(d, dv, heads=h)
    ids = c.add_batch(keys, values)
    return c, keys, values, ids, h, rng.standard_normal(d).astype(np.float32)


def test_heads_match_a_float64_reference_on_every_kernel_path(multi, kernel_path):
    c, keys, values, ids, h, q = multi
    scale = 1.0 / np.sqrt(keys.shape[1] // h)
    value, lse, scores = heads_reference(keys, values, q, h, scale)
    r = c.query_soft(q, top_m=2)
    np.testing.assert_allclose(r.value, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.head_lse, lse, rtol=1e-6)
    assert r.head_lse.shape == (h,) and r.head_max_score.shape == (h,)
    assert r.lse == r.head_lse[0]
    for j in range(h):
        assert [t[0] for t in r.head_top[j]] == list(ids[np.argsort(-scores[j], kind="stable")[:2]])
    hard = c.query_hard(q)
    np.testing.assert_array_equal(hard.head_ids, ids[np.argmax(scores, axis=1)])
    dvh = values.shape[1] // h
    for j in range(h):
        np.testing.assert_array_equal(hard.value[j * dvh:(j + 1) * dvh], values[np.argmax(scores[j]), j * dvh:(j + 1) * dvh])


def test_batches_and_masks_with_heads(multi):
    c, keys, values, ids, h, q = multi
    qs = np.stack([q, -q, 2 * q])
    batch = c.query_soft_batch(qs)
    assert batch.head_lse.shape == (3, h)
    for b in range(3):
        np.testing.assert_array_equal(batch.values[b], c.query_soft(qs[b]).value)
        np.testing.assert_array_equal(batch.head_lse[b], c.query_soft(qs[b]).head_lse)
    hb = c.query_hard_batch(qs)
    assert hb.head_ids.shape == (3, h)
    np.testing.assert_array_equal(hb[1].head_ids, c.query_hard(qs[1]).head_ids)
    keep = np.arange(len(ids)) % 3 == 0
    excluded = ids[~keep]
    value, lse, _ = heads_reference(keys[keep], values[keep], q, h, 1.0 / np.sqrt(keys.shape[1] // h))
    r = c.query_soft(q, exclude=excluded)
    assert r.candidates == keep.sum()
    np.testing.assert_allclose(r.value, value, rtol=1e-5, atol=1e-6)
    assert set(c.query_hard(q, exclude=excluded).head_ids) <= set(ids[keep])


def test_every_precision_works_with_heads():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((300, 8)).astype(np.float32)
    values = rng.standard_normal((300, 8)).astype(np.float32)
    q = rng.standard_normal(8).astype(np.float32)
    for kp, vp in (("f16", "f16"), ("bf16", "bf16"), ("i8", "f32")):
        c = softkv.Collection(8, 8, heads=2, key_precision=kp, value_precision=vp)
        ids = c.add_batch(keys, values)
        stored_k = np.stack([c.get(int(i))[0] for i in ids])
        stored_v = np.stack([c.get(int(i))[1] for i in ids])
        value, _, _ = heads_reference(stored_k, stored_v, q, 2, 0.5)
        np.testing.assert_allclose(c.query_soft(q).value, value, rtol=1e-5, atol=1e-6)


def test_iterations_match_a_float64_reference_and_converge():
    rng = np.random.default_rng(4)
    n, d = 60, 32
    patterns = np.sign(rng.standard_normal((n, d))).astype(np.float32)
    c = softkv.Collection(d, d)
    ids = c.add_batch(patterns, patterns)
    q = patterns[7].copy()
    q[d // 2:] = 0
    x = q.astype(np.float64)
    for it in range(1, 6):
        s = 0.3 * (patterns.astype(np.float64) @ x)
        w = np.exp(s - s.max())
        new = (w / w.sum()) @ patterns
        change = np.linalg.norm(new - x) / np.linalg.norm(x)
        r = c.query_soft(q, scale=0.3, iterations=it)
        assert r.iterations_run == it
        np.testing.assert_allclose(r.value, new, rtol=1e-4, atol=1e-5)
        if it > 1:
            assert r.last_change == pytest.approx(change, rel=1e-3, abs=1e-6)
        x = new
    done = c.query_soft(q, scale=0.5, iterations=100, tolerance=1e-6, top_m=1)
    assert done.iterations_run < 100 and done.last_change <= 1e-6
    assert done.top[0][0] == ids[7]
    np.testing.assert_allclose(done.value, patterns[7], atol=5e-3)  # the fixed point leaks ~1e-3 to other patterns
    batch = c.query_soft_batch(np.stack([q, q]), scale=0.5, iterations=100, tolerance=1e-6)
    assert list(batch.iterations_run) == [done.iterations_run] * 2


def test_heads_persist_in_a_database(tmp_path):
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((20, 6)).astype(np.float32)
    q = rng.standard_normal(6).astype(np.float32)
    with softkv.Database(tmp_path, fsync="never") as db:
        db.create_collection("m", 6, 6, heads=3, metric="cosine")
        db.add("m", keys, keys)
        before = db.collection("m").query_soft(q).value
        assert db.stats("m")["heads"] == 3
    with softkv.Database(tmp_path, fsync="never") as db:
        assert db.collection("m").config["heads"] == 3
        np.testing.assert_array_equal(db.collection("m").query_soft(q).value, before)


def test_typed_errors():
    for heads in (0, 1025, 3):  # 20 is not divisible by 3
        with pytest.raises(softkv.InvalidArgument):
            softkv.Collection(20, 20, heads=heads)
    with pytest.raises(softkv.InvalidArgument):
        softkv.Collection(8, 8, heads=-1)
    with pytest.raises(softkv.InvalidArgument):
        softkv.Collection(8, 8, heads=2, index="hnsw")
    assert softkv.check_config(8, 8, heads=4)["heads"] == 4
    c = softkv.Collection(4, 4, heads=2)
    c.add(np.ones(4), np.ones(4))
    with pytest.raises(softkv.Unsupported):
        c.query_soft(np.ones(4), top_k=1)
    for bad in (dict(iterations=0), dict(iterations=1001), dict(iterations=-1), dict(iterations=2, tolerance=float("nan")),
                dict(iterations=2, tolerance=-1e-9), dict(iterations=2, tolerance=float("inf")),
                dict(iterations=2, tolerance=1e300)):
        with pytest.raises(softkv.InvalidArgument):
            c.query_soft(np.ones(4), **bad)
    with pytest.raises(softkv.InvalidArgument):
        c.query_hard(np.ones(4), iterations=2)
    wide = softkv.Collection(4, 2)
    wide.add(np.ones(4), np.ones(2))
    with pytest.raises(softkv.InvalidArgument, match="value_dim"):
        wide.query_soft(np.ones(4), iterations=2)
    single = softkv.Collection(4, 4)
    single.add(np.ones(4), np.ones(4))
    r = single.query_soft(np.ones(4))
    assert r.head_lse.shape == (0,) and r.head_top == () and r.iterations_run == 1
    assert single.query_hard(np.ones(4)).head_ids.shape == (0,)
