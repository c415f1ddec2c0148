"""Answers of the native module against numpy float64 references: soft, hard, batches, pruned, cosine."""

import numpy as np
import pytest

import softkv
from conftest import reference_soft, unit_rows

RTOL, ATOL = 3e-5, 3e-6


def make(keys, values, **config):
    c = softkv.Collection(keys.shape[1], values.shape[1], **config)
    ids = c.add_batch(keys, values)
    np.testing.assert_array_equal(ids, np.arange(len(keys), dtype=np.uint64))
    return c


@pytest.mark.parametrize("options", [{}, {"temperature": 0.3}, {"temperature": 7.0}, {"scale": 2.5}])
def test_soft_single_matches_float64_on_every_kernel(kernel_path, data, options):
    keys, values, queries = data
    c = make(keys, values)
    scale = c.resolve_scale(**options)
    expected_scale = options.get("scale", 1 / (np.sqrt(keys.shape[1]) * options.get("temperature", 1.0)))
    assert scale == pytest.approx(expected_scale, rel=1e-6)
    for q in queries:
        r = c.query_soft(q, top_m=5, **options)
        ref, lse, m, s = reference_soft(keys, values, q, scale)
        assert isinstance(r, softkv.SoftResult) and r.value.dtype == np.float32 and r.value.shape == (values.shape[1],)
        np.testing.assert_allclose(r.value, ref, rtol=RTOL, atol=ATOL)
        assert r.lse == pytest.approx(lse, rel=1e-5)
        assert r.max_score == pytest.approx(m, rel=1e-5)
        assert (r.candidates, r.tail_bound, r.tail_bound_guaranteed, r.searched_with) == (len(keys), 0.0, True, "exact")
        order = np.argsort(-s, kind="stable")[:5]
        np.testing.assert_array_equal(r.top.ids, order)
        np.testing.assert_allclose(r.top.weights, np.exp(s[order] - lse), rtol=1e-4)
        np.testing.assert_allclose(r.top.scores, s[order], rtol=1e-5, atol=1e-6)
        assert r.top.ids.dtype == np.uint64 and r.top.weights.dtype == np.float32 and len(r.top) == 5


def test_soft_and_hard_batches_match_float64_and_the_single_queries(kernel_path, data):
    keys, values, queries = data
    c = make(keys, values)
    scale = c.resolve_scale(temperature=0.5)
    soft = c.query_soft_batch(queries, temperature=0.5)
    hard = c.query_hard_batch(queries, temperature=0.5)
    assert soft.values.shape == (len(queries), values.shape[1]) and len(soft) == len(queries)
    assert soft.lse.dtype == np.float64 and hard.ids.dtype == np.uint64 and hard.values.shape == soft.values.shape
    for i, q in enumerate(queries):
        ref, lse, m, s = reference_soft(keys, values, q, scale)
        np.testing.assert_allclose(soft.values[i], ref, rtol=RTOL, atol=ATOL)
        assert soft.lse[i] == pytest.approx(lse, rel=1e-5) and soft.max_score[i] == pytest.approx(m, rel=1e-5)
        assert soft.candidates[i] == len(keys) and soft.tail_bound[i] == 0 and soft[i].searched_with == "exact"
        best = int(np.argmax(s))
        assert hard.ids[i] == best and hard[i].id == best
        assert hard.scores[i] == pytest.approx(s[best], rel=1e-5)
        np.testing.assert_array_equal(hard.values[i], values[best])
        single = c.query_soft(q, temperature=0.5)
        np.testing.assert_allclose(soft.values[i], single.value, rtol=1e-5, atol=1e-6)
    with_top = c.query_soft_batch(queries, temperature=0.5, top_m=3)  # answered row by row, contributors included
    for i, q in enumerate(queries):
        one = c.query_soft(q, temperature=0.5, top_m=3)
        np.testing.assert_array_equal(with_top.values[i], one.value)
        assert with_top.top[i] == one.top and with_top[i].lse == one.lse


def test_hard_ties_go_to_the_smallest_id_and_cold_soft_converges_to_hard():
    c = softkv.Collection(2, 1)
    c.upsert(9, [1, 0], [9])
    c.upsert(4, [1, 0], [4])  # the same key as id 9: a tie
    c.upsert(1, [0, 1], [1])
    hard = c.query_hard([1.0, 0.1])
    assert (hard.id, float(hard.value[0])) == (4, 4.0)
    np.testing.assert_array_equal(c.query_hard_batch([[1.0, 0.1], [0.0, 1.0]]).ids, [4, 1])
    c.remove(4)
    cold = c.query_soft([1.0, 0.1], temperature=1e-4)
    hot = c.query_soft([1.0, 0.1], temperature=1e4)
    np.testing.assert_allclose(cold.value, [9.0], atol=1e-5)
    np.testing.assert_allclose(hot.value, [5.0], atol=1e-2)  # T -> inf: the plain mean of 9 and 1


def test_cosine_normalises_keys_and_queries(data):
    keys, values, queries = data
    c = make(keys * 3.0, values, metric="cosine")
    scale = c.resolve_scale()
    for q in queries[:3]:
        r = c.query_soft(q * 0.01)
        ref, _, _, _ = reference_soft(unit_rows(keys), values, unit_rows(q), scale)
        np.testing.assert_allclose(r.value, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(c.get(0)[0], unit_rows(keys[0]), rtol=1e-6)


@pytest.mark.parametrize("k", [1, 16, 100])
def test_pruned_flat_matches_the_softmax_over_the_true_top_k_with_its_tail_bound(data, k):
    keys, values, queries = data
    c = make(keys, values, index="flat")
    scale = c.resolve_scale(temperature=0.2)
    for q in queries:
        r = c.query_soft(q, temperature=0.2, top_k=k)
        s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
        top = np.argsort(-s, kind="stable")[:k]
        ref, lse, m, _ = reference_soft(keys, values, q, scale, candidates=top)
        np.testing.assert_allclose(r.value, ref, rtol=RTOL, atol=ATOL)
        assert (r.candidates, r.searched_with, r.tail_bound_guaranteed) == (k, "flat", True)
        n = len(keys)
        s_k = s[top[-1]]
        tail = (n - k) * np.exp(s_k - lse) / (1 + (n - k) * np.exp(s_k - lse))
        assert r.tail_bound == pytest.approx(tail, rel=1e-3)  # float32 scores: s_k carries ~1e-6 relative error
        true_tail = 1 - np.exp(np.logaddexp.reduce(s[top]) - np.logaddexp.reduce(s))
        assert true_tail <= r.tail_bound + 1e-6


def test_pruned_batches_and_epsilon(data):
    keys, values, queries = data
    c = make(keys, values, index="flat")
    batch = c.query_soft_batch(queries, temperature=0.05, top_k=8)
    for i, q in enumerate(queries):
        one = c.query_soft(q, temperature=0.05, top_k=8)
        np.testing.assert_array_equal(batch.values[i], one.value)
        assert batch.candidates[i] == 8 and batch.tail_bound[i] == one.tail_bound and batch.searched_with[i] == "flat"
    for q in queries:
        r = c.query_soft(q, temperature=0.05, epsilon=1e-3)
        assert r.tail_bound <= 1e-3 or r.candidates == len(keys)


def test_ivf_probing_every_list_finds_the_exact_top_k(data):
    keys, values, queries = data
    c = make(keys, values, index="ivf", ivf_nlist=8, ivf_train_size=400)
    c.wait_until_indexed()
    assert not c.index_building
    scale = c.resolve_scale(temperature=0.2)
    for q in queries[:4]:
        r = c.query_soft(q, temperature=0.2, top_k=10, nprobe=8)
        s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
        ref, _, _, _ = reference_soft(keys, values, q, scale, candidates=np.argsort(-s, kind="stable")[:10])
        np.testing.assert_allclose(r.value, ref, rtol=RTOL, atol=ATOL)
        assert (r.searched_with, r.tail_bound_guaranteed, r.candidates) == ("ivf", True, 10)
        h = c.query_hard(q, nprobe=8)
        assert h.id == int(np.argmax(s)) and h.searched_with == "ivf"
        assert c.query_hard(q, exact=True).searched_with == "exact"
    hb = c.query_hard_batch(queries[:4], nprobe=8)
    assert hb.searched_with == ("ivf",) * 4


def test_writes_replace_and_remove(data):
    keys, values, _ = data
    c = make(keys[:10], values[:10])
    c.upsert_batch(np.array([3, 100], dtype=np.int64), keys[10:12], values[10:12])
    assert len(c) == 11 and 100 in c and c.next_id == 101
    np.testing.assert_array_equal(c.get(3)[1], values[10])
    c.remove_batch([0, 1])
    c.remove(100)
    assert sorted(c.ids().tolist()) == list(range(2, 10)) and c.size() == 8
    assert c.add(keys[0], values[0]) == 101


@pytest.mark.parametrize("index", [{"index": "hnsw", "hnsw_m": 16}, {"index": "ivf", "ivf_nlist": 16, "ivf_train_size": 700}])
def test_approximate_indexes_blend_exactly_the_candidates_they_report(data, index):
    keys, values, queries = data
    c = make(keys, values, **index)
    c.wait_until_indexed()
    graph = make(keys, values, **index, ivf_train_size=2**32) if index["index"] == "hnsw" else None
    if graph:
        graph.wait_until_indexed()
    scale = c.resolve_scale(temperature=0.2)
    k = 24
    for q in queries:
        r = c.query_soft(q, temperature=0.2, top_k=k, top_m=k)  # top_m = k: the contributors are the candidates
        # certified lists answer (hnsw keeps them beside its graph): a guaranteed bound
        assert r.searched_with == "ivf" and r.tail_bound_guaranteed and r.candidates == k
        # hnsw's graph alone (lists that never train) answers with an estimated bound
        g = graph.query_soft(q, temperature=0.2, top_k=k, top_m=k) if graph else r
        if graph:
            assert g.searched_with == "hnsw" and not g.tail_bound_guaranteed and g.candidates == k
        for r in (r, g):
            assert len(set(r.top.ids.tolist())) == k
            ref, lse, m, s = reference_soft(keys, values, q, scale, candidates=r.top.ids.astype(np.int64))
            np.testing.assert_allclose(r.value, ref, rtol=RTOL, atol=ATOL)
            assert r.lse == pytest.approx(lse, rel=1e-5) and r.max_score == pytest.approx(m, rel=1e-5)
            assert 0.0 <= r.tail_bound <= 1.0


def test_the_sampled_check_changes_the_bound_never_the_answer(data):
    keys, values, queries = data
    c = make(keys, values, index="hnsw", hnsw_m=8, ivf_train_size=2**32)  # lists that never train: the graph answers
    c.wait_until_indexed()
    graph = dict(temperature=0.2, top_k=16, ef_search=16)
    for q in queries[:4]:
        plain = c.query_soft(q, check_sample=0, **graph)
        checked = c.query_soft(q, check_sample=256, **graph)
        np.testing.assert_array_equal(checked.value, plain.value)
        assert checked.candidates == plain.candidates and checked.searched_with == "hnsw"
        assert plain.tail_bound <= checked.tail_bound <= 1.0 and not checked.tail_bound_guaranteed
    batch = c.query_soft_batch(queries[:2], check_sample=256, **graph)
    assert batch.tail_bound[0] == c.query_soft(queries[0], check_sample=256, **graph).tail_bound
