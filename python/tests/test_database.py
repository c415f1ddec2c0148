"""softkv.Database from Python: write, close, reopen, same answers; views, stats, logs."""

import numpy as np
import pytest

import softkv


def test_write_close_reopen_gives_the_same_answers(tmp_path):
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((300, 16)).astype(np.float32)
    values = rng.standard_normal((300, 4)).astype(np.float32)
    queries = rng.standard_normal((5, 16)).astype(np.float32)
    path = tmp_path / "data"  # a pathlib.Path (any os.PathLike) or a str
    with softkv.Database(path) as db:
        db.create_collection("mem", 16, 4, metric="cosine", index="flat")
        ids = db.add("mem", keys[:200], values[:200])
        np.testing.assert_array_equal(ids, np.arange(200))
        db.snapshot()  # part in the snapshot, part only in the log
        db.upsert("mem", np.arange(200, 300), keys[200:], values[200:])
        db.remove("mem", [0, 7])
        db.create_collection("gone", 2, 2)
        db.drop_collection("gone")
        view = db.collection("mem")
        assert isinstance(view, softkv.CollectionView) and not isinstance(view, softkv.Collection)
        assert not hasattr(view, "add")  # writes go through the database, which logs them
        before_soft = view.query_soft_batch(queries, temperature=0.3)
        before_pruned = [view.query_soft(q, top_k=10, top_m=3) for q in queries]
        before_hard = view.query_hard_batch(queries)
        seq = db.last_sequence
        db.sync()
    with pytest.raises(softkv.InvalidArgument):
        db.stats("mem")  # the database is closed
    assert len(view) == 298  # a view outlives its database (no longer updated)

    with softkv.Database(str(path)) as db:
        assert db.list_collections() == ["mem"] and db.has_collection("mem") and not db.has_collection("gone")
        assert db.last_sequence == seq
        stats = db.stats("mem")
        assert stats["size"] == 298 and (stats["dim"], stats["value_dim"], stats["metric"], stats["index"]) == (16, 4, "cosine", "flat")
        view = db.collection("mem")
        assert 0 not in view and 299 in view
        after = view.query_soft_batch(queries, temperature=0.3)
        np.testing.assert_array_equal(after.values, before_soft.values)
        np.testing.assert_array_equal(after.lse, before_soft.lse)
        for q, b in zip(queries, before_pruned):
            a = view.query_soft(q, top_k=10, top_m=3)
            np.testing.assert_array_equal(a.value, b.value)
            assert a.top == b.top and a.tail_bound == b.tail_bound
        np.testing.assert_array_equal(view.query_hard_batch(queries).ids, before_hard.ids)
        np.testing.assert_allclose(view.get(5)[1], values[5])
        assert view.config["metric"] == "cosine"
        assert repr(view) == "<softkv.CollectionView dim=16 value_dim=4 metric=cosine index=flat size=298>"


def test_log_lines_reach_a_python_callable(tmp_path):
    path = str(tmp_path / "data")
    lines = []
    with softkv.Database(path, fsync="never", log=lines.append) as db:
        db.create_collection("c", 2, 1)
        db.add("c", np.ones((3, 2)), np.ones((3, 1)))
        db.snapshot()
    assert any("snapshot" in line for line in lines) and all(isinstance(line, str) for line in lines)


def test_a_failing_log_callable_does_not_break_the_database(tmp_path):
    def broken(line):
        raise RuntimeError("callback failed")
    path = str(tmp_path / "data")
    with softkv.Database(path) as db:
        db.create_collection("c", 2, 1)
        db.snapshot()
    with softkv.Database(path, log=broken) as db:  # the error is reported as unraisable, not raised
        assert db.list_collections() == ["c"]


def test_a_second_process_cannot_open_the_directory(tmp_path):
    import subprocess
    import sys
    path = str(tmp_path / "data")
    with softkv.Database(path):
        code = "import softkv, sys\ntry:\n softkv.Database(sys.argv[1])\nexcept softkv.Error as e:\n print(e.name)\n"
        out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "io_error", out.stderr
