"""softkv.Client: the pure-Python TCP client of softkv-server (docs/PROTOCOL.md), standard library + numpy.

    import softkv
    with softkv.Client(port=7878) as c:
        c.create_collection("memory", dim=128, value_dim=64)
        ids = c.add("memory", keys, values)               # numpy (n, d) and (n, dv); any real dtype
        r = c.query_soft("memory", q, temperature=0.5, top_m=3)
        r.value, r.lse, r.top.ids                         # numpy (dv,), float, (3,) uint64
        values = c.query_soft_batch("memory", Q).values   # numpy (B, dv)

Answers are the same classes the native module returns (softkv.SoftResult, ...), bit for bit the
library's; error frames raise the same softkv.Error subclasses (e.g. softkv.DimensionMismatch).
"""

from __future__ import annotations

import operator
import socket
import struct

import numpy as np

from ._errors import Error, make_error
from ._results import Contributors, HardBatchResult, HardResult, SoftBatchResult, SoftResult

PROTOCOL_VERSION = 3  # the highest protocol version this client speaks (docs/PROTOCOL.md)
_ERROR_OPCODE = 0xFF
_REPLY_BIT = 0x80
_OP = {
    "hello": 0x01, "auth": 0x02, "ping": 0x03,
    "create": 0x10, "drop": 0x11, "list": 0x12, "describe": 0x13, "query_stats": 0x14,
    "add": 0x20, "upsert": 0x21, "remove": 0x22, "get": 0x23,
    "query": 0x30, "snapshot": 0x40, "stats": 0x41,
}
METRICS = {"dot": 0, "cosine": 1}
INDEXES = {"exact": 0, "flat": 1, "hnsw": 2, "ivf": 3, "automatic": 4}
INDEX_NAMES = {v: k for k, v in INDEXES.items()}
PRECISIONS = {"f32": 0, "f16": 1, "bf16": 2, "i8": 3}  # compact storage (protocol version 2)

SoftkvError = Error  # the name this client's errors had before it joined the softkv package


def _queries(queries, ndim: int, what: str) -> np.ndarray:
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim != ndim:
        raise make_error(1, f"{what} has shape {q.shape}; give {'one (d,) vector' if ndim == 1 else 'a (B, d) array'}")
    return q


_U64_MAX = (1 << 64) - 1


def _u64(value, what: str) -> int:
    """An integer in [0, 2^64 - 1] (ids, tags), as the module takes it: softkv.InvalidArgument otherwise."""
    try:
        i = operator.index(value)
    except TypeError:
        raise make_error(5, f"{what} must be an integer, not {type(value).__name__}") from None
    if not 0 <= i <= _U64_MAX:
        raise make_error(5, f"{what} {i} is outside [0, 2^64 - 1]")
    return i


def _u32(value, what: str) -> int:
    """A count on the wire's u32 (top_m, top_k, ef_search, nprobe): refused, naming it, above 2^32 - 1 rather
    than truncated (as the C++ client does); softkv.InvalidArgument."""
    i = _u64(value, what)
    if i > 0xFFFFFFFF:
        raise make_error(5, f"{what} = {i} does not fit its u32 field (at most 4294967295)")
    return i


def _u64_array(values, what: str) -> np.ndarray:
    """A sequence or array of integers in [0, 2^64 - 1] as uint64: never wrapped, rounded or truncated."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "u":
            return values.astype(np.uint64).reshape(-1)
        if values.dtype.kind == "i":
            if values.size and values.min() < 0:
                raise make_error(5, f"{what}: {values.min()} is outside [0, 2^64 - 1]")
            return values.astype(np.uint64).reshape(-1)
        if values.dtype.kind != "O":
            raise make_error(5, f"{what} must hold integers, not {values.dtype}")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise make_error(5, f"{what} must be a sequence of integers")
    return np.array([_u64(v, f"{what}: element") for v in values], dtype=np.uint64)


_DENORM_MIN = struct.unpack("<f", struct.pack("<I", 1))[0]  # the smallest positive float32


def _as_f32(v) -> float:
    """v rounded to float32; inf where it overflows (put's struct.pack then reports the overflow)."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except (struct.error, OverflowError):
        return float("inf")


class _Writer:
    def __init__(self):
        self.parts = []

    def put(self, fmt: str, *values):
        # A negative float field below the float range would pack as -0 and be taken as 0 (error_target =
        # -1e-300 would ask for the exact answer): it goes as the smallest negative float, which the server
        # refuses as negative, as the native module does.
        values = tuple(-_DENORM_MIN if c == "f" and isinstance(v, (int, float)) and v < 0 and _as_f32(v) == 0 else v
                       for c, v in zip(fmt, values))
        try:
            self.parts.append(struct.pack("<" + fmt, *values))
        except (struct.error, OverflowError, TypeError) as e:  # a field outside its wire type: the caller's mistake
            raise make_error(5, f"a request field does not fit its wire type ({e})") from None
        return self

    def string(self, s: str):
        b = s.encode("utf-8")
        return self.put("H", len(b)).raw(b)

    def raw(self, b: bytes):
        self.parts.append(b)
        return self

    def array(self, a, dtype):
        a = np.ascontiguousarray(a, dtype=dtype).reshape(-1)
        return self.put("I", a.size).raw(a.astype("<" + np.dtype(dtype).str[1:], copy=False).tobytes())

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, payload: bytes):
        self.b = payload
        self.at = 0

    def get(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.b):
            raise make_error(11, "reply ends early")
        values = struct.unpack_from("<" + fmt, self.b, self.at)
        self.at += size
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.get("H")
        s = self.b[self.at:self.at + n].decode("utf-8")
        self.at += n
        return s

    def array(self, dtype) -> np.ndarray:
        n = self.get("I")
        size = n * np.dtype(dtype).itemsize
        if self.at + size > len(self.b):
            raise make_error(11, "reply array runs past the frame")
        a = np.frombuffer(self.b, dtype="<" + np.dtype(dtype).str[1:], count=n, offset=self.at).copy()
        self.at += size
        return a


class Client:
    """One connection to softkv-server. Not thread safe: one Client per thread.

    max_frame is the largest frame sent or accepted (match the server's --max-frame): a request
    that would exceed it raises softkv.FrameTooLarge before anything is sent. protocol_version is
    the highest protocol version to speak (1, 2 or 3); hello settles on min(it, the server's), kept in
    the attribute protocol_version (server_version_number is the same number, its older name).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 7878, token: str | None = None, timeout: float = 60.0,
                 max_frame: int = 64 << 20, protocol_version: int = PROTOCOL_VERSION):
        if protocol_version not in (1, 2, 3):
            raise make_error(5, f"protocol_version {protocol_version} is not one this client speaks (1, 2 or 3)")
        self.max_frame = max_frame
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 0
        r = self._call("hello", _Writer().put("H", protocol_version))
        self.protocol_version = r.get("H")
        if not 1 <= self.protocol_version <= protocol_version:
            self.sock.close()
            raise make_error(11, f"the server settled on protocol version {self.protocol_version}, which this client did not offer")
        self.server_version_number = self.protocol_version
        self.server_version = r.string()
        self.auth_required = bool(r.get("B"))
        if token:
            self._call("auth", _Writer().string(token))

    def close(self):
        """Closes the connection."""
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- framing ----
    def _recv_exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise make_error(9, "the server closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _call(self, op: str, payload: _Writer) -> _Reader:
        self.next_id += 1
        body = payload.bytes()
        if 9 + len(body) > self.max_frame:  # the server's own check, made before sending: the connection stays usable
            raise make_error(10, f"request frame of {9 + len(body)} bytes exceeds the limit of {self.max_frame} "
                                 "(max_frame; the server's --max-frame)")
        self.sock.sendall(struct.pack("<IBQ", 9 + len(body), _OP[op], self.next_id) + body)
        (length,) = struct.unpack("<I", self._recv_exact(4))
        if length > self.max_frame:
            raise make_error(10, f"reply frame of {length} bytes exceeds the limit of {self.max_frame}")
        if length < 9:
            raise make_error(11, f"reply frame length {length} is shorter than a frame header")
        frame = self._recv_exact(length)
        opcode, request_id = struct.unpack_from("<BQ", frame)
        r = _Reader(frame[9:])
        if opcode == _ERROR_OPCODE:
            code = r.get("H")
            raise make_error(code, r.string())
        if opcode != _OP[op] | _REPLY_BIT or request_id != self.next_id:
            raise make_error(11, f"unexpected reply opcode {opcode:#x} id {request_id}")
        return r

    # ---- operations ----
    def ping(self):
        """A round trip that does nothing: checks the connection (and the server's liveness)."""
        self._call("ping", _Writer())

    def create_collection(self, name: str, dim: int, value_dim: int, metric: str = "dot", scale: float | None = None,
                          index: str = "exact", hnsw_m: int = 32, hnsw_ef_construction: int = 80, ivf_nlist: int = 0,
                          ivf_train_size: int = 0, auto_threshold: int = 10000, rebuild_fraction: float = 0.25,
                          key_precision: str = "f32", value_precision: str = "f32", heads: int = 1):
        """Creates a collection; the arguments are those of softkv.Collection. Compact storage
        (key_precision / value_precision other than 'f32') and heads > 1 need protocol version 2."""
        w = _Writer().string(name).put("IIBBf", dim, value_dim, METRICS[metric], scale is not None, scale or 0.0)
        w.put("BIIIQQf", INDEXES[index], hnsw_m, hnsw_ef_construction, ivf_nlist, ivf_train_size, auto_threshold, rebuild_fraction)
        if key_precision not in PRECISIONS or value_precision not in PRECISIONS:
            raise make_error(5, f"precisions must be among {', '.join(PRECISIONS)}; got {key_precision!r}, {value_precision!r}")
        if not 0 <= heads <= 0xFFFFFFFF:
            raise make_error(5, f"heads must lie in [1, 1024], got {heads}")
        if self.protocol_version >= 2:  # (v2) compact storage, heads
            w.put("BBI", PRECISIONS[key_precision], PRECISIONS[value_precision], heads)
        elif key_precision != "f32" or value_precision != "f32":
            raise make_error(12, "compact storage needs protocol version 2; this connection speaks 1")
        elif heads != 1:
            raise make_error(12, "multi-head collections (heads > 1) need protocol version 2; this connection speaks 1")
        self._call("create", w)

    def drop_collection(self, name: str):
        """Drops a collection and its entries."""
        self._call("drop", _Writer().string(name))

    def list_collections(self) -> list:
        """Names of all collections, sorted."""
        r = self._call("list", _Writer())
        return [r.string() for _ in range(r.get("I"))]

    def query_stats(self, name: str) -> dict:
        """A collection's coalesced single queries: {'queries', 'passes', 'max_batch'} (opcode 0x14)."""
        r = self._call("query_stats", _Writer().string(name))
        queries, passes, max_batch = r.get("QQQ")
        return {"queries": queries, "passes": passes, "max_batch": max_batch}

    def describe(self, name: str) -> dict:
        """Size and shape of a collection: the dict softkv.Database.stats returns."""
        r = self._call("describe", _Writer().string(name))
        out = {"name": r.string(), "size": r.get("Q"), "dim": r.get("I"), "value_dim": r.get("I")}
        out["metric"] = "cosine" if r.get("B") == 1 else "dot"
        out["index"] = INDEX_NAMES.get(r.get("B"), "?")
        out["bytes_in_memory"], out["bytes_on_disk"] = r.get("QQ")
        if self.protocol_version >= 2:  # (v2) compact storage
            names = {v: k for k, v in PRECISIONS.items()}
            kp, vp = r.get("BB")
            out["key_precision"], out["value_precision"] = names.get(kp, "?"), names.get(vp, "?")
            out["heads"] = r.get("I")
        return out

    def add(self, name: str, keys, values, tags=None) -> np.ndarray:
        """Adds rows; keys (n, d), values (n, dv), tags None (all 0) or (n,) uint64 (protocol 2).
        Returns the new ids once durable."""
        w = _Writer().string(name).array(keys, np.float32).array(values, np.float32)
        return self._call("add", self._with_tags(w, tags)).array(np.uint64)

    def upsert(self, name: str, ids, keys, values, tags=None):
        """Inserts or replaces n entries by id: (n,) ids, (n, d) keys, (n, dv) values, tags None or (n,) (protocol 2)."""
        w = _Writer().string(name).array(_u64_array(ids, "ids"), np.uint64).array(keys, np.float32).array(values, np.float32)
        self._call("upsert", self._with_tags(w, tags))

    # ---- tags and masks: version-2 fields, refused (not dropped) on a version-1 connection ----
    def _require_v3(self, what: str):
        if self.protocol_version < 3:
            raise make_error(12, f"{what} needs protocol version 3; this connection speaks {self.protocol_version}")

    def _require_v2(self, what: str):
        if self.protocol_version < 2:
            raise make_error(12, f"{what} need protocol version 2; this connection speaks {self.protocol_version}")

    def _with_tags(self, w: _Writer, tags) -> _Writer:
        if tags is not None:
            self._require_v2("tags")
        if self.protocol_version >= 2:
            w.array(np.zeros(0) if tags is None else _u64_array(tags, "tags"), np.uint64)
        return w

    def _put_mask(self, w: _Writer, tags_any, tag_range, exclude) -> _Writer:
        if tags_any is None and tag_range is None and exclude is None:
            return w.put("I", 0).put("BQQ", 0, 0, 0).put("I", 0) if self.protocol_version >= 2 else w
        self._require_v2("query masks (tags_any, tag_range, exclude)")
        w.array(np.zeros(0) if tags_any is None else _u64_array(tags_any, "tags_any"), np.uint64)
        lo, hi = (0, 0) if tag_range is None else tag_range
        w.put("BQQ", tag_range is not None, _u64(lo, "tag_range: lo"), _u64(hi, "tag_range: hi"))
        return w.array(np.zeros(0) if exclude is None else _u64_array(exclude, "exclude"), np.uint64)

    def remove(self, name: str, ids):
        """Removes entries by id; softkv.UnknownId (removing nothing) if one is absent."""
        self._call("remove", _Writer().string(name).array(_u64_array(ids, "ids"), np.uint64))

    def get(self, name: str, id: int, with_tag: bool = False):
        """Returns (key, value) as numpy arrays (the key as stored: unit length under cosine); with_tag:
        (key, value, tag) (protocol 2)."""
        if with_tag:
            self._require_v2("tags")
        r = self._call("get", _Writer().string(name).put("Q", _u64(id, "id")))
        r.get("Q")
        key, value = r.array(np.float32), r.array(np.float32)
        tag = r.get("Q") if self.protocol_version >= 2 else 0
        return (key, value, tag) if with_tag else (key, value)

    def _query(self, name, kind, queries, temperature, scale, top_m, top_k, epsilon, ef_search, nprobe, exact,
               tags_any=None, tag_range=None, exclude=None, iterations=1, tolerance=0.0, error_target=None,
               check_sample=256) -> _Reader:
        flags = (temperature is not None) | (scale is not None) << 1 | (top_k is not None) << 2 | (epsilon is not None) << 3 | bool(exact) << 4
        w = _Writer().string(name).put("B", kind)
        w.put("BffIIfII", flags, temperature or 0.0, scale or 0.0, _u32(top_m, "top_m"), _u32(top_k or 0, "top_k"), epsilon or 0.0,
              _u32(ef_search, "ef_search"), _u32(nprobe, "nprobe"))
        self._put_mask(w, tags_any, tag_range, exclude)
        if iterations != 1 or tolerance != 0.0:
            self._require_v2("iterations and tolerance")
        if self.protocol_version >= 2:  # (v2) iterative retrieval; the server checks the ranges
            if not 0 <= iterations <= 0xFFFFFFFF:
                raise make_error(5, f"iterations must lie in [1, 1000], got {iterations}")
            w.put("If", iterations, tolerance)
        if error_target is not None or check_sample != 256:
            self._require_v3("error_target" if error_target is not None else "a check_sample other than 256")
        if self.protocol_version >= 3:  # (v3) the estimate's target and hnsw's sampled check; the server checks the ranges
            # Above 2^32 - 1 it means what 2^32 - 1 does (every omitted row checked): sent as that, as the C++ client does.
            w.put("BfI", error_target is not None, 0.0 if error_target is None else error_target,
                  min(_u64(check_sample, "check_sample"), 0xFFFFFFFF))
        return self._call("query", w.array(queries, np.float32))

    def query_soft_batch(self, name: str, queries, temperature=None, scale=None, top_m=0, top_k=None, epsilon=None,
                         ef_search=64, nprobe=16, tags_any=None, tag_range=None, exclude=None, iterations=1,
                         tolerance=0.0, error_target=None, check_sample=256) -> SoftBatchResult:
        """Soft retrieval for (B, d) queries; answers as the native Collection.query_soft_batch gives them.
        Masks (protocol 2): tags_any (tags), tag_range (lo, hi) inclusive, exclude (ids); all must hold.
        Iterative retrieval (protocol 2): iterations (1..1000) and tolerance (>= 0), each query on its own.
        Estimated answers (protocol 3): error_target (>= 0, docs/PRUNING.md); check_sample: hnsw's sampled check."""
        r = self._query(name, 0, _queries(queries, 2, "queries"), temperature, scale, top_m, top_k, epsilon, ef_search,
                        nprobe, False, tags_any, tag_range, exclude, iterations, tolerance, error_target, check_sample)
        return SoftBatchResult.from_results(self._soft_results(r), 0)

    def _soft_results(self, r: _Reader) -> list:
        results = []
        for _ in range(r.get("I")):
            lse, max_score, candidates, tail = r.get("dfQd")
            guaranteed, searched = r.get("BB")
            top = [r.get("Qff") for _ in range(r.get("I"))]
            contributors = Contributors(np.array([t[0] for t in top], dtype=np.uint64),
                                        np.array([t[1] for t in top], dtype=np.float32),
                                        np.array([t[2] for t in top], dtype=np.float32)) if top else Contributors()
            result = SoftResult(r.array(np.float32), lse, max_score, candidates, tail, bool(guaranteed),
                                INDEX_NAMES.get(searched, "?"), contributors)
            if self.protocol_version >= 2:
                result.mask_filtered_after_search = bool(r.get("B"))
                result.iterations_run, result.last_change = r.get("Id")
                lse, mx, tops = [], [], []
                for _ in range(r.get("I")):  # (v2) per-head answers, none for a single-head collection
                    head_lse, head_max = r.get("df")
                    ht = [r.get("Qff") for _ in range(r.get("I"))]
                    lse.append(head_lse)
                    mx.append(head_max)
                    tops.append(Contributors(np.array([t[0] for t in ht], dtype=np.uint64),
                                             np.array([t[1] for t in ht], dtype=np.float32),
                                             np.array([t[2] for t in ht], dtype=np.float32)) if ht else Contributors())
                result.head_lse = np.array(lse, dtype=np.float64)
                result.head_max_score = np.array(mx, dtype=np.float32)
                result.head_top = tuple(tops)
            if self.protocol_version >= 3:  # (v3) rows scored and the estimate's error
                result.rows_scored, result.error_estimate = r.get("Qd")
            results.append(result)
        return results

    def query_soft(self, name: str, query, temperature=None, scale=None, top_m=0, top_k=None, epsilon=None,
                   ef_search=64, nprobe=16, tags_any=None, tag_range=None, exclude=None, iterations=1,
                   tolerance=0.0, error_target=None, check_sample=256) -> SoftResult:
        """Soft retrieval for one (d,) query: a SoftResult. Masks, iterations and estimates as in query_soft_batch."""
        r = self._query(name, 0, _queries(query, 1, "query"), temperature, scale, top_m, top_k, epsilon, ef_search, nprobe,
                        False, tags_any, tag_range, exclude, iterations, tolerance, error_target, check_sample)
        return self._soft_results(r)[0]

    def query_hard_batch(self, name: str, queries, temperature=None, scale=None, exact=False, ef_search=64,
                         nprobe=16, tags_any=None, tag_range=None, exclude=None) -> HardBatchResult:
        """Hard retrieval for (B, d) queries: a HardBatchResult (iterating it yields HardResult). Masks as in query_soft_batch."""
        r = self._query(name, 1, _queries(queries, 2, "queries"), temperature, scale, 0, None, None, ef_search, nprobe, exact,
                        tags_any, tag_range, exclude)
        return HardBatchResult.from_results(self._hard_results(r), 0)

    def _hard_results(self, r: _Reader) -> list:
        out = []
        for _ in range(r.get("I")):
            id_, score, searched = r.get("QfB")
            result = HardResult(id_, score, r.array(np.float32), INDEX_NAMES.get(searched, "?"))
            if self.protocol_version >= 2:  # (v2) per-head winners, none for a single-head collection
                heads = [r.get("Qf") for _ in range(r.get("I"))]
                result.head_ids = np.array([h[0] for h in heads], dtype=np.uint64)
                result.head_scores = np.array([h[1] for h in heads], dtype=np.float32)
            out.append(result)
        return out

    def query_hard(self, name: str, query, temperature=None, scale=None, exact=False, ef_search=64, nprobe=16,
                   tags_any=None, tag_range=None, exclude=None) -> HardResult:
        """Hard retrieval for one (d,) query: a HardResult. Masks as in query_soft_batch."""
        r = self._query(name, 1, _queries(query, 1, "query"), temperature, scale, 0, None, None, ef_search, nprobe, exact,
                        tags_any, tag_range, exclude)
        return self._hard_results(r)[0]

    def snapshot(self):
        """Asks the server to write a snapshot now."""
        self._call("snapshot", _Writer())

    def stats(self) -> dict:
        """The server's version, kernel path and counters (collections, connections, requests, last_sequence)."""
        r = self._call("stats", _Writer())
        out = {"server_version": r.string(), "simd_path": r.string()}
        out["collections"], out["connections"], out["requests"], out["last_sequence"] = r.get("QQQQ")
        return out
