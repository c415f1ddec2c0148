"""Compact storage from Python: key_precision / value_precision on Collection and Database."""

import numpy as np
import pytest

import softkv


@pytest.mark.parametrize("kp,vp", [("f16", "f16"), ("bf16", "bf16"), ("i8", "f16"), ("i8", "f32")])
def test_compact_collection_stores_rounded_rows_and_answers_near_float32(kp, vp):
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((500, 32)).astype(np.float32)
    values = rng.standard_normal((500, 8)).astype(np.float32)
    exact = softkv.Collection(32, 8)
    small = softkv.Collection(32, 8, key_precision=kp, value_precision=vp)
    exact.add_batch(keys, values)
    small.add_batch(keys, values)
    assert small.config["key_precision"] == kp and small.config["value_precision"] == vp
    _, value = small.get(7)
    if vp == "f16":
        np.testing.assert_array_equal(value, values[7].astype(np.float16).astype(np.float32))
    q = rng.standard_normal(32).astype(np.float32)
    a, b = exact.query_soft(q), small.query_soft(q)
    np.testing.assert_allclose(b.value, a.value, atol=0.05)


def test_bad_precisions_and_out_of_range_values_raise_invalid_argument(tmp_path):
    with pytest.raises(softkv.InvalidArgument):
        softkv.Collection(4, 2, value_precision="i8")
    with pytest.raises(softkv.InvalidArgument):
        softkv.Collection(4, 2, key_precision="f8")
    c = softkv.Collection(4, 2, value_precision="f16")
    with pytest.raises(softkv.InvalidArgument):
        c.add(np.zeros(4, dtype=np.float32), np.array([1e5, 0], dtype=np.float32))
    assert len(c) == 0
    with softkv.Database(tmp_path / "d", fsync="never") as db:
        db.create_collection("c", 4, 2, key_precision="bf16", value_precision="f16")
        db.add("c", np.ones((3, 4), dtype=np.float32), np.ones((3, 2), dtype=np.float32))
        s = db.stats("c")
        assert (s["key_precision"], s["value_precision"]) == ("bf16", "f16")
        assert s["bytes_in_memory"] == 3 * (8 + 8 + 4 * 2 + 2 * 2)  # id, tag, bf16 keys, f16 values
    with softkv.Database(tmp_path / "d", fsync="never") as db:
        assert db.collection("c").config["key_precision"] == "bf16"
