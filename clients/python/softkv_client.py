"""softkv_client: a Python client for softkv-server (docs/PROTOCOL.md), standard library + numpy.

    from softkv_client import Client
    with Client(port=7878) as c:
        c.create_collection("memory", dim=128, value_dim=64)
        ids = c.add("memory", keys, values)               # numpy (n, d) and (n, dv), float32
        r = c.query_soft("memory", q, temperature=0.5, top_m=3)
        r.value, r.lse, r.top                             # numpy (dv,), float, [(id, weight, score)]
        values = c.query_soft_batch("memory", Q).values   # numpy (B, dv)

Errors from the server raise SoftkvError with the server's code (see PROTOCOL.md).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

import numpy as np

PROTOCOL_VERSION = 1
_ERROR_OPCODE = 0xFF
_REPLY_BIT = 0x80
_OP = {
    "hello": 0x01, "auth": 0x02, "ping": 0x03,
    "create": 0x10, "drop": 0x11, "list": 0x12, "describe": 0x13,
    "add": 0x20, "upsert": 0x21, "remove": 0x22, "get": 0x23,
    "query": 0x30, "snapshot": 0x40, "stats": 0x41,
}
METRICS = {"dot": 0, "cosine": 1}
INDEXES = {"exact": 0, "flat": 1, "hnsw": 2, "ivf": 3, "automatic": 4}
INDEX_NAMES = {v: k for k, v in INDEXES.items()}
ERROR_NAMES = {
    1: "dimension_mismatch", 2: "empty_collection", 3: "non_finite", 4: "unknown_id", 5: "invalid_argument",
    6: "unknown_collection", 7: "collection_exists", 8: "corrupt_file", 9: "io_error", 10: "frame_too_large",
    11: "protocol_error", 12: "unsupported", 13: "numeric_overflow", 14: "unauthenticated", 15: "server_busy",
    16: "resource_exhausted", 17: "internal",
}


class SoftkvError(Exception):
    """An error frame from the server: .code (int), .name (e.g. 'non_finite'), .message."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.name = ERROR_NAMES.get(code, f"error_{code}")
        self.message = message
        super().__init__(f"{self.name}: {message}")


@dataclass
class SoftResult:
    """One soft answer: the blended value and how it was obtained."""
    value: np.ndarray
    lse: float
    max_score: float
    candidates: int
    tail_bound: float
    tail_bound_guaranteed: bool
    searched_with: str
    top: list = field(default_factory=list)  # [(id, weight, score)], highest weight first


@dataclass
class HardResult:
    """One hard answer: the best entry's id, score and value."""
    id: int
    score: float
    value: np.ndarray
    searched_with: str


@dataclass
class SoftBatch:
    """Soft answers for B queries; .values stacks them as a (B, dv) array."""
    results: list

    @property
    def values(self) -> np.ndarray:
        return np.stack([r.value for r in self.results])


class _Writer:
    def __init__(self):
        self.parts = []

    def put(self, fmt: str, *values):
        self.parts.append(struct.pack("<" + fmt, *values))
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
            raise SoftkvError(11, "reply ends early")
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
            raise SoftkvError(11, "reply array runs past the frame")
        a = np.frombuffer(self.b, dtype="<" + np.dtype(dtype).str[1:], count=n, offset=self.at).copy()
        self.at += size
        return a


class Client:
    """One connection to softkv-server. Not thread safe: one Client per thread.

    max_frame is the largest frame sent or accepted (match the server's --max-frame): a request
    that would exceed it raises SoftkvError frame_too_large before anything is sent.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 7878, token: str | None = None, timeout: float = 60.0,
                 max_frame: int = 64 << 20):
        self.max_frame = max_frame
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 0
        r = self._call("hello", _Writer().put("H", PROTOCOL_VERSION))
        self.server_version_number = r.get("H")
        self.server_version = r.string()
        self.auth_required = bool(r.get("B"))
        if token:
            self._call("auth", _Writer().string(token))

    def close(self):
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
                raise SoftkvError(9, "the server closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _call(self, op: str, payload: _Writer) -> _Reader:
        self.next_id += 1
        body = payload.bytes()
        if 9 + len(body) > self.max_frame:  # the server's own check, made before sending: the connection stays usable
            raise SoftkvError(10, f"request frame of {9 + len(body)} bytes exceeds the limit of {self.max_frame} "
                                  "(max_frame; the server's --max-frame)")
        self.sock.sendall(struct.pack("<IBQ", 9 + len(body), _OP[op], self.next_id) + body)
        (length,) = struct.unpack("<I", self._recv_exact(4))
        if length > self.max_frame:
            raise SoftkvError(10, f"reply frame of {length} bytes exceeds the limit of {self.max_frame}")
        if length < 9:
            raise SoftkvError(11, f"reply frame length {length} is shorter than a frame header")
        frame = self._recv_exact(length)
        opcode, request_id = struct.unpack_from("<BQ", frame)
        r = _Reader(frame[9:])
        if opcode == _ERROR_OPCODE:
            code = r.get("H")
            raise SoftkvError(code, r.string())
        if opcode != _OP[op] | _REPLY_BIT or request_id != self.next_id:
            raise SoftkvError(11, f"unexpected reply opcode {opcode:#x} id {request_id}")
        return r

    # ---- operations ----
    def ping(self):
        self._call("ping", _Writer())

    def create_collection(self, name: str, dim: int, value_dim: int, metric: str = "dot", scale: float | None = None,
                          index: str = "exact", hnsw_m: int = 32, hnsw_ef_construction: int = 80, ivf_nlist: int = 0,
                          ivf_train_size: int = 0, auto_threshold: int = 10000, rebuild_fraction: float = 0.25):
        w = _Writer().string(name).put("IIBBf", dim, value_dim, METRICS[metric], scale is not None, scale or 0.0)
        w.put("BIIIQQf", INDEXES[index], hnsw_m, hnsw_ef_construction, ivf_nlist, ivf_train_size, auto_threshold, rebuild_fraction)
        self._call("create", w)

    def drop_collection(self, name: str):
        self._call("drop", _Writer().string(name))

    def list_collections(self) -> list:
        r = self._call("list", _Writer())
        return [r.string() for _ in range(r.get("I"))]

    def describe(self, name: str) -> dict:
        r = self._call("describe", _Writer().string(name))
        out = {"name": r.string(), "size": r.get("Q"), "dim": r.get("I"), "value_dim": r.get("I")}
        out["metric"] = "cosine" if r.get("B") == 1 else "dot"
        out["index"] = INDEX_NAMES.get(r.get("B"), "?")
        out["bytes_in_memory"], out["bytes_on_disk"] = r.get("QQ")
        return out

    def add(self, name: str, keys, values) -> np.ndarray:
        """Adds rows; keys (n, d) and values (n, dv). Returns the new ids once durable."""
        r = self._call("add", _Writer().string(name).array(keys, np.float32).array(values, np.float32))
        return r.array(np.uint64)

    def upsert(self, name: str, ids, keys, values):
        self._call("upsert", _Writer().string(name).array(ids, np.uint64).array(keys, np.float32).array(values, np.float32))

    def remove(self, name: str, ids):
        self._call("remove", _Writer().string(name).array(ids, np.uint64))

    def get(self, name: str, id: int):
        """Returns (key, value) as numpy arrays (the key as stored: unit length under cosine)."""
        r = self._call("get", _Writer().string(name).put("Q", id))
        r.get("Q")
        return r.array(np.float32), r.array(np.float32)

    def _query(self, name, kind, queries, temperature, scale, top_m, top_k, epsilon, ef_search, nprobe, exact) -> _Reader:
        flags = (temperature is not None) | (scale is not None) << 1 | (top_k is not None) << 2 | (epsilon is not None) << 3 | bool(exact) << 4
        w = _Writer().string(name).put("B", kind)
        w.put("BffIIfII", flags, temperature or 0.0, scale or 0.0, top_m, top_k or 0, epsilon or 0.0, ef_search, nprobe)
        return self._call("query", w.array(queries, np.float32))

    def query_soft_batch(self, name: str, queries, temperature=None, scale=None, top_m=0, top_k=None, epsilon=None,
                         ef_search=64, nprobe=16) -> SoftBatch:
        """Soft retrieval for one (d,) or many (B, d) queries."""
        r = self._query(name, 0, queries, temperature, scale, top_m, top_k, epsilon, ef_search, nprobe, False)
        results = []
        for _ in range(r.get("I")):
            lse, max_score, candidates, tail = r.get("dfQd")
            guaranteed, searched = r.get("BB")
            top = [r.get("Qff") for _ in range(r.get("I"))]
            results.append(SoftResult(r.array(np.float32), lse, max_score, candidates, tail, bool(guaranteed),
                                      INDEX_NAMES.get(searched, "?"), top))
        return SoftBatch(results)

    def query_soft(self, name: str, query, **options) -> SoftResult:
        return self.query_soft_batch(name, np.asarray(query).reshape(-1), **options).results[0]

    def query_hard_batch(self, name: str, queries, temperature=None, scale=None, exact=False, ef_search=64, nprobe=16) -> list:
        """Hard retrieval for one (d,) or many (B, d) queries: a list of HardResult."""
        r = self._query(name, 1, queries, temperature, scale, 0, None, None, ef_search, nprobe, exact)
        out = []
        for _ in range(r.get("I")):
            id_, score, searched = r.get("QfB")
            out.append(HardResult(id_, score, r.array(np.float32), INDEX_NAMES.get(searched, "?")))
        return out

    def query_hard(self, name: str, query, **options) -> HardResult:
        return self.query_hard_batch(name, np.asarray(query).reshape(-1), **options)[0]

    def snapshot(self):
        self._call("snapshot", _Writer())

    def stats(self) -> dict:
        r = self._call("stats", _Writer())
        out = {"server_version": r.string(), "simd_path": r.string()}
        out["collections"], out["connections"], out["requests"], out["last_sequence"] = r.get("QQQQ")
        return out
