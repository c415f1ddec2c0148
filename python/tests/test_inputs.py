"""Inputs: float32 C-contiguous arrays are read in place; other dtypes and orders are converted once.
Outputs are numpy arrays owned by Python."""

import numpy as np
import pytest

import softkv


def stats():
    return softkv._softkv._input_stats()


@pytest.fixture
def coll():
    rng = np.random.default_rng(5)
    c = softkv.Collection(8, 3)
    c.add_batch(rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal((50, 3)).astype(np.float32))
    return c


def test_float32_c_contiguous_input_is_passed_without_a_copy(coll):
    q = np.linspace(-1, 1, 8, dtype=np.float32)
    Q = np.ascontiguousarray(np.tile(q, (4, 1)))
    before = stats()["conversions"]
    coll.query_soft(q)
    assert stats()["last_address"] == q.ctypes.data  # the library read the caller's own buffer
    coll.query_hard_batch(Q)
    assert stats()["last_address"] == Q.ctypes.data
    keys = np.ones((2, 8), dtype=np.float32)
    coll.add_batch(keys, np.ones((2, 3), dtype=np.float32))
    assert stats()["conversions"] == before  # nothing was converted on the way
    read_only = q.copy()
    read_only.flags.writeable = False
    coll.query_soft(read_only)
    assert stats()["last_address"] == read_only.ctypes.data and stats()["conversions"] == before


@pytest.mark.parametrize("make", [
    lambda q: q.astype(np.float64),
    lambda q: q.astype(">f4"),  # byte-swapped float32
    lambda q: np.repeat(q, 2)[::2],  # float32 but strided
    lambda q: q.tolist(),
    lambda q: (q * 4).round().astype(np.int32),
], ids=["float64", "big-endian", "strided", "list", "int32"])
def test_other_inputs_are_converted_once_and_answer_the_same(coll, make):
    q = np.linspace(-1, 1, 8, dtype=np.float32)
    given = make(q)
    expected = coll.query_soft(np.asarray(given, dtype=np.float32))
    before = stats()["conversions"]
    got = coll.query_soft(given)
    assert stats()["conversions"] == before + 1
    if isinstance(given, np.ndarray):
        assert stats()["last_address"] != given.ctypes.data
    np.testing.assert_array_equal(got.value, expected.value)


def test_fortran_order_and_transposed_batches_are_converted_once(coll):
    rng = np.random.default_rng(1)
    Q = rng.standard_normal((5, 8)).astype(np.float32)
    F = np.asfortranarray(Q)
    before = stats()["conversions"]
    np.testing.assert_array_equal(coll.query_soft_batch(F).values, coll.query_soft_batch(Q).values)
    np.testing.assert_array_equal(coll.query_hard_batch(Q.T.copy().T).ids, coll.query_hard_batch(Q).ids)
    assert stats()["conversions"] == before + 2
    n = len(coll)
    ids = coll.add_batch(np.asfortranarray(np.ones((3, 8))), np.ones((3, 3), dtype=np.float64, order="F"))
    assert len(coll) == n + 3 and ids.dtype == np.uint64
    np.testing.assert_array_equal(coll.get(int(ids[0]))[0], np.ones(8, dtype=np.float32))


def test_outputs_are_independent_arrays_owned_by_python(coll):
    q = np.ones(8, dtype=np.float32)
    r = coll.query_soft(q, top_m=2)
    first = r.value.copy()
    r.value[:] = 42  # writable, and writing to it changes nothing inside the collection
    np.testing.assert_array_equal(coll.query_soft(q).value, first)
    key, value = coll.get(0)
    key[:] = 0
    assert coll.get(0)[0].any()
    batch = coll.query_soft_batch(np.ones((3, 8)))
    values = batch.values
    del batch, coll  # the arrays outlive the answer and the collection
    assert values.shape == (3, 3) and np.isfinite(values).all() and values.base is not None
    for a in (r.value, r.top.ids, r.top.weights, values):
        assert a.flags.c_contiguous and a.flags.writeable


def test_query_input_is_never_written(coll):
    q = np.linspace(-1, 1, 8, dtype=np.float32)
    cos = softkv.Collection(8, 3, metric="cosine")
    cos.add(np.ones(8), np.ones(3))
    saved = q.copy()
    coll.query_soft(q)
    cos.query_soft(q)  # cosine normalises the query: into its own buffer, not the caller's
    np.testing.assert_array_equal(q, saved)
