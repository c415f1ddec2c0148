"""Tags and masks in the native module: storage, persistence, masked queries against numpy, typed errors."""

import numpy as np
import pytest

import softkv

MAX_TAG = 2**64 - 1


def reference(keys, values, q, scale):
    s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
    w = np.exp(s - s.max())
    return (w / w.sum()) @ values.astype(np.float64), s


@pytest.fixture
def tagged():
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((500, 12)).astype(np.float32)
    values = rng.standard_normal((500, 3)).astype(np.float32)
    tags = np.arange(500, dtype=np.uint64) % 7
    c = softkv.Collection(12, 3)
    ids = c.add_batch(keys, values, tags=tags)
    return c, keys, values, tags, ids, rng.standard_normal(12).astype(np.float32)


def test_tags_are_stored_and_returned(tagged):
    c, _, _, tags, ids, _ = tagged
    assert c.get(int(ids[3]), with_tag=True)[2] == 3
    assert len(c.get(int(ids[3]))) == 2  # the (key, value) pair of before
    new = c.add(np.ones(12), np.ones(3), tag=MAX_TAG)
    assert c.get(new, with_tag=True)[2] == MAX_TAG
    c.upsert(new, np.ones(12), np.ones(3))  # a replaced entry takes the new tag: 0 by default
    assert c.get(new, with_tag=True)[2] == 0
    c.upsert_batch([900, 901], np.ones((2, 12)), np.ones((2, 3)), tags=[5, MAX_TAG])
    assert c.get(901, with_tag=True)[2] == MAX_TAG


@pytest.mark.parametrize("mask", [dict(tags_any=[2]), dict(tags_any=np.array([0, 6], dtype=np.uint64)),
                                  dict(tag_range=(1, 3)), dict(exclude=[0, 1, 2]),
                                  dict(tags_any=[1, 2, 3, MAX_TAG], tag_range=(2, MAX_TAG), exclude=[2, 3])])
def test_masked_queries_match_numpy_on_the_eligible_rows(tagged, mask):
    c, keys, values, tags, ids, q = tagged
    keep = np.ones(len(ids), dtype=bool)
    if "tags_any" in mask:
        keep &= np.isin(tags, np.asarray(mask["tags_any"], dtype=np.uint64))
    if "tag_range" in mask:
        keep &= (tags >= mask["tag_range"][0]) & (tags <= mask["tag_range"][1])
    if "exclude" in mask:
        keep &= ~np.isin(ids, mask["exclude"])
    ref, scores = reference(keys[keep], values[keep], q, 1 / np.sqrt(12))
    r = c.query_soft(q, top_m=4, **mask)
    np.testing.assert_allclose(r.value, ref, rtol=1e-4, atol=1e-5)
    assert r.candidates == keep.sum()
    assert list(r.top.ids) == list(ids[keep][np.argsort(-scores)[:4]])
    assert c.query_hard(q, **mask).id == ids[keep][np.argmax(scores)]
    batch = c.query_soft_batch(np.stack([q, q]), **mask)
    np.testing.assert_allclose(batch.values[1], ref, rtol=1e-4, atol=1e-5)
    assert list(c.query_hard_batch(np.stack([q, q]), **mask).ids) == [ids[keep][np.argmax(scores)]] * 2


def test_mask_errors_are_typed(tagged):
    c, *_, q = tagged
    with pytest.raises(softkv.EmptyCollection):
        c.query_soft(q, tags_any=[99])
    with pytest.raises(softkv.InvalidArgument):
        c.query_soft(q, tag_range=(4, 3))
    with pytest.raises(softkv.InvalidArgument):
        c.query_hard(q, tags_any=list(range(1025)))
    with pytest.raises(softkv.InvalidArgument):
        c.query_soft(q, exclude=[-1])
    with pytest.raises(softkv.InvalidArgument):
        c.query_soft(q, tag_range=(1, 2, 3))
    with pytest.raises(softkv.InvalidArgument):
        c.query_soft(q, tags_any=[1.5])
    with pytest.raises(softkv.DimensionMismatch):
        c.add_batch(np.ones((2, 12)), np.ones((2, 3)), tags=[1])
    assert c.query_hard(q, tags_any=list(range(1024))).id >= 0  # 1024 tags: the limit itself


def test_tags_persist_through_the_log_and_snapshots(tmp_path):
    keys = np.eye(4, dtype=np.float32)
    with softkv.Database(tmp_path / "d") as db:
        db.create_collection("t", 4, 1)
        db.add("t", keys, np.ones((4, 1)), tags=[10, 20, 30, MAX_TAG])
        db.upsert("t", [1], keys[1:2], np.ones((1, 1)), tags=[21])
        with pytest.raises(softkv.DimensionMismatch):
            db.add("t", keys, np.ones((4, 1)), tags=[1, 2])
    for snapshot in (False, True):
        with softkv.Database(tmp_path / "d") as db:
            view = db.collection("t")
            assert [view.get(i, with_tag=True)[2] for i in range(4)] == [10, 21, 30, MAX_TAG]
            assert view.query_soft(keys[0], tag_range=(15, 35)).candidates == 2
            if not snapshot:
                db.snapshot()


def test_a_masked_pruned_batch_reports_each_query_s_filtering_as_the_query_alone_does():
    rng = np.random.default_rng(5)
    n, d = 3000, 8
    keys = rng.standard_normal((n, d), dtype=np.float32)
    # the graph alone (its certified lists never train): masked pruned queries over-fetch and filter
    c = softkv.Collection(d, 1, index="hnsw", hnsw_m=8, ivf_train_size=2**32)
    c.add_batch(keys, rng.standard_normal((n, 1), dtype=np.float32), tags=np.arange(n, dtype=np.uint64) % 4)
    c.wait_until_indexed()
    queries = rng.standard_normal((3, d), dtype=np.float32)
    batch = c.query_soft_batch(queries, top_k=5, tags_any=[1])
    for i, q in enumerate(queries):
        alone = c.query_soft(q, top_k=5, tags_any=[1])
        assert alone.mask_filtered_after_search  # hnsw over-fetches and filters
        assert batch.mask_filtered_after_search[i] == alone.mask_filtered_after_search
        assert batch[i].mask_filtered_after_search == alone.mask_filtered_after_search
    # with its lists: a mask keeping half the rows or more walks them, a narrower one gets flat's pass over the
    # eligible rows; either way nothing is filtered after and the bound is a guarantee
    listed = softkv.Collection(d, 1, index="hnsw", hnsw_m=8)
    listed.add_batch(keys, rng.standard_normal((n, 1), dtype=np.float32), tags=np.arange(n, dtype=np.uint64) % 4)
    listed.wait_until_indexed()
    for tags, kind in (([1, 2, 3], "ivf"), ([1], "flat")):
        batch = listed.query_soft_batch(queries, top_k=5, tags_any=tags)
        for i, q in enumerate(queries):
            alone = listed.query_soft(q, top_k=5, tags_any=tags)
            assert not alone.mask_filtered_after_search and alone.searched_with == kind and alone.tail_bound_guaranteed
            assert not batch.mask_filtered_after_search[i] and batch[i].searched_with == kind


def test_tag_errors_name_the_tag_and_its_full_range():
    c = softkv.Collection(2, 1)
    k, v = np.ones((1, 2), dtype=np.float32), np.ones((1, 1), dtype=np.float32)
    with pytest.raises(softkv.InvalidArgument, match=r"tags: element -1 is outside \[0, 2\^64 - 1\]"):
        c.add_batch(k, v, tags=[-1])
    with pytest.raises(softkv.InvalidArgument, match=r"tag_range: hi 18446744073709551616 is outside \[0, 2\^64 - 1\]"):
        c.query_soft(k[0], tag_range=(0, 1 << 64))
    assert c.add_batch(k, v, tags=[(1 << 64) - 1]).tolist() == [0]  # the largest tag is valid
    assert c.get(0, with_tag=True)[2] == (1 << 64) - 1
