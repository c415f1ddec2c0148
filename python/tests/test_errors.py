"""Every error the module can raise is softkv.Error's subclass for its ErrorCode, and a failed write stores nothing."""

import os

import numpy as np
import pytest

import softkv


def test_every_cpp_error_code_has_its_subclass_with_code_and_name():
    names = softkv._softkv._error_names()
    assert names == softkv.ERROR_NAMES  # the Python table is the C++ enum, code for code
    for code, name in names.items():
        cls = softkv.ERROR_CLASSES[code]
        assert issubclass(cls, softkv.Error) and cls.code == code and cls.name == name
        assert cls.__name__ == "".join(p.capitalize() for p in name.split("_")) and getattr(softkv, cls.__name__) is cls
        e = softkv.make_error(code, "why")
        assert type(e) is cls and (e.code, e.name, e.message, str(e)) == (code, name, "why", f"{name}: why")
        prefixed = softkv.make_error(code, f"{name}: why")  # what softkv's own messages look like
        assert str(prefixed) == f"{name}: why"  # the name once, not twice
    unknown = softkv.make_error(999, "new")
    assert type(unknown) is softkv.Error and unknown.name == "error_999"


@pytest.fixture
def small():
    c = softkv.Collection(4, 2, index="flat")
    c.add_batch(np.eye(4, dtype=np.float32), np.ones((4, 2), dtype=np.float32))
    return c


def expect(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as e:
        fn(*args, **kwargs)
    assert type(e.value) is cls and e.value.code == cls.code and e.value.message
    return e.value


@pytest.mark.parametrize("bad", [np.ones(3), np.ones(5), np.ones((1, 4)), np.ones((2, 2, 4)), np.float32(1.0), []])
def test_wrong_query_shapes_are_dimension_mismatch(small, bad):
    e = expect(softkv.DimensionMismatch, small.query_soft, bad)
    assert "shape" in e.message
    expect(softkv.DimensionMismatch, small.query_hard, bad)
    assert isinstance(e, ValueError)


@pytest.mark.parametrize("bad", [np.ones(4), np.ones((2, 5)), np.ones((2, 3)), np.ones((1, 2, 4)), np.ones((0, 4))])
def test_wrong_batch_shapes_are_dimension_mismatch(small, bad):
    expect(softkv.DimensionMismatch, small.query_soft_batch, bad)
    expect(softkv.DimensionMismatch, small.query_hard_batch, bad)
    expect(softkv.DimensionMismatch, small.query_soft_batch, bad, top_m=1)


def test_wrong_write_shapes_store_nothing(small):
    expect(softkv.DimensionMismatch, small.add, np.ones(3), np.ones(2))
    expect(softkv.DimensionMismatch, small.add, np.ones(4), np.ones(3))
    expect(softkv.DimensionMismatch, small.add_batch, np.ones((2, 4)), np.ones((3, 2)))  # row counts differ
    expect(softkv.DimensionMismatch, small.add_batch, np.ones((2, 2)), np.ones((2, 2)))  # 4 floats would be one row
    expect(softkv.DimensionMismatch, small.upsert_batch, [7], np.ones((2, 4)), np.ones((2, 2)))
    expect(softkv.DimensionMismatch, small.upsert_batch, [[7]], np.ones((1, 4)), np.ones((1, 2)))
    assert len(small) == 4 and small.next_id == 4


def test_non_finite_inputs(small):
    nan_key = np.ones((2, 4), dtype=np.float32)
    nan_key[1, 3] = np.nan
    expect(softkv.NonFinite, small.add_batch, nan_key, np.ones((2, 2)))
    expect(softkv.NonFinite, small.upsert, 9, np.ones(4), [0, np.inf])
    expect(softkv.NonFinite, small.query_soft, [0, 0, -np.inf, 0])
    expect(softkv.NonFinite, small.query_hard_batch, [[0, 0, 0, np.nan]])
    assert len(small) == 4


@pytest.mark.parametrize("options", [
    {"temperature": 0.0}, {"temperature": -1.0}, {"temperature": float("inf")}, {"temperature": 1e300},
    {"scale": 0.0}, {"scale": -2.0}, {"temperature": 1.0, "scale": 1.0},
    {"top_k": 0}, {"top_k": 3, "epsilon": 0.1}, {"epsilon": 0.0}, {"epsilon": 1.0},
    {"top_m": -1}, {"threads": -1}, {"top_k": -5}, {"ef_search": -1}, {"nprobe": -1}, {"check_sample": -1},
])
def test_bad_options_are_invalid_argument_or_non_finite(small, options):
    with pytest.raises((softkv.InvalidArgument, softkv.NonFinite)) as e:
        small.query_soft(np.ones(4), **options)
    assert e.value.code in (softkv.InvalidArgument.code, softkv.NonFinite.code)


def test_options_need_keywords_and_known_names(small):
    with pytest.raises(TypeError):
        small.query_soft(np.ones(4), 0.5)  # options are keyword-only
    with pytest.raises(TypeError):
        small.query_soft(np.ones(4), temprature=0.5)
    expect(softkv.InvalidArgument, small.query_soft_batch, np.ones((2, 4)), top_k=0)
    expect(softkv.InvalidArgument, softkv.Collection(4, 2).query_soft, np.ones(4), top_k=3)  # no index to prune with


@pytest.mark.parametrize("config", [
    {"dim": 0}, {"value_dim": 0}, {"dim": -1}, {"dim": 2**24 + 1}, {"value_dim": 2**24 + 1}, {"metric": "l2"},
    {"index": "lsh"}, {"scale": 0.0}, {"scale": float("nan")}, {"index": "hnsw", "hnsw_m": 1}, {"hnsw_m": 257},
    {"ivf_nlist": 2**16 + 1}, {"ivf_train_size": 2**32 + 1}, {"rebuild_fraction": 0.0}, {"rebuild_fraction": 1001.0},
    {"auto_threshold": -3},
])
def test_bad_configurations_are_invalid_argument(config):
    args = {"dim": 4, "value_dim": 2, **config}
    dim, value_dim = args.pop("dim"), args.pop("value_dim")
    expect(softkv.InvalidArgument, softkv.Collection, dim, value_dim, **args)
    expect(softkv.InvalidArgument, softkv.check_config, dim, value_dim, **args)


def test_extreme_accepted_configurations():
    assert softkv.check_config(2**24, 1)["dim"] == 2**24
    c = softkv.Collection(1, 2**24 // 64, index="hnsw", hnsw_m=256, hnsw_ef_construction=2**16)
    assert c.config["hnsw_m"] == 256 and len(c) == 0


def test_ids_and_lookups(small):
    expect(softkv.UnknownId, small.get, 99)
    expect(softkv.UnknownId, small.remove, 99)
    expect(softkv.UnknownId, small.remove_batch, [0, 99])
    expect(softkv.InvalidArgument, small.remove_batch, [1, 1])  # all or nothing: an id twice
    expect(softkv.InvalidArgument, small.get, -1)
    expect(softkv.InvalidArgument, small.get, 2**64)
    expect(softkv.InvalidArgument, small.get, 1.5)
    expect(softkv.InvalidArgument, small.upsert, 2**64 - 1, np.ones(4), np.ones(2))  # the reserved id
    expect(softkv.InvalidArgument, small.upsert_batch, [-1], np.ones((1, 4)), np.ones((1, 2)))
    expect(softkv.InvalidArgument, small.upsert_batch, [1.0], np.ones((1, 4)), np.ones((1, 2)))
    expect(softkv.InvalidArgument, small.remove_batch, np.array(["a"]))
    assert len(small) == 4 and isinstance(softkv.UnknownId(4, "x"), KeyError)


def test_dtypes_that_are_not_real_numbers(small):
    expect(softkv.InvalidArgument, small.query_soft, np.ones(4, dtype=np.complex64))
    expect(softkv.InvalidArgument, small.query_soft, np.array(["1", "2", "3", "4"]))
    expect(softkv.InvalidArgument, small.add, np.array([object()] * 4), np.ones(2))


def test_empty_collection_overflow_and_kernel_errors():
    empty = softkv.Collection(2, 1)
    expect(softkv.EmptyCollection, empty.query_soft, [1, 0])
    expect(softkv.EmptyCollection, empty.query_hard_batch, [[1, 0]])
    big = softkv.Collection(2, 1)
    big.add([3e38, 3e38], [1])
    expect(softkv.NumericOverflow, big.query_soft, [3e38, 3e38], scale=3e38)
    expect(softkv.Unsupported, softkv.force_simd_path, "neon")


def test_database_errors(tmp_path):
    with softkv.Database(str(tmp_path / "db"), fsync="never") as db:
        db.create_collection("a", 2, 1)
        expect(softkv.CollectionExists, db.create_collection, "a", 2, 1)
        expect(softkv.UnknownCollection, db.collection, "b")
        expect(softkv.UnknownCollection, db.add, "b", np.ones((1, 2)), np.ones((1, 1)))
        expect(softkv.UnknownCollection, db.stats, "b")
        expect(softkv.InvalidArgument, db.create_collection, "bad name!", 2, 1)
        expect(softkv.DimensionMismatch, db.add, "a", np.ones((1, 3)), np.ones((1, 1)))
        expect(softkv.UnknownId, db.remove, "a", [5])
        expect(softkv.InvalidArgument, softkv.Database, str(tmp_path / "x"), fsync="sometimes")
    expect(softkv.InvalidArgument, db.list_collections)  # closed
    db.close()  # closing twice is harmless
    (tmp_path / "file").write_text("not a directory")
    expect(softkv.IoError, softkv.Database, str(tmp_path / "file"))


def test_a_corrupt_log_is_corrupt_file_and_repair_keeps_the_prefix(tmp_path):
    path = tmp_path / "db"
    with softkv.Database(str(path), fsync="always") as db:
        db.create_collection("a", 2, 1)
        for i in range(3):
            db.add("a", np.full((1, 2), i + 1.0), np.ones((1, 1)))
    log = sorted(p for p in os.listdir(path) if p.startswith("wal-"))[-1]
    raw = bytearray((path / log).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (path / log).write_bytes(bytes(raw))
    e = expect(softkv.CorruptFile, softkv.Database, str(path))
    assert log in e.message
    lines = []
    with softkv.Database(str(path), repair=True, log=lines.append) as db:
        assert db.has_collection("a") or not db.list_collections()
    assert lines, "repair reports what it kept through the log callback"


def test_options_at_their_extremes_answer(small):
    huge = 2**63 - 1
    for options in ({"threads": huge}, {"top_k": huge}, {"ef_search": huge}, {"nprobe": huge}, {"check_sample": huge},
                    {"ef_search": 0}, {"nprobe": 0}, {"scale": 3e38},
                    {"temperature": 1e-38}, {"epsilon": 1e-30}, {"epsilon": 0.999999}, {"top_k": 1, "top_m": 1}):
        r = small.query_soft(np.ones(4), **options)
        assert np.isfinite(r.value).all() and 1 <= r.candidates <= 4, options
    r = small.query_soft(np.ones(4), top_m=2**64 - 1, check_sample=2**64 - 1, threads=2**64 - 1)  # every u64 answers
    assert len(r.top) == 4
    for field in ("top_m", "top_k", "ef_search", "nprobe", "check_sample", "threads", "iterations"):
        for bad in (2**64, -1, 1.5):  # beyond u64, negative or not an integer: InvalidArgument naming the field
            with pytest.raises(softkv.InvalidArgument, match=field):
                small.query_soft(np.ones(4), **{field: bad})


def test_a_huge_top_m_reports_every_entry(small):
    r = small.query_soft(np.ones(4), top_m=2**63 - 1)  # clamped to the candidates: nothing reserved for the rest
    assert len(r.top) == 4 and sorted(r.top.ids.tolist()) == [0, 1, 2, 3]
